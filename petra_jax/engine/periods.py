"""A schedule's repeating unit for the compiled executor (:mod:`petra_jax.engine.compiled`).

In the steady state tick ``t`` runs tick ``t0``'s tasks with every micro-batch shifted: the
*period* (a stream's steady tick, paper Alg. 1, or a flushed schedule's whole round) is traced
once and repeated. :func:`unrolled` joins ``U`` periods into one, the body of one iteration of
the compiled scan's loop.
"""

from __future__ import annotations

import dataclasses

from petra_jax.engine import schedules as schedule_lib

# The compiled executor's defaults (one place; the config, the executor and the benchmarks read
# them). N: steady-state periods per call; its fixed cost per call (the engine's Python, one
# argument per carried array, the rings stacked and unstacked) is paid once per N periods, so the
# host cost per tick falls with N; the price is N micro-batches' inputs alive per call
# (docs/performance.md). U: ticks per iteration of the scan's loop (:func:`periods_per_iteration`).
PERIODS_PER_DISPATCH = 64
UNROLL_TICKS = 4
# Whether the loop's carried slots are written in order after their reads
# (:mod:`petra_jax.engine.transport.ordered_writes`): off until an accelerator has timed it.
ORDER_WRITES = False


@dataclasses.dataclass(frozen=True)
class Period:
  """One period of a tick table: its ``ticks`` (canonical micro-batches), the micro-batches
  it feeds, in order, and ``shift``, the micro-batches by which the next period moves."""
  ticks: tuple
  fed: tuple
  shift: int


def period_of(family: type, num_stages: int, accumulation_steps: int) -> Period:
  """The repeating unit of ``family``'s tick table: a round, or the stream's steady tick."""
  J, k = num_stages, accumulation_steps
  size = family.round_size(k)
  if size:
    ticks = tuple(family.round(J, k))
  else:
    t0 = schedule_lib.drain_ticks(J)  # the first tick on which every stage works
    ticks = (family.tick(t0, J, t0 + 1, k),)
    size = 1
  fed = tuple(m for m in (schedule_lib.fed(tick) for tick in ticks) if m is not None)
  return Period(ticks, fed, size)


def periods_per_iteration(period: Period, unroll_ticks: int, periods_per_dispatch: int) -> int:
  """``U``: the most whole periods within ``unroll_ticks`` ticks that divide
  ``periods_per_dispatch``, at least one."""
  most = max(1, unroll_ticks // len(period.ticks))
  return max(u for u in range(1, most + 1) if periods_per_dispatch % u == 0)


def unrolled(period: Period, u: int) -> Period:
  """``u`` consecutive periods as one: the ticks of the ``i``-th moved by ``i * shift``
  micro-batches (keys in the first one's frame)."""
  ticks = tuple(tuple(schedule_lib.Task(t.stage, t.kind, t.micro_batch + i * period.shift)
                      for t in tick) for i in range(u) for tick in period.ticks)
  fed = tuple(m + i * period.shift for i in range(u) for m in period.fed)
  return Period(ticks, fed, u * period.shift)


def grouped(inputs_per_period: tuple, u: int) -> tuple:
  """Each ``u`` consecutive periods' inputs as one tuple (an :func:`unrolled` period's)."""
  return tuple(sum(inputs_per_period[i:i + u], ()) for i in range(0, len(inputs_per_period), u))
