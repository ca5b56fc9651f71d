"""Schedule families as data: tick ``t`` holds tasks ``(stage, kind, micro_batch)``.

Each schedule family is one :class:`TickTable` subclass, registered by its
``name`` in :data:`TICK_TABLES`: which stages run which task kind, its tick
table, and the message each task consumes. Stages ``j = 0 .. J-1``; the last
stage's task is ``loss``. :class:`Stream` (paper Alg. 1: micro-batch ``m``
forward at stage ``j`` on tick ``m + j``, backward on tick ``m + 2(J-1) - j``,
delay ``tau_j = 2(J-1-j)``); :class:`ForwardOnly` (the stream without
backwards); :class:`Drained` (one micro-batch at a time, no delay);
:class:`GPipe` and :class:`OneFOneB` (flushed every update of ``k``);
:class:`Sequential` (one ``backprop`` task per tick). Zero bubble's family is
in :mod:`.zero_bubble`; :class:`.schedule.Schedule` is one family's table over
``M`` micro-batches.
"""

from __future__ import annotations

import enum
import functools
from typing import ClassVar, NamedTuple, Optional, Sequence


class TaskKind(enum.StrEnum):
  """What a task does to its micro-batch; equal to its old string (``"forward"``...).

  ``FORWARD``: ``x_{j+1} = F_j(x_j)``, sent to ``j + 1``; ``BACKWARD``: the
  vjp at the cotangent from ``j + 1``, sent to ``j - 1``; ``LOSS``: the last
  stage's forward, loss and backward; ``BACKPROP``: ``jax.grad`` of the whole
  model. Zero bubble (ZB-H1) splits a backward in ``INPUT_GRAD`` (B: the input
  part, sent back) and ``WEIGHT_GRAD`` (W: the weight part, later);
  ``LOSS_INPUT_GRAD`` is the last stage's F and B.

  Raises (on ``TaskKind(name)``):
    ValueError: an unknown kind (e.g. a typo).
  """
  FORWARD = "forward"
  BACKWARD = "backward"
  LOSS = "loss"
  BACKPROP = "backprop"
  INPUT_GRAD = "input_grad"
  WEIGHT_GRAD = "weight_grad"
  LOSS_INPUT_GRAD = "loss_input_grad"


class _Task(NamedTuple):
  stage: int
  kind: TaskKind
  micro_batch: int


class Task(_Task):
  """Stage ``stage``'s task of ``kind`` on micro-batch ``micro_batch`` (a named tuple).

  Raises:
    ValueError: ``kind`` not a :class:`TaskKind` value (e.g. ``"forwrd"``).
  """
  __slots__ = ()

  def __new__(cls, stage: int, kind, micro_batch: int):
    return super().__new__(cls, stage, TaskKind(kind), micro_batch)


Tick = tuple  # tuple[Task, ...]


def require_stages(num_stages: int) -> None:
  """Raises ValueError if ``num_stages < 2``."""
  if num_stages < 2:
    raise ValueError(f"a pipeline needs at least 2 stages, got {num_stages}: split the model "
                     "into 2 or more stages.")


def delay(j: int, num_stages: int) -> int:
  """Delay ``tau_j = 2(J-1-j)`` in ticks of 0-indexed stage ``j`` of ``J``.

  Raises:
    ValueError: ``j`` outside ``[0, J)``.
  """
  if not 0 <= j < num_stages:
    raise ValueError(f"stage {j} outside [0, {num_stages})")
  return 2 * (num_stages - 1 - j)


def drain_ticks(num_stages: int) -> int:
  """Ticks without new input after which a stream is empty: ``2(J-1)``."""
  return 2 * (num_stages - 1)


def _stream_tick(t: int, J: int, M: int, backward: bool = True) -> Tick:
  """Tasks of tick ``t`` of the stream over micro-batches ``[0, M)``."""
  tasks = []
  for j in range(J - 1):
    for kind, m in ((TaskKind.FORWARD, t - j), (TaskKind.BACKWARD, t - 2 * (J - 1) + j))[:2 if backward else 1]:
      if 0 <= m < M:
        tasks.append(Task(j, kind, m))
  if 0 <= t - (J - 1) < M:
    tasks.append(Task(J - 1, TaskKind.LOSS, t - (J - 1)))
  return tuple(tasks)


def _gpipe_round(J: int, k: int) -> list:
  """One update of GPipe: forwards of ``k`` micro-batches, then backwards."""
  cells: dict[int, list] = {}
  for m in range(k):
    for j in range(J - 1):
      cells.setdefault(m + j, []).append(Task(j, TaskKind.FORWARD, m))
    cells.setdefault(m + J - 1, []).append(Task(J - 1, TaskKind.LOSS, m))
    for j in range(J - 1):
      cells.setdefault(k + J - 1 + m + (J - 2 - j), []).append(Task(j, TaskKind.BACKWARD, m))
  return [tuple(sorted(cells.get(u, []))) for u in range(max(cells) + 1)]


def dependency(task: Task, J: int) -> Optional[Task]:
  """The task whose message ``task`` consumes (None for stage 0's forward)."""
  j, kind, m = task
  if kind == TaskKind.FORWARD:
    return Task(j - 1, TaskKind.FORWARD, m) if j > 0 else None
  if kind == TaskKind.LOSS:
    return Task(J - 2, TaskKind.FORWARD, m)
  return Task(J - 1, TaskKind.LOSS, m) if j == J - 2 else Task(j + 1, TaskKind.BACKWARD, m)


def _one_f_one_b_round(J: int, k: int) -> list:
  """One update of 1F1B (PipeDream-Flush), each task as early as possible."""
  order = [[Task(J - 1, TaskKind.LOSS, m) for m in range(k)]]
  for j in reversed(range(J - 1)):
    warmup = min(J - 1 - j, k)
    ops = [Task(j, TaskKind.FORWARD, m) for m in range(warmup)]
    for i in range(k - warmup):
      ops += [Task(j, TaskKind.FORWARD, warmup + i), Task(j, TaskKind.BACKWARD, i)]
    ops += [Task(j, TaskKind.BACKWARD, m) for m in range(k - warmup, k)]
    order.insert(0, ops)
  return as_soon_as_possible(order, lambda task: dependency(task, J))


def as_soon_as_possible(order: Sequence[Sequence[Task]], dependency) -> list:
  """Ticks of per-stage task ``order`` s, each task on the first tick after its dependency's."""
  done: dict[Task, int] = {}
  ticks, nxt = [], [0] * len(order)
  while any(n < len(o) for n, o in zip(nxt, order)):
    u, now = len(ticks), []
    for j, ops in enumerate(order):
      if nxt[j] < len(ops):
        dep = dependency(ops[nxt[j]])
        if dep is None or done.get(dep, u) < u:
          now.append(ops[nxt[j]])
    for task in now:
      done[task] = u
      nxt[task.stage] += 1
    ticks.append(tuple(now))
  return ticks


class TickTable:
  """One schedule family: its task kinds, tick table and dependencies (subclass and name it).

  A subclass with a ``name`` registers itself in :data:`TICK_TABLES`.
  Class attributes: ``delayed`` (gradients arrive ``tau_j > 0`` ticks after
  their forward), ``pipelined`` (stage by stage, not ``jax.grad`` of the
  model), ``flushed`` (``M`` a multiple of ``k``, rounds of ``k``),
  ``sends`` (per task kind, the message it sends: ``"forward"`` to ``j + 1``,
  ``"backward"`` to ``j - 1``), ``holds`` and ``frees`` (the kinds from
  which, and after which no longer, a stage holds the micro-batch), ``losses``
  (the kinds whose task reports the micro-batch's loss) and ``letters`` (per kind, its chart letters).
  """
  name: ClassVar[str] = ""
  delayed: ClassVar[bool] = False
  pipelined: ClassVar[bool] = True
  flushed: ClassVar[bool] = False
  sends: ClassVar[dict] = {TaskKind.FORWARD: "forward", TaskKind.BACKWARD: "backward", TaskKind.LOSS: "backward"}
  holds: ClassVar[tuple] = (TaskKind.FORWARD,)
  frees: ClassVar[str] = TaskKind.BACKWARD
  losses: ClassVar[tuple] = (TaskKind.LOSS,)
  letters: ClassVar[dict] = {TaskKind.FORWARD: "F", TaskKind.BACKWARD: "B", TaskKind.LOSS: "FB"}

  def __init_subclass__(cls, **kwargs):
    super().__init_subclass__(**kwargs)
    if cls.name:
      TICK_TABLES[cls.name] = cls

  @classmethod
  def stages(cls, kind: str, num_stages: int) -> range:
    """The stages that run tasks of ``kind`` (the loss on the last one only)."""
    J = num_stages
    return {TaskKind.LOSS: range(J - 1, J), TaskKind.BACKPROP: range(0, 1)}.get(kind, range(J - 1))

  @staticmethod
  def dependency(task: Task, num_stages: int) -> Optional[Task]:
    """The task whose message ``task`` consumes (None for stage 0's forward)."""
    return dependency(task, num_stages)

  @classmethod
  def round_size(cls, accumulation_steps: int) -> int:
    """Micro-batches per repeated round (0: not periodic)."""
    return accumulation_steps if cls.flushed else 0

  @classmethod
  def round(cls, num_stages: int, accumulation_steps: int) -> tuple:
    """The ticks of one round (periodic families)."""
    raise NotImplementedError

  @classmethod
  def length(cls, J: int, M: int, k: int) -> int:
    """Ticks of the table over ``M > 0`` micro-batches."""
    return len(_cached_round(cls, J, cls.round_size(k))) * (M // cls.round_size(k))

  @classmethod
  def tick(cls, t: int, J: int, M: int, k: int) -> Tick:
    """Tick ``t``'s tasks (``0 <= t < length``)."""
    size = cls.round_size(k)
    table = _cached_round(cls, J, size)
    r, u = divmod(t, len(table))
    return tuple(task._replace(micro_batch=task.micro_batch + r * size) for task in table[u])

  @classmethod
  def steady(cls, t: int, J: int, M: int, k: int) -> Optional[tuple[int, int]]:
    """``(u, s)`` if tick ``t`` holds the tasks of tick ``u`` of the family's repeating unit
    with every micro-batch shifted by ``s``, else None: without reading the table. The unit
    is one round (periodic families: every tick, ``u = t mod P``, ``s = (t // P) k``) or the
    stream's steady tick, ``2(J - 1)`` of a table over ``2(J - 1) + 1`` micro-batches
    (``u = 0``; :meth:`Stream.steady`)."""
    size = cls.round_size(k)
    if not 0 <= t < cls.length(J, M, k):
      return None
    r, u = divmod(t, len(_cached_round(cls, J, size)))
    return u, r * size

  @classmethod
  def cost(cls, task: Task, forward_ms: Sequence[float], backward_ms: Sequence[float]) -> float:
    """Simulated cost of ``task``: ``F_j``, ``B_j`` (the loss's ``B`` contains its forward)."""
    if task.kind == TaskKind.FORWARD:
      return forward_ms[task.stage]
    if task.kind == TaskKind.BACKPROP:
      return float(sum(forward_ms[:-1]) + sum(backward_ms))
    return backward_ms[task.stage]


TICK_TABLES: dict[str, type] = {}


@functools.lru_cache(maxsize=64)
def _cached_round(family: type, J: int, k: int) -> tuple:
  return tuple(family.round(J, k))


class Stream(TickTable):
  """PETRA's and the delayed methods' stream (Alg. 1): no flush, delay ``tau_j = 2(J-1-j)``."""
  name, delayed = "stream", True

  @classmethod
  def length(cls, J: int, M: int, k: int) -> int:
    return M + drain_ticks(J)

  @classmethod
  def tick(cls, t: int, J: int, M: int, k: int) -> Tick:
    return _stream_tick(t, J, M)

  @classmethod
  def steady(cls, t: int, J: int, M: int, k: int) -> Optional[tuple[int, int]]:
    """Every stage works on ticks ``2(J-1) .. M-1`` (the backward of ``t - 2(J-1)`` on stage
    0, the forward of ``t`` on stage 0): those are the steady tick shifted by ``t - 2(J-1)``."""
    t0 = drain_ticks(J)
    return (0, t - t0) if t0 <= t < M else None


class ForwardOnly(TickTable):
  """The stream's forwards only (methods that send nothing back)."""
  name = "forward"

  @classmethod
  def length(cls, J: int, M: int, k: int) -> int:
    return M + J - 1

  @classmethod
  def tick(cls, t: int, J: int, M: int, k: int) -> Tick:
    return _stream_tick(t, J, M, backward=False)

  @classmethod
  def steady(cls, t: int, J: int, M: int, k: int) -> Optional[tuple[int, int]]:
    """Every stage works on ticks ``J-1 .. M-1`` (the loss of ``t - (J-1)``, the forward of
    ``t`` on stage 0): the stream's steady tick (forwards only) shifted by ``t - 2(J-1)``."""
    return (0, t - drain_ticks(J)) if J - 1 <= t < M else None


class Drained(TickTable):
  """One micro-batch at a time through forward and backward: no delay (revprop)."""
  name = "drained"

  @classmethod
  def round_size(cls, accumulation_steps: int) -> int:
    return 1

  @classmethod
  def round(cls, num_stages: int, accumulation_steps: int) -> tuple:
    return tuple(_stream_tick(u, num_stages, 1) for u in range(2 * num_stages - 1))


class GPipe(TickTable):
  """GPipe (Huang et al., 2019): forwards of ``k`` micro-batches, then backwards."""
  name, flushed = "gpipe", True

  @classmethod
  def round(cls, num_stages: int, accumulation_steps: int) -> tuple:
    return tuple(_gpipe_round(num_stages, accumulation_steps))


class OneFOneB(TickTable):
  """1F1B (PipeDream-Flush, Narayanan et al., 2021): at most ``J - j`` micro-batches held."""
  name, flushed = "1f1b", True

  @classmethod
  def round(cls, num_stages: int, accumulation_steps: int) -> tuple:
    return tuple(_one_f_one_b_round(num_stages, accumulation_steps))


class Sequential(TickTable):
  """``jax.grad`` of the composed model: one ``backprop`` task per micro-batch."""
  name, pipelined = "sequential", False

  @classmethod
  def round_size(cls, accumulation_steps: int) -> int:
    return 1

  @classmethod
  def round(cls, num_stages: int, accumulation_steps: int) -> tuple:
    return ((Task(0, TaskKind.BACKPROP, 0),),)
