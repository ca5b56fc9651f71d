"""NAdamW with Dozat's momentum schedule: Ajanthan et al.'s optimizer (``optim.name="nadamw"``).

Per leaf, update count ``t >= 1`` (Dozat, 2016; PyTorch's ``NAdam`` with decoupled decay, the
optimizer of Ajanthan et al., ICML 2025, code PluralisResearch/AsyncPP)::

  mu_t = b1 (1 - 0.5 * 0.96 ** (t psi)),     P_t = mu_1 ... mu_t
  m_t = b1 m_{t-1} + (1 - b1) g,             v_t = b2 v_{t-1} + (1 - b2) g^2
  d_t = ((1 - mu_t) / (1 - P_t) g + mu_{t+1} / (1 - P_t mu_{t+1}) m_t) / (sqrt(v_t / (1 - b2^t)) + eps)
  w <- w - eta_t (d_t + wd w)                (wd on kernels)

``psi`` is ``momentum_decay`` (0.004). The gradient is first clipped to global norm ``clip``
(their ``--clip_grad 10``; 0 = no clipping), per stage since each stage has its optimizer.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax


class ScaleByNadamState(NamedTuple):
  """State of :func:`scale_by_nadam`."""
  count: jax.Array  # int32 [], updates done
  mu_product: jax.Array  # float32 [], P_t
  mu: optax.Updates  # m_t, like the params
  nu: optax.Updates  # v_t, like the params


def momentum_schedule(b1: float, momentum_decay: float, t):
  """``mu_t = b1 (1 - 0.5 * 0.96 ** (t psi))`` (float32; ``t`` the 1-based update)."""
  return b1 * (1.0 - 0.5 * jnp.power(jnp.float32(0.96), jnp.asarray(t, jnp.float32)
                                     * momentum_decay))


def scale_by_nadam(b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
                   momentum_decay: float = 0.004) -> optax.GradientTransformation:
  """The direction ``d_t`` of the module docstring (no learning rate, no decay)."""

  def init_fn(params):
    zeros = jax.tree.map(jnp.zeros_like, params)
    return ScaleByNadamState(jnp.zeros([], jnp.int32), jnp.ones([], jnp.float32), zeros,
                             jax.tree.map(jnp.zeros_like, params))

  def update_fn(updates, state, params=None):
    del params
    t = state.count + 1
    mu_t, mu_next = (momentum_schedule(b1, momentum_decay, t),
                     momentum_schedule(b1, momentum_decay, t + 1))
    product = state.mu_product * mu_t
    m = jax.tree.map(lambda m, g: b1 * m + (1 - b1) * g, state.mu, updates)
    v = jax.tree.map(lambda v, g: b2 * v + (1 - b2) * g * g, state.nu, updates)
    c2 = 1.0 - jnp.power(jnp.float32(b2), t.astype(jnp.float32))
    a, b = (1.0 - mu_t) / (1.0 - product), mu_next / (1.0 - product * mu_next)

    def one(g, m, v):
      return ((a * g + b * m) / (jnp.sqrt(v / c2) + eps)).astype(g.dtype)

    out = jax.tree.map(one, updates, m, v)
    return out, ScaleByNadamState(optax.safe_increment(state.count), product, m, v)

  return optax.GradientTransformation(init_fn, update_fn)


def nadamw(lr_schedule: optax.Schedule, *, b1: float, b2: float, eps: float, weight_decay: float,
           momentum_decay: float, clip: float, decay_mask) -> optax.GradientTransformation:
  """Clipping to global norm ``clip`` (if > 0), :func:`scale_by_nadam`, decoupled decay on
  ``decay_mask``, the rate ``lr_schedule``."""
  clipping = [optax.clip_by_global_norm(clip)] if clip > 0 else []
  return optax.chain(*clipping, scale_by_nadam(b1, b2, eps, momentum_decay),
                     optax.add_decayed_weights(weight_decay, mask=decay_mask),
                     optax.scale_by_learning_rate(lr_schedule))
