"""Momentum modified for a delayed gradient: spike compensation, Nesterov look-ahead.

Both replace the ``optax.trace`` of the ``sgd``/``lars`` chain
(:func:`petra_jax.optim.optimizers.momentum_chain`); at delay ``D = 0`` the
chain is the plain optimizer's, bit for bit.

* Spike compensation (Kosson et al., 2021, "Pipelined Backpropagation at
  Scale: Training Large Models without Batches", MLSys; Sec. 4.1): a gradient
  that arrives ``D`` updates late is applied as a spike holding every
  contribution the momentum would already have given it, then decays as if it
  had come on time (:func:`spike_coefficients`,
  :func:`spike_compensated_trace`).
* The modified Nesterov method for asynchronous pipelines (Ajanthan et al.,
  2025, "Nesterov Method for Asynchronous Pipeline Parallel Optimization",
  ICML, arXiv:2505.01099; Sec. 3): NAG with its gradient term discounted by
  ``(1 - gamma)`` and a momentum ``gamma`` that grows with the stage's delay
  (:func:`lookahead_momentum`).
"""

from __future__ import annotations

from typing import Any, Optional

import jax
import optax


def spike_coefficients(momentum: float, delay_updates: float) -> tuple:
  """``(gradient_coef, velocity_coef) = ((1 - m**D) / (1 - m), m**D)``.

  Spike compensation (Kosson et al., 2021, Sec. 4.1) replaces the momentum
  step ``w <- w - eta v`` (``v <- m v + g``, ``g`` the gradient arriving ``D``
  updates late) by::

    w <- w - eta * (m**D * v + (1 - m**D) / (1 - m) * g)

  In plain momentum SGD a gradient contributes ``eta m**i`` to the ``i``-th
  update after it is computed. Arriving ``D`` updates late, it missed
  ``sum_{i<D} m**i = (1 - m**D) / (1 - m)`` (the spike) and, scaled by
  ``m**D``, its later contributions ``m**D m**i`` are those it would have had
  on time: the total ``eta / (1 - m)`` is unchanged.

  The same coefficients hold for Nesterov momentum with ``v`` replaced by the
  Nesterov direction ``d = g + m v``: its contributions are ``1 + m`` then
  ``m**(i+1)``, so with ``a = (1 - m**D) / (1 - m)``, ``b = m**D`` the
  arrival step gets ``a + b (1 + m) = sum_{i<=D} c_i`` and the later ones
  ``b m**(i+1) = c_{D+i}`` (derivation in the tests). ``D`` may be
  fractional (``tau / k``); ``D = 0`` gives ``(0, 1)``, the plain step.
  """
  if not 0.0 < momentum < 1.0:
    raise ValueError(f"spike compensation needs 0 < momentum < 1, got {momentum}.")
  decayed = momentum ** float(delay_updates)
  return (1.0 - decayed) / (1.0 - momentum), decayed


def spike_compensated_trace(decay: float, nesterov: bool, delay_updates: float,
                            accumulator_dtype: Optional[Any] = None
                            ) -> optax.GradientTransformation:
  """``optax.trace`` whose output is ``a g + b d`` (:func:`spike_coefficients`).

  ``d`` is ``optax.trace``'s output (``v`` or, Nesterov, ``g + m v``) and
  ``g`` its input (the gradient with its weight decay). The state is optax's
  own ``TraceState`` (the velocity ``v``), so the state tree is that of
  ``optax.sgd`` and :func:`predict_params` finds it. With ``D = 0`` this *is*
  ``optax.trace``.
  """
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
  """``gamma(D) = m + (gamma_max - m) min(D / D_ref, 1)``.

  Ajanthan et al. (2025), Sec. 3, modify Nesterov's method for a gradient
  delayed by ``tau``::

    d_t     = gamma_t (w_t - w_{t-1})                        (look-ahead)
    w_{t+1} = w_t + d_t - eta (1 - gamma_t) grad f(w_{t-tau} + d_{t-tau})

  i.e. the gradient, taken at the (stale) look-ahead point, is discounted by
  ``1 - gamma_t``: with ``gamma -> 1`` the look-ahead ``d_t`` dominates and
  points along the weights' drift over the delay (their Proposition 1). They
  use ``gamma = 0.99`` (PyTorch's NAdam, which has that discount), and,
  without weight stashing (PETRA's case), a momentum growing with the stage's
  delay from the base 0.9 towards 0.99 (their No-WS variant; their code:
  ``m + D (0.99 - m) / num_stages``). Here it grows linearly in ``D`` up to
  ``gamma_max`` at ``D_ref`` (default: the largest delay, stage 0), so a
  stage without delay keeps ``m`` exactly.
  """
  if delay_updates <= 0:
    return base_momentum
  if delay_ref <= 0:
    raise ValueError(f"lookahead delay_ref must be > 0, got {delay_ref}.")
  return base_momentum + (max_momentum - base_momentum) * min(delay_updates / delay_ref, 1.0)
