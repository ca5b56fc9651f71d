"""Event-driven time of a schedule with one device per stage.

Costs, dependencies and messages come from the schedule's family
(:class:`petra_jax.engine.schedules.TickTable`).
"""

from __future__ import annotations

from typing import Optional, Sequence

from petra_jax.engine import schedules as schedule_lib
from petra_jax.engine.schedules import Schedule, Task


def task_ms(task: Task, forward_ms: Sequence[float], backward_ms: Sequence[float],
            family: type = schedule_lib.TickTable) -> float:
  """Cost of one task (:meth:`TickTable.cost`): ``F_j``, ``B_j``; the last
  stage's ``loss`` is its ``B_{J-1}`` (which contains its forward);
  ``backprop`` is every stage's ``F_j + B_j``."""
  return family.cost(task, forward_ms, backward_ms)


def simulate(schedule: Schedule, forward_ms: Sequence[float], backward_ms: Sequence[float],
             send_forward_ms: Optional[Sequence[float]] = None,
             send_backward_ms: Optional[Sequence[float]] = None) -> dict:
  """Event-driven time of ``schedule`` with one device per stage.

  Each stage runs its tasks in table order; a task starts when its stage is
  free and the message it consumes has arrived. A stage sends what a task
  produces right after it (forward: to ``j+1``; backward and loss: to
  ``j-1``) and is busy sending (a blocking copy), so in PETRA's steady state a
  micro-batch costs ``max_j (F_j + B_j + T_j)``, the tick of
  :func:`petra_jax.benchmarks.throughput.simulated_speedup`. No global
  barrier: a tick is only the order.

  Args:
    schedule: the table.
    forward_ms, backward_ms: per stage ``F_j`` and ``B_j`` in ms (the last
      stage's ``B`` contains its forward; :func:`task_ms`).
    send_forward_ms, send_backward_ms: per stage, ms to send its output to
      ``j+1`` and its ``(x~, delta)`` to ``j-1`` (default 0).

  Returns:
    ``{"makespan_ms": float, "busy_ms": [float per stage]}``: ``busy_ms``
    counts compute only (sending is idle time for the bubble).
  """
  J, family = schedule.num_stages, schedule.family
  fsend = send_forward_ms or [0.0] * J
  bsend = send_backward_ms or [0.0] * J
  free, busy, sent = [0.0] * J, [0.0] * J, {}
  for tick in schedule:
    for task in tick:
      dep = family.dependency(task, J) if family.pipelined else None
      start = max(free[task.stage], sent.pop(dep) if dep is not None else 0.0)
      cost = family.cost(task, forward_ms, backward_ms)
      send = _send_ms(task, family.sends.get(task.kind), fsend, bsend)
      free[task.stage] = sent[task] = start + cost + send
      busy[task.stage] += cost
  return {"makespan_ms": max(free), "busy_ms": busy}


def _send_ms(task: Task, direction: Optional[str], fsend: Sequence[float],
             bsend: Sequence[float]) -> float:
  """Time stage ``task.stage`` spends sending what ``task`` produced (``direction``:
  ``"forward"``, ``"backward"`` or None)."""
  if direction == "forward":
    return fsend[task.stage]
  if direction == "backward" and task.stage > 0:
    return bsend[task.stage]
  return 0.0


def ms_per_update(family_name, num_stages: int, accumulation_steps: int,
                  forward_ms: Sequence[float], backward_ms: Sequence[float],
                  send_forward_ms: Optional[Sequence[float]] = None,
                  send_backward_ms: Optional[Sequence[float]] = None,
                  updates: int = 16) -> dict:
  """Steady-state simulated ms per update and bubble fraction of the tick table ``family_name``.

  Simulates ``updates`` and ``2 * updates`` updates and takes the difference,
  so a stream's fill and drain (paid once per run, not per update) cancel;
  flushed schedules pay theirs every update.

  Returns:
    ``{"simulated_ms_per_update": float, "bubble_fraction": float}``: the
    bubble is ``1 - sum_j busy_j / (J * time)`` over the same window
    (GPipe/1F1B with equal stage costs: ``(J-1)/(k+J-1)``).
  """
  k = accumulation_steps
  runs = [simulate(Schedule(family_name, num_stages, u * k, k), forward_ms, backward_ms,
                   send_forward_ms, send_backward_ms) for u in (updates, 2 * updates)]
  time = runs[1]["makespan_ms"] - runs[0]["makespan_ms"]
  busy = sum(runs[1]["busy_ms"]) - sum(runs[0]["busy_ms"])
  J = num_stages if schedule_lib.family(family_name).pipelined else 1
  return {"simulated_ms_per_update": time / updates,
          "bubble_fraction": max(0.0, 1.0 - busy / (J * time))}


if __name__ == "__main__":
  import sys  # pylint: disable=g-import-not-at-top
  from petra_jax.benchmarks import cli  # pylint: disable=g-import-not-at-top
  sys.exit(cli.library_main("simulate", "throughput"))
