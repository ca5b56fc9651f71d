"""How stale a stage's gradients are: ``tau_j`` ticks, ``D_j = tau_j / k`` updates."""

from __future__ import annotations

from typing import Optional, Sequence

from petra_jax.engine import schedules as schedule


def delay_in_updates(delay_ticks: float, accumulation_steps: int = 1) -> float:
  """``D = tau / k``: an update's micro-batches' mean delay in updates.

  Raises:
    ValueError: ``k < 1`` or ``tau < 0``.
  """
  if accumulation_steps < 1:
    raise ValueError(f"accumulation_steps must be >= 1, got {accumulation_steps}.")
  if delay_ticks < 0:
    raise ValueError(f"delay_ticks must be >= 0, got {delay_ticks}.")
  return float(delay_ticks) / accumulation_steps


def stage_delays(num_stages: int, delays_ticks: Optional[Sequence[float]] = None) -> list:
  """``delays_ticks`` (ValueError: not ``num_stages``), or PETRA's ``tau_j = 2 (J - 1 - j)``."""
  ticks = ([schedule.delay(j, num_stages) for j in range(num_stages)]
           if delays_ticks is None else list(delays_ticks))
  if len(ticks) != num_stages:
    raise ValueError(f"{len(ticks)} delays for {num_stages} stages.")
  return ticks
