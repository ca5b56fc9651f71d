"""Momentum for a delayed gradient (the sgd/lars chain's trace): spike compensation, look-ahead."""

from __future__ import annotations

from typing import Any, Optional

import jax
import optax


def spike_coefficients(momentum: float, delay_updates: float) -> tuple:
  """``(a, b) = ((1 - m^D) / (1 - m), m^D)``: ``w <- w - eta (b d + a g)`` for a gradient
  ``D`` updates late (Kosson et al., 2021, Sec. 4.1; ``d`` the trace's output).
  ValueError: ``momentum`` outside ``(0, 1)``.
  """
  if not 0.0 < momentum < 1.0:
    raise ValueError(f"spike compensation needs 0 < momentum < 1, got {momentum}.")
  decayed = momentum ** float(delay_updates)
  return (1.0 - decayed) / (1.0 - momentum), decayed


def spike_compensated_trace(decay: float, nesterov: bool, delay_updates: float,
                            accumulator_dtype: Optional[Any] = None
                            ) -> optax.GradientTransformation:
  """``optax.trace`` whose output ``d`` becomes ``a g + b d`` (:func:`spike_coefficients`);
  optax's own ``TraceState``; ``optax.trace`` itself at ``D = 0``."""
  base = optax.trace(decay=decay, nesterov=nesterov, accumulator_dtype=accumulator_dtype)
  if float(delay_updates) == 0.0:
    return base
  grad_coef, vel_coef = spike_coefficients(decay, delay_updates)

  def update_fn(updates, state, params=None):
    directions, new_state = base.update(updates, state, params)
    mixed = jax.tree.map(
        lambda g, d: None if g is None else (vel_coef * d + grad_coef * g).astype(d.dtype),
        updates, directions, is_leaf=lambda x: x is None)
    return mixed, new_state

  return optax.GradientTransformation(base.init, update_fn)


def lookahead_momentum(base_momentum: float, max_momentum: float, delay_updates: float,
                       delay_ref: float) -> float:
  """``gamma(D) = m + (gamma_max - m) min(D / D_ref, 1)`` (Ajanthan et al., 2025, Sec. 3:
  ``w_{t+1} = w_t + gamma (w_t - w_{t-1}) - eta (1 - gamma) grad f(stale look-ahead)``).
  ValueError: ``delay_ref <= 0`` with a delay.
  """
  if delay_updates <= 0:
    return base_momentum
  if delay_ref <= 0:
    raise ValueError(f"lookahead delay_ref must be > 0, got {delay_ref}.")
  return base_momentum + (max_momentum - base_momentum) * min(delay_updates / delay_ref, 1.0)


def own_delay_momentum(base_momentum: float, max_momentum: float, delay_updates: float) -> float:
  """``min(1 - (1 - m) / (1 + D), gamma_max)``: the momentum whose horizon ``1 / (1 - gamma)``
  is ``1 + D`` times the base one, from the stage's own delay ``D = tau_j / k`` alone (never
  normalised by the run's largest); ``m`` at ``D = 0``, never below ``m``.
  ValueError: ``D < 0``.
  """
  if delay_updates < 0:
    raise ValueError(f"delay_updates must be >= 0, got {delay_updates}.")
  if delay_updates == 0:
    return base_momentum
  grown = 1.0 - (1.0 - base_momentum) / (1.0 + float(delay_updates))
  return max(base_momentum, min(grown, max_momentum))
