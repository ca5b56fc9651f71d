"""Schedules as data: task kinds, tick-table families and one family's table over M micro-batches.

Bottom layer of the engine (imports nothing of it): :mod:`.tick_table` (tasks,
:class:`TickTable` and the built-in families), :mod:`.zero_bubble` (ZB-H1),
:mod:`.schedule` (:class:`Schedule`, :class:`Chained`, the registry lookup).
"""

from petra_jax.engine.schedules.schedule import Chained, Schedule, family, fed
from petra_jax.engine.schedules.tick_table import (TICK_TABLES, Drained, ForwardOnly, GPipe,
                                                   OneFOneB, Sequential, Stream, Task, TaskKind,
                                                   Tick, TickTable, as_soon_as_possible,
                                                   delay, dependency, drain_ticks,
                                                   require_stages)
from petra_jax.engine.schedules.zero_bubble import ZeroBubbleH1, stage_orders

__all__ = [
    "TICK_TABLES", "Chained", "Drained", "ForwardOnly", "GPipe", "OneFOneB", "Schedule",
    "Sequential", "Stream", "Task", "TaskKind", "Tick", "TickTable", "ZeroBubbleH1",
    "as_soon_as_possible", "delay", "dependency", "drain_ticks", "family", "fed",
    "require_stages", "stage_orders",
]
