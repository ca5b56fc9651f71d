"""Delay compensations for AdamW (and, error feedback, any optimizer); plain at ``D = 0``."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from petra_jax.optim.optimizers import kernel_mask
from petra_jax.optim.prediction import _find_one, current_learning_rate


def adam_predict_params(params, opt_state, delay_updates, learning_rate=None, *, b1: float,
                        b2: float, eps: float, weight_decay: float, scale: float = 1.0):
  """PipeOptim (Guan et al., arXiv:2312.00839, Sec. 3) for AdamW: the current moments'
  step ``s D`` updates ahead, ``w - eta s D (m_t / (1 - b1^t) / (sqrt(v_t / (1 - b2^t)) + eps)
  + wd w)`` (``wd`` on kernels, ``t >= 1``; ValueError without one ``ScaleByAdamState``).
  """
  if isinstance(delay_updates, (int, float)) and delay_updates * scale == 0:
    return params
  adam = _find_one(opt_state, "ScaleByAdamState")
  if adam is None:
    raise ValueError("adam_prediction needs optim.name='adam' (no ScaleByAdamState).")
  t = jnp.maximum(adam.count, 1).astype(jnp.float32)
  c1, c2 = 1.0 - jnp.float32(b1) ** t, 1.0 - jnp.float32(b2) ** t
  eta = jnp.asarray(current_learning_rate(opt_state, learning_rate), jnp.float32)
  step = eta * (jnp.asarray(delay_updates, jnp.float32) * scale)

  def one(w, m, v, decayed):
    d = (m / c1) / (jnp.sqrt(v / c2) + eps) + (weight_decay * w if decayed else 0.0)
    return w - (step * d).astype(w.dtype)

  return jax.tree.map(one, params, adam.mu, adam.nu, kernel_mask(params))


def lookahead_adamw(lr_schedule, b1: float, b2: float, eps: float, weight_decay: float,
                    nesterov: bool) -> optax.GradientTransformation:
  """AdamW, NAdamW (Dozat, 2016) if ``nesterov``, of first-moment decay ``b1``."""
  return optax.adamw(lr_schedule, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay,
                     mask=kernel_mask, nesterov=nesterov)


class ErrorFeedbackState(NamedTuple):
  """State of :func:`error_feedback`."""
  previous: optax.Updates  # u_{t-1}, float32 like the params
  count: jax.Array  # int32 []


def error_feedback(horizon: float) -> optax.GradientTransformation:
  """``u_t + h (u_t - u_{t-1})`` (none at ``t = 0``), after the optimizer.

  Error feedback on the stale update (Zmushko et al., arXiv:2606.30634, Sec. 3):
  the update ``u_{t-D}`` applied ``D`` steps ago lacked ``u_t - u_{t-D} ~ D (u_t -
  u_{t-1})``, fed back now (``h = D``).
  """

  def init_fn(params):
    return ErrorFeedbackState(jax.tree.map(jnp.zeros_like, params), jnp.zeros([], jnp.int32))

  def update_fn(updates, state, params=None):
    del params
    h = jnp.where(state.count > 0, horizon, 0.0).astype(jnp.float32)
    out = jax.tree.map(lambda u, p: u + (h * (u - p)).astype(u.dtype), updates, state.previous)
    return out, ErrorFeedbackState(updates, optax.safe_increment(state.count))

  return optax.GradientTransformation(init_fn, update_fn)
