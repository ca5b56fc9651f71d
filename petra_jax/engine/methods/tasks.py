"""The end-to-end methods' tasks ``(state, m, batches) -> TaskResult`` of one stage.

Each builder takes the stage's :class:`StageContext` only. A forward and a
backward are each a ``begin`` (take inputs) and an ``end`` (keep and send
outputs), shared with :func:`pair_task`.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp

from petra_jax.engine.methods.context import StageContext
from petra_jax.engine.transport.pipeline_state import PipelineState, take

PyTree = Any


class TickOutput(NamedTuple):
  """The loss of one micro-batch (float32 scalar, still on its device)."""
  micro_batch: int
  loss: jax.Array


class TaskResult(NamedTuple):
  """A task's float32 loss, and the input ``x~`` a reconstructing backward rebuilt (Eq. 5)."""
  loss: Optional[jax.Array] = None
  x_tilde: Optional[PyTree] = None


NOTHING = TaskResult()


@jax.jit
def copy_tree(tree: PyTree) -> PyTree:
  """A fresh copy of every array of ``tree`` (for a donating step)."""
  return jax.tree.map(jnp.copy, tree)


def forward_task(ctx: StageContext) -> Callable:
  """Stage ``j``'s forward: ``x_{j+1} = F_j(x_j, theta_j^t)`` to ``j+1``."""
  steps, owned, stashes, get = ctx.steps, ctx.owned, ctx.keeps.weights, ctx.state_of
  begin, end = forward_halves(ctx)

  def task(state: PipelineState, m: int, batches) -> TaskResult:
    x, y, kept = begin(state, m, batches), None, None
    if owned:
      st = get(state)
      # Weight prediction (a compensation) runs the forward on weights extrapolated to when
      # this micro-batch's gradient will arrive; None means the current weights.
      params = steps.predicted_params(st)
      y, stats = steps.forward(st, x, params)
      if stashes:
        # Stashing methods (delayed, approximate_input) take the backward on the forward's
        # weights; a copy, because the next step donates (frees) the stage's state.
        kept = steps.current_params(st) if params is None else copy_tree(params)
      if steps.stats_in_forward:
        # BatchNorm running statistics move with every forward, not with the update.
        state.stage_states[ctx.j] = steps.with_stats(st, stats)
    end(state, m, x, y, kept)
    return NOTHING
  return task


def forward_halves(ctx: StageContext) -> tuple:
  """``(begin(state, m, batches) -> x, end(state, m, x, y, kept))`` of stage ``j``'s forward."""
  j, feed, send, encode = ctx.j, ctx.feed, ctx.send, ctx.encode
  keeps_input = ctx.owned and ctx.keeps.input

  def begin(state: PipelineState, m: int, batches):
    if feed is not None:
      feed(state, m, batches)
    return take(state.inbox[j], m, "input", j)

  def end(state: PipelineState, m: int, x, y, kept) -> None:
    if kept is not None:
      state.weight_stash[j][m] = kept
    if keeps_input:
      # Only a stage that cannot invert itself keeps x_j (PETRA: the stem and downsampling
      # stages): it waits tau_j = 2(J-1-j) ticks for its cotangent. A reversible stage keeps
      # nothing and rebuilds x_j from y_j in its backward (Eq. 5).
      state.buffers[j][m] = encode(x, m)
    # y waits in stage j+1's inbox until j+1's forward on the next tick.
    state.inbox[j + 1][m] = send(y, m)
  return begin, end


def backward_task(ctx: StageContext) -> Callable:
  """Stage ``j``'s backward and update; ``(x~_j or None, delta_j)`` to ``j-1``."""
  steps, owned, reconstructs = ctx.steps, ctx.owned, ctx.steps.reconstructs
  begin, end = backward_halves(ctx)

  def task(state: PipelineState, m: int, batches) -> TaskResult:
    x, args = begin(state, m)
    out = steps.backward(*args) if owned else (None, None)
    x_tilde = end(state, m, x, out)
    return TaskResult(x_tilde=x_tilde) if reconstructs else NOTHING
  return task


def backward_halves(ctx: StageContext) -> tuple:
  """``(begin(state, m) -> (x, args), end(state, m, x, outputs) -> x~ or None)``."""
  j, owned, send, get = ctx.j, ctx.owned, ctx.send_back, ctx.state_of
  reconstructs = ctx.steps.reconstructs

  def begin(state: PipelineState, m: int):
    x, args = _backward_inputs(ctx, state, m, take)
    return x, None if args is None else (get(state),) + args

  def end(state: PipelineState, m: int, x, out):
    x_tilde = None
    if owned:
      state.stage_states[j] = out[0]  # the update (or the accumulated gradient) is applied
      # A reconstructing backward rebuilt x~_j from y_j with the *current* weights; sending it
      # down lets stage j-1 rebuild its own input in turn, so no activation is stored.
      x_tilde = x = out[1] if reconstructs else x
    if send is not None:
      # (x~_j or None, delta_j) waits in j-1's grad_inbox for j-1's backward on the next tick.
      state.grad_inbox[j - 1][m] = send(x, out[-1], m)
    return x_tilde
  return begin, end


def backward_args(ctx: StageContext, state: PipelineState, m: int) -> tuple:
  """Stage ``j``'s backward arguments for micro-batch ``m`` (after its state), left in place.

  What its backward (or loss) task will take: for the observers, which look before it runs.
  """
  return _backward_inputs(ctx, state, m, _peek)[1]


def _peek(box: dict, m: int, what: str, j: int):
  """Micro-batch ``m``'s entry of ``box``, left in place (:func:`take` without the pop)."""
  return box[m]


def _backward_inputs(ctx: StageContext, state: PipelineState, m: int, read: Callable) -> tuple:
  """``(x, args or None)`` of stage ``j``'s backward on micro-batch ``m``, each read by
  ``read(box, m, what, j)``: the cotangent message (or the last stage's input) always,
  then, if owned, what the stage kept (its input, its stashed weights) or the labels."""
  j, steps = ctx.j, ctx.steps
  if ctx.last:
    x = read(state.inbox[j], m, "input", j)
    if not ctx.owned:
      return x, None
    return x, steps.backward_args(x=x, labels=read(state.labels, m, "labels", j))
  message = read(state.grad_inbox[j], m, "cotangent", j)
  if not ctx.owned:
    return None, None
  y, dy = message  # y: this stage's output as j+1 rebuilt it; dy: the cotangent delta_{j+1}
  x = read(state.buffers[j], m, "buffered input", j) if ctx.keeps.input else None
  stashed = read(state.weight_stash[j], m, "stashed weights", j) if ctx.keeps.weights else None
  return x, steps.backward_args(x=x, y=y, dy=dy, stashed=stashed)


def pair_task(ctx: StageContext) -> Callable:
  """Stage ``j``'s forward of ``m`` then backward of ``n`` in one jitted call."""
  steps = ctx.steps
  (f_begin, f_end), (b_begin, b_end) = forward_halves(ctx), backward_halves(ctx)

  def task(state: PipelineState, m: int, n: int, batches) -> None:
    x = f_begin(state, m, batches)
    xb, args = b_begin(state, n)
    (y, kept), out = steps.forward_backward(args[0], x, *args[1:])
    f_end(state, m, x, y, kept)
    b_end(state, n, xb, out)
  return task


def loss_task(ctx: StageContext) -> Callable:
  """The last stage's forward, loss and backward (Alg. 1, l. 27-30)."""
  j, steps, owned, send, get = ctx.j, ctx.steps, ctx.owned, ctx.send_back, ctx.state_of
  loss_home = ctx.loss_home

  def task(state: PipelineState, m: int, batches) -> TaskResult:
    # Forward, loss and backward in one tick: the last stage's gradient is never late (tau = 0).
    (x, args), loss, dx = _backward_inputs(ctx, state, m, take), None, None
    if owned:
      state.stage_states[j], dx, loss = steps.backward(get(state), *args)
    state.grad_inbox[j - 1][m] = send(x, dx, m)
    if loss_home is not None:
      loss = loss_home(loss)
    return TaskResult(loss=loss)
  return task


def backprop_task(ctx: StageContext) -> Callable:
  """``jax.grad`` of the composed model on one device."""
  feed, backprop = ctx.feed, ctx.backprop

  def task(state: PipelineState, m: int, batches) -> TaskResult:
    feed(state, m, batches)
    images = take(state.inbox[0], m, "input", 0)
    labels = take(state.labels, m, "labels", 0)
    state.stage_states, loss = backprop(state.train_states, images, labels)
    return TaskResult(loss=loss)
  return task
