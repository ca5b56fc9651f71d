"""Pipeline schedules as data: tick ``t`` holds tasks ``(stage, kind, micro_batch)``.

Each schedule family is one :class:`TickTable` subclass, registered by its
``name`` in :data:`SCHEDULES`: which stages run which task kind, its tick
table, and the message each task consumes. Stages ``j = 0 .. J-1``; the last
stage's task is ``loss``. :class:`Stream` (paper Alg. 1: micro-batch ``m``
forward at stage ``j`` on tick ``m + j``, backward on tick ``m + 2(J-1) - j``,
delay ``tau_j = 2(J-1-j)``); :class:`ForwardOnly` (the stream without
backwards); :class:`Drained` (one micro-batch at a time, no delay);
:class:`GPipe` and :class:`OneFOneB` (flushed every update of ``k``);
:class:`Sequential` (one ``backprop`` task per tick). :class:`Schedule` is
one family's table over ``M`` micro-batches.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import importlib
from typing import ClassVar, Iterator, NamedTuple, Optional, Sequence

FORWARD, BACKWARD, LOSS, BACKPROP = "forward", "backward", "loss", "backprop"


class Task(NamedTuple):
  """One stage's task of a given ``kind`` (``"forward"``, ``"backward"``, ``"loss"``...) on a micro-batch."""
  stage: int
  kind: str
  micro_batch: int


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
    for kind, m in ((FORWARD, t - j), (BACKWARD, t - 2 * (J - 1) + j))[:2 if backward else 1]:
      if 0 <= m < M:
        tasks.append(Task(j, kind, m))
  if 0 <= t - (J - 1) < M:
    tasks.append(Task(J - 1, LOSS, t - (J - 1)))
  return tuple(tasks)


def _gpipe_round(J: int, k: int) -> list:
  """One update of GPipe: forwards of ``k`` micro-batches, then backwards."""
  cells: dict[int, list] = {}
  for m in range(k):
    for j in range(J - 1):
      cells.setdefault(m + j, []).append(Task(j, FORWARD, m))
    cells.setdefault(m + J - 1, []).append(Task(J - 1, LOSS, m))
    for j in range(J - 1):
      cells.setdefault(k + J - 1 + m + (J - 2 - j), []).append(Task(j, BACKWARD, m))
  return [tuple(sorted(cells.get(u, []))) for u in range(max(cells) + 1)]


def dependency(task: Task, J: int) -> Optional[Task]:
  """The task whose message ``task`` consumes (None for stage 0's forward)."""
  j, kind, m = task
  if kind == FORWARD:
    return Task(j - 1, FORWARD, m) if j > 0 else None
  if kind == LOSS:
    return Task(J - 2, FORWARD, m)
  return Task(J - 1, LOSS, m) if j == J - 2 else Task(j + 1, BACKWARD, m)


def _one_f_one_b_round(J: int, k: int) -> list:
  """One update of 1F1B (PipeDream-Flush), each task as early as possible."""
  order = [[Task(J - 1, LOSS, m) for m in range(k)]]
  for j in reversed(range(J - 1)):
    warmup = min(J - 1 - j, k)
    ops = [Task(j, FORWARD, m) for m in range(warmup)]
    for i in range(k - warmup):
      ops += [Task(j, FORWARD, warmup + i), Task(j, BACKWARD, i)]
    ops += [Task(j, BACKWARD, m) for m in range(k - warmup, k)]
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

  A subclass with a ``name`` registers itself in :data:`SCHEDULES`.
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
  sends: ClassVar[dict] = {FORWARD: "forward", BACKWARD: "backward", LOSS: "backward"}
  holds: ClassVar[tuple] = (FORWARD,)
  frees: ClassVar[str] = BACKWARD
  losses: ClassVar[tuple] = (LOSS,)
  letters: ClassVar[dict] = {FORWARD: "F", BACKWARD: "B", LOSS: "FB"}

  def __init_subclass__(cls, **kwargs):
    super().__init_subclass__(**kwargs)
    if cls.name:
      SCHEDULES[cls.name] = cls

  @classmethod
  def stages(cls, kind: str, num_stages: int) -> range:
    """The stages that run tasks of ``kind`` (the loss on the last one only)."""
    J = num_stages
    return {LOSS: range(J - 1, J), BACKPROP: range(0, 1)}.get(kind, range(J - 1))

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
  def cost(cls, task: Task, forward_ms: Sequence[float], backward_ms: Sequence[float]) -> float:
    """Simulated cost of ``task``: ``F_j``, ``B_j`` (the loss's ``B`` contains its forward)."""
    if task.kind == FORWARD:
      return forward_ms[task.stage]
    if task.kind == BACKPROP:
      return float(sum(forward_ms[:-1]) + sum(backward_ms))
    return backward_ms[task.stage]


SCHEDULES: dict[str, type] = {}


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


class ForwardOnly(TickTable):
  """The stream's forwards only (methods that send nothing back)."""
  name = "forward"

  @classmethod
  def length(cls, J: int, M: int, k: int) -> int:
    return M + J - 1

  @classmethod
  def tick(cls, t: int, J: int, M: int, k: int) -> Tick:
    return _stream_tick(t, J, M, backward=False)


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
    return ((Task(0, BACKPROP, 0),),)


KINDS = tuple(SCHEDULES)  # the built-in families' names


def family(kind) -> type:
  """The :class:`TickTable` subclass named ``kind`` (or ``kind`` itself).

  Raises:
    ValueError: unknown name.
  """
  if isinstance(kind, type) and issubclass(kind, TickTable):
    return kind
  if kind not in SCHEDULES:  # families outside this module register on import with their rows
    importlib.import_module("petra_jax.engine.methods")
  if kind not in SCHEDULES:
    raise ValueError(f"Unknown schedule {kind!r}; choose one of {tuple(SCHEDULES)}.")
  return SCHEDULES[kind]


@dataclasses.dataclass(frozen=True)
class Schedule:
  """The tick table of one family over ``num_micro_batches`` micro-batches, computed lazily.

  ``kind``: a name in :data:`SCHEDULES` or a :class:`TickTable` subclass.
  ``schedule[t]`` is tick ``t``'s tasks; ``M`` must be a multiple of ``k``
  for flushed families.

  Raises:
    ValueError: unknown kind, fewer than 2 stages, or ``M`` not a multiple of
      ``k`` for a flushed schedule.
  """
  kind: str
  num_stages: int
  num_micro_batches: int
  accumulation_steps: int = 1

  def __post_init__(self):
    f = family(self.kind)
    object.__setattr__(self, "kind", f.name)
    if f.pipelined:
      require_stages(self.num_stages)
    if f.flushed and self.num_micro_batches % self.accumulation_steps:
      raise ValueError(f"{self.kind}: {self.num_micro_batches} micro-batches do not split into "
                       f"updates of k={self.accumulation_steps}.")

  @property
  def family(self) -> type:
    """The :class:`TickTable` subclass."""
    return SCHEDULES[self.kind]

  @property
  def round_size(self) -> int:
    """Micro-batches per repeated round (0 for ``stream`` and ``forward``)."""
    return self.family.round_size(self.accumulation_steps)

  def __len__(self) -> int:
    M = self.num_micro_batches
    if M == 0:
      return 0
    return self.family.length(self.num_stages, M, self.accumulation_steps)

  def __getitem__(self, t: int) -> Tick:
    if not 0 <= t < len(self):
      raise IndexError(f"tick {t} outside [0, {len(self)})")
    return self.family.tick(t, self.num_stages, self.num_micro_batches, self.accumulation_steps)

  def __iter__(self) -> Iterator[Tick]:
    return (self[t] for t in range(len(self)))


def fed(tick: Tick) -> Optional[int]:
  """The micro-batch that enters stage 0 on this tick, or None."""
  for task in tick:
    if task.stage == 0 and task.kind in (FORWARD, BACKPROP):
      return task.micro_batch
  return None


@dataclasses.dataclass(frozen=True)
class Chained:
  """Schedules run one after the other, each drained first; part ``i`` offset by ``offsets[i]``."""
  parts: tuple
  offsets: tuple

  @functools.cached_property
  def _ends(self) -> tuple:
    out, total = [], 0
    for part in self.parts:
      total += len(part)
      out.append(total)
    return tuple(out)

  def ends(self) -> list[int]:
    """Cumulative tick count after each part."""
    return list(self._ends)

  def __len__(self) -> int:
    return self._ends[-1] if self._ends else 0

  def __getitem__(self, t: int) -> Tick:
    if not 0 <= t < len(self):
      raise IndexError(f"tick {t} outside [0, {len(self)})")
    i = bisect.bisect_right(self._ends, t)
    start = self._ends[i - 1] if i else 0
    return tuple(task._replace(micro_batch=task.micro_batch + self.offsets[i])
                 for task in self.parts[i][t - start])

  def __iter__(self) -> Iterator[Tick]:
    return (self[t] for t in range(len(self)))
