"""The engine's forward and backward tasks of one stage, and the two fused.

Built once per stage by :class:`petra_jax.engine.pipeline.Pipeline` (its
``_plan``): each task function takes its messages from the state's boxes,
calls the stage's jitted step through :class:`petra_jax.engine.steps.StageSteps`
and sends what it produced. A forward and a backward are each split in a
``begin`` (take the inputs) and an ``end`` (keep and send the outputs), so
that :func:`pair_task`, the two in one jitted call (a stage's steady-state
tick: :func:`petra_jax.engine.steps.fused_step`), shares them with
:func:`forward_task` and :func:`backward_task`: same messages, same order,
same results.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from petra_jax.engine.state import PipelineState, TaskResult, copy_tree, take

if TYPE_CHECKING:
  from petra_jax.engine.pipeline import Pipeline

_NOTHING = TaskResult()


def stage_state(pipe: "Pipeline", j: int) -> Callable:
  """``state -> stage j's state`` as the hot path passes it to the steps:
  packed where the pipeline packs states (:attr:`Pipeline.packs`), else as
  stored. A task stores its step's new state in ``state.stage_states[j]``."""
  if pipe.packs:
    return lambda state: state.packed(j)
  return lambda state: state.stage_states[j]


def forward_task(pipe: "Pipeline", j: int) -> Callable:
  """Stage ``j``'s forward: ``x_{j+1} = F_j(x_j, theta_j^t)`` to ``j+1``."""
  steps, local, stashes = pipe.steps, pipe.local[j], pipe.method.stashes_weights
  begin, end = forward_halves(pipe, j)
  get = stage_state(pipe, j)

  def task(state: PipelineState, m: int, batches) -> TaskResult:
    x, y, kept = begin(state, m, batches), None, None
    if local:
      st = get(state)
      params = steps.predicted_params(j, st)  # None: the current weights
      y, stats = steps.forward(j, st, x, params)
      if stashes:  # copied: the backward donates
        kept = steps.current_params(j, st) if params is None else copy_tree(params)
      if steps.stats_in_forward:
        state.stage_states[j] = steps.with_stats(j, st, stats)
    end(state, m, x, y, kept)
    return _NOTHING
  return task


def forward_halves(pipe: "Pipeline", j: int) -> tuple:
  """``(begin, end)`` of stage ``j``'s forward around its step: ``begin(state,
  m, batches) -> x`` feeds stage 0 and takes the input; ``end(state, m, x,
  y, kept)`` keeps the stashed weights and the input (if the method does)
  and sends ``y`` to ``j+1``."""
  feed, local, buffers = pipe._feed if j == 0 else None, pipe.local[j], pipe.steps.buffers_input[j]
  send, encode = pipe.messages.route("forward", j, j + 1), pipe.messages.encode

  def begin(state: PipelineState, m: int, batches):
    if feed is not None:
      feed(state, m, batches)
    return take(state.inbox[j], m, "input", j)

  def end(state: PipelineState, m: int, x, y, kept) -> None:
    if kept is not None:
      state.weight_stash[j][m] = kept
    if local and buffers:
      state.buffers[j][m] = encode("buffer", x, j, m)
    state.inbox[j + 1][m] = send(y, m)
  return begin, end


def backward_task(pipe: "Pipeline", j: int) -> Callable:
  """Stage ``j``'s backward and update; ``(x~_j or None, delta_j)`` to ``j-1``."""
  steps, local, reconstructs = pipe.steps, pipe.local[j], pipe.reconstructs[j]
  begin, end = backward_halves(pipe, j)

  def task(state: PipelineState, m: int, batches) -> TaskResult:
    x, args = begin(state, m)
    out = steps.backward(j, *args) if local else (None, None)
    x_tilde = end(state, m, x, out)
    return TaskResult(x_tilde=x_tilde) if reconstructs else _NOTHING
  return task


def backward_halves(pipe: "Pipeline", j: int) -> tuple:
  """``(begin, end)`` of stage ``j``'s backward around its step: ``begin(state,
  m) -> (buffered x, (stage state, *step args))`` takes the message, buffer and stash;
  ``end(state, m, x, step outputs) -> x~ or None`` keeps the new state and
  sends ``(x~ or x or None, delta_j)`` to ``j-1``."""
  steps, local, reconstructs = pipe.steps, pipe.local[j], pipe.reconstructs[j]
  stashes, buffers = pipe.method.stashes_weights, steps.buffers_input[j]
  send, get = pipe._send_back(j), stage_state(pipe, j)

  def begin(state: PipelineState, m: int):
    message = take(state.grad_inbox[j], m, "cotangent", j)
    if not local:  # another process's stage: only the transfer runs here
      return None, None
    y, dy = message
    x = take(state.buffers[j], m, "buffered input", j) if buffers else None
    stashed = take(state.weight_stash[j], m, "stashed weights", j) if stashes else None
    return x, (get(state),) + steps.backward_args(j, x=x, y=y, dy=dy, stashed=stashed)

  def end(state: PipelineState, m: int, x, out):
    x_tilde = None
    if local:
      state.stage_states[j] = out[0]
      x_tilde = x = out[1] if reconstructs else x
    if send is not None:
      state.grad_inbox[j - 1][m] = send(x, out[-1], m)
    return x_tilde
  return begin, end


def pair_task(pipe: "Pipeline", j: int) -> Callable:
  """Stage ``j``'s forward of ``m`` then backward of ``n`` in one jitted
  call (:meth:`StageSteps.forward_backward`), with the two tasks' results
  (a local stage's only)."""
  steps = pipe.steps
  (f_begin, f_end), (b_begin, b_end) = forward_halves(pipe, j), backward_halves(pipe, j)

  def task(state: PipelineState, m: int, n: int, batches) -> None:
    x = f_begin(state, m, batches)
    xb, args = b_begin(state, n)
    (y, kept), out = steps.forward_backward(j, args[0], x, *args[1:])
    f_end(state, m, x, y, kept)
    b_end(state, n, xb, out)
  return task
