"""Zero bubble pipelining, ZB-H1 (Qi et al., ICLR 2024): its tasks, a backward split in B and W.

A non-reversible stage's backward is split in two tasks: ``input_grad`` (B)
recomputes the forward from the kept input ``x`` once, sends ``dx`` (the input
part of its vjp at ``dy``) back, and keeps the vjp's residuals (and ``dy``); a
later ``weight_grad`` (W) applies the weight part ``dtheta`` from those residuals,
without recomputing. W has no consumer on another stage, so it fills the
ticks where 1F1B waits; a stage holds at most ``min(J, k)`` micro-batches
(1F1B's peak, on its first stage); the last stage's ``loss_input_grad`` is its F and B,
with its W later. The tick table is :class:`petra_jax.engine.schedules.zero_bubble.ZeroBubbleH1`;
the method row is ``zb_h1`` (:mod:`petra_jax.engine.methods.registry`).
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp

from petra_jax.engine.arrays import quantize as quantize_lib
from petra_jax.engine.methods import tasks
from petra_jax.engine.methods.context import StageContext
from petra_jax.engine.transport.pipeline_state import PipelineState, take
from petra_jax.engine.schedules import TaskKind
from petra_jax.engine.stages.stage import Stage, cross_entropy, forward
from petra_jax.engine.stages.stage_state import StageState


def input_grad_step(stage: Stage, input_grad: bool, take_stats: bool, state: StageState, x, dy):
  """B: recompute ``F_j`` at ``x``; ``(state, dx or None, residuals)``.

  ``x [B, ...]`` the kept input, ``dy`` the output's cotangent; ``residuals``:
  ``(vjp, dy)``, the vjp of one forward (a pytree of its residuals), whose
  weight part W applies. Without ``input_grad`` (stage 0) the vjp is the weights' only.
  The new BatchNorm statistics go into ``state`` here (``take_stats``).
  """
  x, dy = quantize_lib.dequantize((x, dy))
  p, bs = state.params, state.batch_stats
  if input_grad:
    _, vjp, stats = jax.vjp(lambda q, z: forward(stage, q, bs, z), p, x, has_aux=True)
    dx = vjp(dy)[1]
  else:
    _, vjp, stats = jax.vjp(lambda q: forward(stage, q, bs, x), p, has_aux=True)
    dx = None
  return state.replace(batch_stats=stats) if take_stats else state, dx, (vjp, dy)


def loss_input_grad_step(stage: Stage, state: StageState, x, labels):
  """The last stage's F and B: ``(state, dx, loss float32, residuals)``.

  ``labels int32[B]``; the loss is the mean cross-entropy (Alg. 1 l. 27-30);
  ``residuals``: ``(vjp, 1.0)``. The new BatchNorm statistics go into ``state``.
  """
  x = quantize_lib.dequantize(x)
  p, bs = state.params, state.batch_stats

  def loss_fn(q, z):
    logits, stats = forward(stage, q, bs, z)
    return cross_entropy(logits, labels), stats

  loss, vjp, stats = jax.vjp(loss_fn, p, x, has_aux=True)
  one = jnp.ones_like(loss)
  return state.replace(batch_stats=stats), vjp(one)[1], loss, (vjp, one)


def weight_grad_step(state: StageState, residuals) -> StageState:
  """W: ``dtheta = vjp(dy)[0]`` from B's residuals (the input part is not computed), and
  the update."""
  vjp, dy = residuals
  return state.apply_gradients(vjp(dy)[0], state.batch_stats)


def input_grad_task(ctx: StageContext) -> Callable:
  """Stage ``j``'s B: ``(None, dx)`` to ``j - 1``; the residuals kept for its W."""
  j, owned, send, get, steps = ctx.j, ctx.owned, ctx.send_back, ctx.state_of, ctx.steps
  take_stats = not steps.stats_in_forward
  step = steps.jit(functools.partial(input_grad_step, steps.stage, j > 0, take_stats), 0)

  def task(state: PipelineState, m: int, batches) -> tasks.TaskResult:
    _, dy = take(state.grad_inbox[j], m, "cotangent", j)
    dx = None
    if owned:
      x = take(state.buffers[j], m, "buffered input", j)
      state.stage_states[j], dx, state.weight_stash[j][m] = step(get(state), x, dy)
    if send is not None:
      state.grad_inbox[j - 1][m] = send(None, dx, m)
    return tasks.NOTHING
  return task


def weight_grad_task(ctx: StageContext) -> Callable:
  """Stage ``j``'s W: the update from the residuals its B kept."""
  j, owned, get = ctx.j, ctx.owned, ctx.state_of
  step = ctx.steps.jit(weight_grad_step, 0)

  def task(state: PipelineState, m: int, batches) -> tasks.TaskResult:
    if owned:
      residuals = take(state.weight_stash[j], m, "weight-gradient residuals", j)
      state.stage_states[j] = step(get(state), residuals)
    return tasks.NOTHING
  return task


def loss_input_grad_task(ctx: StageContext) -> Callable:
  """The last stage's F and B: ``(None, dx)`` to ``J - 2``; the residuals kept for its W."""
  j, owned, send, get, loss_home = ctx.j, ctx.owned, ctx.send_back, ctx.state_of, ctx.loss_home
  step = ctx.steps.jit(functools.partial(loss_input_grad_step, ctx.steps.stage), 0)

  def task(state: PipelineState, m: int, batches) -> tasks.TaskResult:
    x, loss, dx = take(state.inbox[j], m, "input", j), None, None
    if owned:
      labels = take(state.labels, m, "labels", j)
      state.stage_states[j], dx, loss, state.weight_stash[j][m] = step(get(state), x, labels)
    state.grad_inbox[j - 1][m] = send(None, dx, m)
    if loss_home is not None:
      loss = loss_home(loss)
    return tasks.TaskResult(loss=loss)
  return task


# The split tasks, and the whole backward and loss for tables without W (``drained``).
TASKS = {TaskKind.FORWARD: tasks.forward_task, TaskKind.INPUT_GRAD: input_grad_task, TaskKind.WEIGHT_GRAD: weight_grad_task,
         TaskKind.LOSS_INPUT_GRAD: loss_input_grad_task, TaskKind.BACKWARD: tasks.backward_task,
         TaskKind.LOSS: tasks.loss_task}
