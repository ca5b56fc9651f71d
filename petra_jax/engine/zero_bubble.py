"""Zero bubble pipelining, ZB-H1 (Qi et al., ICLR 2024): a backward split in B and W.

A non-reversible stage's backward is split in two tasks: ``input_grad`` (B)
recomputes the forward from the kept input ``x`` once, sends ``dx`` (the input
part of its vjp at ``dy``) back, and keeps the vjp's residuals (and ``dy``); a
later ``weight_grad`` (W) applies the weight part ``dtheta`` from those residuals,
without recomputing. W has no consumer on another stage, so it fills the
ticks where 1F1B waits; a stage holds at most ``min(J, k)`` micro-batches
(1F1B's peak, on its first stage); the last stage's ``loss_input_grad`` is its F and B,
with its W later. The method row is ``zb_h1`` (:mod:`petra_jax.engine.methods`).
"""

from __future__ import annotations

import functools
from typing import Callable, ClassVar, Optional, Sequence

import jax
import jax.numpy as jnp

from petra_jax.engine import packing
from petra_jax.engine import quantize as quantize_lib
from petra_jax.engine import tasks
from petra_jax.engine.context import StageContext
from petra_jax.engine.pipeline_state import PipelineState, take
from petra_jax.engine.schedule import Task, TaskKind, TickTable, as_soon_as_possible
from petra_jax.engine.stage import Stage, cross_entropy, forward
from petra_jax.engine.stage_state import StageState


class ZeroBubbleH1(TickTable):
  """ZB-H1: per stage, B before F before W, every stage holding at most 1F1B's peak.

  A stage holds a micro-batch from its F (the last stage: its ``loss``, F
  and B in one) to its W, at most ``min(J, k)`` at a time: 1F1B's peak, on
  its first stage (Qi et al., Sec. 3.1). The order is list scheduling with
  ``T_F = T_B = T_W`` (the paper's setting); ``weight_share`` is the fraction
  of a stage's backward cost that is W in :meth:`cost` (the simulator).
  """
  name, flushed = "zb_h1", True
  sends: ClassVar[dict] = {TaskKind.FORWARD: "forward", TaskKind.INPUT_GRAD: "backward", TaskKind.LOSS_INPUT_GRAD: "backward"}
  holds: ClassVar[tuple] = (TaskKind.FORWARD, TaskKind.LOSS_INPUT_GRAD)
  frees: ClassVar[str] = TaskKind.WEIGHT_GRAD
  losses: ClassVar[tuple] = (TaskKind.LOSS, TaskKind.LOSS_INPUT_GRAD)
  letters: ClassVar[dict] = {TaskKind.FORWARD: "F", TaskKind.INPUT_GRAD: "B", TaskKind.WEIGHT_GRAD: "W", TaskKind.LOSS_INPUT_GRAD: "FB"}
  weight_share: ClassVar[float] = 0.5

  @classmethod
  def stages(cls, kind: str, num_stages: int) -> range:
    """W on every stage, the loss's F and B on the last; the others as :class:`TickTable`."""
    if kind == TaskKind.WEIGHT_GRAD:
      return range(num_stages)
    if kind == TaskKind.LOSS_INPUT_GRAD:
      return range(num_stages - 1, num_stages)
    return TickTable.stages(kind, num_stages)

  @staticmethod
  def dependency(task: Task, num_stages: int) -> Optional[Task]:
    """F: the previous stage's F; B: the next stage's B (or the loss); W: none (its own B)."""
    j, kind, m = task
    if kind == TaskKind.INPUT_GRAD:
      return Task(j + 1, TaskKind.LOSS_INPUT_GRAD if j == num_stages - 2 else TaskKind.INPUT_GRAD, m)
    if kind == TaskKind.WEIGHT_GRAD:
      return None
    if kind == TaskKind.LOSS_INPUT_GRAD:
      return Task(num_stages - 2, TaskKind.FORWARD, m)
    return TickTable.dependency(task, num_stages)

  @classmethod
  def round(cls, num_stages: int, accumulation_steps: int) -> tuple:
    """One update: per stage :func:`stage_orders`, each task as early as possible."""
    J = num_stages
    order = stage_orders(J, accumulation_steps, cls.dependency)
    return tuple(as_soon_as_possible(order, lambda task: cls.dependency(task, J)))

  @classmethod
  def cost(cls, task: Task, forward_ms: Sequence[float], backward_ms: Sequence[float]) -> float:
    """W: ``weight_share`` of ``B_j`` (of ``B_{J-1} - F_{J-1}`` on the last stage); B and the
    loss: the rest; F as :class:`TickTable`."""
    j, last = task.stage, task.stage == len(backward_ms) - 1
    w = cls.weight_share * (backward_ms[j] - (forward_ms[j] if last else 0.0))
    if task.kind == TaskKind.WEIGHT_GRAD:
      return w
    if task.kind in (TaskKind.INPUT_GRAD, TaskKind.LOSS_INPUT_GRAD):
      return backward_ms[j] - w
    return TickTable.cost(task, forward_ms, backward_ms)


def stage_orders(J: int, k: int, dependency: Callable) -> list:
  """Per stage, its tasks in order: event-driven list scheduling with unit costs (the loss F + B:
  2). A free stage starts the first ready task of B, F (below ``min(J, k)`` held), W."""
  free, done, order = [0] * J, {}, [[] for _ in range(J)]
  nf, nb, nw = [0] * J, [0] * J, [0] * J
  while nw != [k] * J:
    start, j, task = min(_next(j, J, k, nf[j], nb[j], nw[j], free[j], done, dependency)
                         for j in range(J) if nw[j] < k)
    free[j] = done[task] = start + (2 if task.kind == TaskKind.LOSS_INPUT_GRAD else 1)
    order[j].append(task)
    counter = {TaskKind.INPUT_GRAD: nb, TaskKind.WEIGHT_GRAD: nw}.get(task.kind, nf)
    counter[j] += 1
  return order


def _next(j, J, k, nf, nb, nw, free, done, dependency) -> tuple:
  """``(start, j, task)``: stage ``j``'s next task (start ``inf`` if none is ready yet)."""
  last, candidates = j == J - 1, []
  if not last and nb < nf:
    candidates.append(Task(j, TaskKind.INPUT_GRAD, nb))
  if nf < k and nf - nw < min(J, k):
    candidates.append(Task(j, TaskKind.LOSS_INPUT_GRAD if last else TaskKind.FORWARD, nf))
  if nw < (nf if last else nb):
    candidates.append(Task(j, TaskKind.WEIGHT_GRAD, nw))
  best = (float("inf"), j, Task(j, TaskKind.WEIGHT_GRAD, nw))
  for task in candidates:
    dep = dependency(task, J)
    if dep is None or dep in done:
      start = max(free, done.get(dep, 0))
      if start < best[0]:
        best = (start, j, task)
  return best


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


def _jit(fn: Callable, donate_argnums) -> Callable:
  return jax.jit(packing.on_packed(fn), donate_argnums=donate_argnums)


def input_grad_task(ctx: StageContext) -> Callable:
  """Stage ``j``'s B: ``(None, dx)`` to ``j - 1``; the residuals kept for its W."""
  j, owned, send, get = ctx.j, ctx.owned, ctx.send_back, ctx.state_of
  take_stats = not ctx.steps.stats_in_forward
  step = _jit(functools.partial(input_grad_step, ctx.stage, j > 0, take_stats), 0)

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
  step = _jit(weight_grad_step, 0)

  def task(state: PipelineState, m: int, batches) -> tasks.TaskResult:
    if owned:
      residuals = take(state.weight_stash[j], m, "weight-gradient residuals", j)
      state.stage_states[j] = step(get(state), residuals)
    return tasks.NOTHING
  return task


def loss_input_grad_task(ctx: StageContext) -> Callable:
  """The last stage's F and B: ``(None, dx)`` to ``J - 2``; the residuals kept for its W."""
  j, owned, send, get, loss_home = ctx.j, ctx.owned, ctx.send_back, ctx.state_of, ctx.loss_home
  step = _jit(functools.partial(loss_input_grad_step, ctx.stage), 0)

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
