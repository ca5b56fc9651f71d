"""How stale a stage's gradients are, in ticks and in optimizer updates.

In PETRA (and every ``stream`` method) stage ``j`` of ``J`` applies the
gradient of a micro-batch ``tau_j = 2 (J - 1 - j)`` ticks after its forward
(:func:`petra_jax.engine.schedule.delay`). With ``k``-step accumulation
(``optax.MultiSteps``) the weights change once per ``k`` ticks, so the
forward's weights are on average ``D_j = tau_j / k`` *updates* older than the
ones the gradient is applied to (:func:`delay_in_updates`).
"""

from __future__ import annotations

from typing import Optional, Sequence

from petra_jax.engine import schedule


def delay_in_updates(delay_ticks: float, accumulation_steps: int = 1) -> float:
  """``D = tau / k``: the delay in optimizer updates.

  With ``k``-step accumulation, micro-batch ``i`` (0-based) of an update's
  ``k`` is applied ``floor((tau + k - 1 - i) / k)`` updates after its forward;
  the mean over ``i`` is exactly ``tau / k``.
  """
  if accumulation_steps < 1:
    raise ValueError(f"accumulation_steps must be >= 1, got {accumulation_steps}.")
  if delay_ticks < 0:
    raise ValueError(f"delay_ticks must be >= 0, got {delay_ticks}.")
  return float(delay_ticks) / accumulation_steps


def stage_delays(num_stages: int, delays_ticks: Optional[Sequence[float]] = None) -> list:
  """Each stage's ``tau_j`` in ticks: ``delays_ticks``, or PETRA's by default.

  Args:
    num_stages: ``J``.
    delays_ticks: one delay per stage; None for
      :func:`petra_jax.engine.schedule.delay` (``tau_j = 2 (J - 1 - j)``).

  Raises:
    ValueError: ``delays_ticks`` not of length ``num_stages``.
  """
  ticks = ([schedule.delay(j, num_stages) for j in range(num_stages)]
           if delays_ticks is None else list(delays_ticks))
  if len(ticks) != num_stages:
    raise ValueError(f"{len(ticks)} delays for {num_stages} stages.")
  return ticks
