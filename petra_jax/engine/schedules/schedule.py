"""A family's tick table over ``M`` micro-batches (:class:`Schedule`), and tables chained.

:func:`family` looks a family up by name in :data:`TICK_TABLES`, where every
:class:`TickTable` subclass with a ``name`` registers itself: the built-in ones
(:mod:`.tick_table`, :mod:`.zero_bubble`) are imported here, so the registry is
complete once this module is.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
from typing import Iterator, Optional

from petra_jax.engine.schedules import zero_bubble  # noqa: F401  (registers zb_h1)
from petra_jax.engine.schedules.tick_table import (TICK_TABLES, Tick, TickTable, TaskKind,
                                                   require_stages)


def family(name) -> type:
  """The :class:`TickTable` subclass named ``name`` (or ``name`` itself, a subclass).

  Raises:
    ValueError: unknown name.
  """
  if isinstance(name, type) and issubclass(name, TickTable):
    return name
  if name not in TICK_TABLES:
    raise ValueError(f"Unknown schedule {name!r}; choose one of {tuple(TICK_TABLES)}.")
  return TICK_TABLES[name]


@dataclasses.dataclass(frozen=True)
class Schedule:
  """The tick table of one family over ``num_micro_batches`` micro-batches, computed lazily.

  ``name``: a family's name in :data:`TICK_TABLES` or a :class:`TickTable` subclass.
  ``schedule[t]`` is tick ``t``'s tasks; ``M`` must be a multiple of ``k``
  for flushed families.

  Raises:
    ValueError: unknown family name, fewer than 2 stages, or ``M`` not a multiple of
      ``k`` for a flushed schedule.
  """
  name: str
  num_stages: int
  num_micro_batches: int
  accumulation_steps: int = 1

  def __post_init__(self):
    f = family(self.name)
    object.__setattr__(self, "name", f.name)
    if f.pipelined:
      require_stages(self.num_stages)
    if f.flushed and self.num_micro_batches % self.accumulation_steps:
      raise ValueError(f"{self.name}: {self.num_micro_batches} micro-batches do not split into "
                       f"updates of k={self.accumulation_steps}.")

  @property
  def family(self) -> type:
    """The :class:`TickTable` subclass."""
    return TICK_TABLES[self.name]

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

  def steady(self, t: int) -> Optional[tuple[int, int]]:
    """``(u, s)``: tick ``t`` is the family's repeating tick ``u`` shifted by ``s``
    micro-batches (:meth:`TickTable.steady`); None if not, or ``t`` outside the table."""
    return self.family.steady(t, self.num_stages, self.num_micro_batches,
                              self.accumulation_steps)


def fed(tick: Tick) -> Optional[int]:
  """The micro-batch that enters stage 0 on this tick, or None."""
  for task in tick:
    if task.stage == 0 and task.kind in (TaskKind.FORWARD, TaskKind.BACKPROP):
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

  @functools.cached_property
  def family(self) -> Optional[type]:
    """The parts' family, if they share one (None otherwise)."""
    families = {part.family for part in self.parts}
    return families.pop() if len(families) == 1 else None

  def steady(self, t: int) -> Optional[tuple[int, int]]:
    """As :meth:`Schedule.steady`, the shift counting the part's offset."""
    if not 0 <= t < len(self):
      return None
    i = bisect.bisect_right(self._ends, t)
    found = self.parts[i].steady(t - (self._ends[i - 1] if i else 0))
    return None if found is None else (found[0], found[1] + self.offsets[i])
