"""The end-to-end methods' tasks ``(state, m, batches) -> TaskResult`` of one stage, and observers.

A forward and a backward are each a ``begin`` (take inputs) and an ``end``
(keep and send outputs), shared with :func:`pair_task`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp

from petra_jax.engine import packing, transport
from petra_jax.engine.pipeline_state import PipelineState, take
from petra_jax.engine.schedule import Task

if TYPE_CHECKING:
  from petra_jax.engine.pipeline import Pipeline

PyTree = Any
_LOSS_SPEC = jax.ShapeDtypeStruct((), jnp.float32)


class TickOutput(NamedTuple):
  """The loss of one micro-batch (float32 scalar, still on its device)."""
  micro_batch: int
  loss: jax.Array


class TaskResult(NamedTuple):
  """A task's float32 loss, and the input ``x~`` a reconstructing backward rebuilt (Eq. 5)."""
  loss: Optional[jax.Array] = None
  x_tilde: Optional[PyTree] = None


NOTHING = TaskResult()


class Observer:
  """Diagnostics called around every task; hooks may read ``state``, never change it."""

  def before_task(self, pipe: "Pipeline", state: PipelineState, task: Task) -> None:
    pass

  def after_task(self, pipe: "Pipeline", state: PipelineState, task: Task,
                 result: TaskResult) -> None:
    pass


@jax.jit
def copy_tree(tree: PyTree) -> PyTree:
  """A fresh copy of every array of ``tree`` (for a donating step)."""
  return jax.tree.map(jnp.copy, tree)


def feed(pipe: "Pipeline", state: PipelineState, m: int, batches) -> None:
  """Micro-batch ``m``'s images to stage 0, its labels to the last stage."""
  images, labels = batches(m)
  first, last = pipe.placements[0], pipe.placements[-1]
  state.inbox[0][m] = (transport.send_if_elsewhere(images, first.batch, first.batch_sharding)
                       if pipe.local[0] else None)
  if pipe.local[-1]:
    state.labels[m] = transport.send_if_elsewhere(labels, last.batch, last.batch_sharding)


def stage_state(pipe: "Pipeline", j: int) -> Callable:
  """``state -> stage j's state`` as the steps take it (packed where the pipeline packs)."""
  if not pipe.regime.pack:
    return lambda state: state.stage_states[j]

  def get(state: PipelineState):
    s = state.stage_states[j]
    if not isinstance(s, packing.PackedState):
      s = state.stage_states[j] = packing.pack(s)
    return s
  return get


def send_back(pipe: "Pipeline", j: int) -> Optional[Callable]:
  """``(x, dx, m) -> (x or None, delta_j)`` on stage ``j-1``; None for stage 0."""
  if j == 0:
    return None
  back = pipe.reconstructs[j - 1]
  route = pipe.messages.route("backward", j, j - 1, first=back)
  return lambda x, dx, m: route((x if back else None, dx), m)


def forward_task(pipe: "Pipeline", j: int) -> Callable:
  """Stage ``j``'s forward: ``x_{j+1} = F_j(x_j, theta_j^t)`` to ``j+1``."""
  steps, local, stashes = pipe.steps, pipe.local[j], pipe.keeps[j].weights
  begin, end = forward_halves(pipe, j)
  get = stage_state(pipe, j)

  def task(state: PipelineState, m: int, batches) -> TaskResult:
    x, y, kept = begin(state, m, batches), None, None
    if local:
      st = get(state)
      params = steps.predicted_params(j, st)
      y, stats = steps.forward(j, st, x, params)
      if stashes:
        kept = steps.current_params(j, st) if params is None else copy_tree(params)
      if steps.stats_in_forward:
        state.stage_states[j] = steps.with_stats(j, st, stats)
    end(state, m, x, y, kept)
    return NOTHING
  return task


def forward_halves(pipe: "Pipeline", j: int) -> tuple:
  """``(begin(state, m, batches) -> x, end(state, m, x, y, kept))`` of stage ``j``'s forward."""
  local, buffers = pipe.local[j], pipe.keeps[j].input
  send, encode = pipe.messages.route("forward", j, j + 1), pipe.messages.encode

  def begin(state: PipelineState, m: int, batches):
    if j == 0:
      feed(pipe, state, m, batches)
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
    return TaskResult(x_tilde=x_tilde) if reconstructs else NOTHING
  return task


def backward_halves(pipe: "Pipeline", j: int) -> tuple:
  """``(begin(state, m) -> (x, args), end(state, m, x, outputs) -> x~ or None)``."""
  steps, local, reconstructs = pipe.steps, pipe.local[j], pipe.reconstructs[j]
  stashes, buffers = pipe.keeps[j].weights, pipe.keeps[j].input
  send, get = send_back(pipe, j), stage_state(pipe, j)

  def begin(state: PipelineState, m: int):
    message = take(state.grad_inbox[j], m, "cotangent", j)
    if not local:
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
  """Stage ``j``'s forward of ``m`` then backward of ``n`` in one jitted call."""
  steps = pipe.steps
  (f_begin, f_end), (b_begin, b_end) = forward_halves(pipe, j), backward_halves(pipe, j)

  def task(state: PipelineState, m: int, n: int, batches) -> None:
    x = f_begin(state, m, batches)
    xb, args = b_begin(state, n)
    (y, kept), out = steps.forward_backward(j, args[0], x, *args[1:])
    f_end(state, m, x, y, kept)
    b_end(state, n, xb, out)
  return task


def loss_task(pipe: "Pipeline", j: int) -> Callable:
  """The last stage's forward, loss and backward (Alg. 1, l. 27-30)."""
  steps, local, multiprocess = pipe.steps, pipe.local[j], pipe.multiprocess
  send, get = send_back(pipe, j), stage_state(pipe, j)

  def task(state: PipelineState, m: int, batches) -> TaskResult:
    x, loss, dx = take(state.inbox[j], m, "input", j), None, None
    if local:
      labels = take(state.labels, m, "labels", j)
      state.stage_states[j], dx, loss = steps.backward(j, get(state), x, labels)
    state.grad_inbox[j - 1][m] = send(x, dx, m)
    if multiprocess and pipe.send_losses:
      loss = pipe.messages.move(loss, j, 0, _LOSS_SPEC)
    return TaskResult(loss=loss)
  return task


def backprop_task(pipe: "Pipeline", j: int) -> Callable:
  """``jax.grad`` of the composed model on one device."""
  def task(state: PipelineState, m: int, batches) -> TaskResult:
    feed(pipe, state, m, batches)
    images = take(state.inbox[0], m, "input", 0)
    labels = take(state.labels, m, "labels", 0)
    state.stage_states, loss = pipe.steps.backprop(state.train_states, images, labels)
    return TaskResult(loss=loss)
  return task
