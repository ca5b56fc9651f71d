"""PipeMare's rate rescheduling (Yang et al., 2021, Sec. 3, T1): ``lr_scale``, ``pipemare``."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax


class ScaleByDelayState(NamedTuple):
  """State of :func:`scale_by_delay`."""
  count: jax.Array  # int32 []


def delay_lr_factor(delay_updates: float, power: float = 1.0, anneal_steps: int = 0,
                    count=None):
  """``max(D, 1) ** -(p q_t)``, ``q_t = 1 - min(t / K, 1)`` (``K = anneal_steps > 0``) or 1.

  A Python ``1.0`` at ``D <= 1`` (never raised above the base rate), else float32.
  """
  base = max(float(delay_updates), 1.0)
  if base == 1.0 or power == 0:
    return 1.0
  if anneal_steps <= 0:
    return base ** -power
  q = 1.0 - jnp.minimum(jnp.asarray(count, jnp.float32) / anneal_steps, 1.0)
  return jnp.power(jnp.float32(base), -power * q)


def scale_by_delay(delay_updates: float, power: float = 1.0,
                   anneal_steps: int = 0) -> optax.GradientTransformation:
  """The updates times :func:`delay_lr_factor` at its own update count (chain it last)."""

  def init_fn(params):
    del params
    return ScaleByDelayState(count=jnp.zeros([], jnp.int32))

  def update_fn(updates, state, params=None):
    del params
    factor = delay_lr_factor(delay_updates, power, anneal_steps, state.count)
    if not (isinstance(factor, float) and factor == 1.0):
      updates = jax.tree.map(lambda u: u * jnp.asarray(factor, u.dtype), updates)
    return updates, ScaleByDelayState(count=optax.safe_increment(state.count))

  return optax.GradientTransformation(init_fn, update_fn)
