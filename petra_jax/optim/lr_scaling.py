"""Learning-rate scaling by delay: PipeMare's T1 (``lr_scale``, ``pipemare``).

Yang et al., 2021, "PipeMare: Asynchronous Pipeline Parallel DNN Training",
MLSys, Sec. 3, technique T1 "learning-rate rescheduling": stage ``j`` with
delay ``D_j`` (in updates, :func:`petra_jax.optim.delays.delay_in_updates`)
gets the rate ``eta_j = eta * max(D_j, 1) ** -p`` (``lr_scale``), or, with
the delay-dependent warm-up (``pipemare``), an exponent annealed to 0 over
the first ``K`` updates. At ``D <= 1`` the updates are the plain optimizer's,
bit for bit.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax


class ScaleByDelayState(NamedTuple):
  """State of :func:`scale_by_delay`: the updates done so far."""
  count: jax.Array  # int32 []


def delay_lr_factor(delay_updates: float, power: float = 1.0, anneal_steps: int = 0,
                    count=None):
  """The factor ``max(D, 1) ** -(p q_t)`` of the learning rate.

  PipeMare (Yang et al., 2021, Sec. 3, T1) gives stage ``i`` with delay
  ``tau_i`` the step size ``alpha_k tau_i ** -p_k`` with
  ``p_k = 1 - min(k / K, 1)`` at iteration ``k``: divided by the delay at the
  start, the base rate after ``K`` iterations. Here ``q_t = 1 - min(t / K, 1)``
  when ``anneal_steps = K > 0`` (``pipemare``) and ``q_t = 1`` otherwise
  (``lr_scale``). Delays below one update are not compensated (``max(D, 1)``):
  dividing by ``D < 1`` would *raise* the rate, and ``D = 0`` must give 1.

  Returns:
    A Python float when it does not depend on ``count`` (``1.0`` exactly for
    ``D <= 1``), else a float32 scalar.
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
  """Multiplies the updates by :func:`delay_lr_factor` (chain it last).

  Placed after ``scale_by_learning_rate`` it scales the learning rate of the
  stage: ``theta -= eta(t) * factor(t) * d``. Its counter counts the updates
  it sees (inside ``optax.MultiSteps``: optimizer updates, not micro-batches).
  """

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
