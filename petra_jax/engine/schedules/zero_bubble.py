"""Zero bubble pipelining, ZB-H1 (Qi et al., ICLR 2024): its tick table.

A non-reversible stage's backward is split in two tasks: ``input_grad`` (B)
sends ``dx`` back and ``weight_grad`` (W) applies ``dtheta`` later, from B's
residuals. W has no consumer on another stage, so it fills the ticks where
1F1B waits; a stage holds at most ``min(J, k)`` micro-batches (1F1B's peak, on
its first stage); the last stage's ``loss_input_grad`` is its F and B, with
its W later. The tasks are :mod:`petra_jax.engine.methods.zero_bubble`; the
method row is ``zb_h1`` (:mod:`petra_jax.engine.methods.registry`).
"""

from __future__ import annotations

from typing import Callable, ClassVar, Optional, Sequence

from petra_jax.engine.schedules.tick_table import Task, TaskKind, TickTable, as_soon_as_possible


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
