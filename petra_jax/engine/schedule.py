"""Pipeline schedules as data: tick ``t`` holds tasks ``(stage, kind, micro_batch)``.

Stages ``j = 0 .. J-1``; the last stage's task is ``loss``. Kinds: ``stream``
(paper Alg. 1: micro-batch ``m`` forward at stage ``j`` on tick ``m + j``,
backward on tick ``m + 2(J-1) - j``, delay ``tau_j = 2(J-1-j)``); ``forward``
(the stream without backwards); ``drained`` (one micro-batch at a time, no
delay); ``gpipe`` and ``1f1b`` (flushed every update of ``k``);
``sequential`` (one ``backprop`` task per tick).
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
from typing import Iterator, NamedTuple, Optional

FORWARD, BACKWARD, LOSS, BACKPROP = "forward", "backward", "loss", "backprop"
KINDS = ("stream", "drained", "gpipe", "1f1b", "sequential", "forward")


class Task(NamedTuple):
  """One stage's ``"forward"``, ``"backward"``, ``"loss"`` or ``"backprop"`` on a micro-batch."""
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
  done: dict[Task, int] = {}
  ticks, nxt = [], [0] * J
  while any(n < len(o) for n, o in zip(nxt, order)):
    u, now = len(ticks), []
    for j in range(J):
      if nxt[j] < len(order[j]):
        task = order[j][nxt[j]]
        dep = dependency(task, J)
        if dep is None or done.get(dep, u) < u:
          now.append(task)
    for task in now:
      done[task] = u
      nxt[task.stage] += 1
    ticks.append(tuple(now))
  return ticks


@functools.lru_cache(maxsize=64)
def _round(kind: str, J: int, k: int) -> tuple:
  if kind == "drained":
    return tuple(_stream_tick(u, J, 1) for u in range(2 * J - 1))
  if kind == "gpipe":
    return tuple(_gpipe_round(J, k))
  if kind == "1f1b":
    return tuple(_one_f_one_b_round(J, k))
  return ((Task(0, BACKPROP, 0),),)


@dataclasses.dataclass(frozen=True)
class Schedule:
  """The tick table of one method over ``num_micro_batches`` micro-batches, computed lazily.

  ``schedule[t]`` is tick ``t``'s tasks; ``M`` must be a multiple of ``k`` for
  ``gpipe`` and ``1f1b``.

  Raises:
    ValueError: unknown kind, fewer than 2 stages, or ``M`` not a multiple of
      ``k`` for a flushed schedule.
  """
  kind: str
  num_stages: int
  num_micro_batches: int
  accumulation_steps: int = 1

  def __post_init__(self):
    if self.kind not in KINDS:
      raise ValueError(f"Unknown schedule {self.kind!r}; choose one of {KINDS}.")
    if self.kind != "sequential":
      require_stages(self.num_stages)
    if self.kind in ("gpipe", "1f1b") and self.num_micro_batches % self.accumulation_steps:
      raise ValueError(f"{self.kind}: {self.num_micro_batches} micro-batches do not split into "
                       f"updates of k={self.accumulation_steps}.")

  @property
  def round_size(self) -> int:
    """Micro-batches per repeated round (0 for ``stream`` and ``forward``)."""
    if self.kind in ("stream", "forward"):
      return 0
    return self.accumulation_steps if self.kind in ("gpipe", "1f1b") else 1

  def _table(self) -> tuple:
    return _round(self.kind, self.num_stages, self.round_size)

  def __len__(self) -> int:
    M = self.num_micro_batches
    if M == 0:
      return 0
    if self.kind == "stream":
      return M + drain_ticks(self.num_stages)
    if self.kind == "forward":
      return M + self.num_stages - 1
    return len(self._table()) * (M // self.round_size)

  def __getitem__(self, t: int) -> Tick:
    if not 0 <= t < len(self):
      raise IndexError(f"tick {t} outside [0, {len(self)})")
    if self.kind in ("stream", "forward"):
      return _stream_tick(t, self.num_stages, self.num_micro_batches,
                          backward=self.kind == "stream")
    table = self._table()
    r, u = divmod(t, len(table))
    return tuple(task._replace(micro_batch=task.micro_batch + r * self.round_size)
                 for task in table[u])

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
