"""Weight prediction: along the velocity (Kosson et al., 2021, Sec. 4.2; SpecTrain),
``weight_prediction``; by repeating the last update (marin #6431, for Muon), ``update_prediction``."""

from __future__ import annotations

from typing import NamedTuple, Union

import jax
import jax.numpy as jnp
import optax


def _find_one(opt_state, key: str):
  try:
    return optax.tree_utils.tree_get(opt_state, key)
  except KeyError as e:
    raise ValueError(f"Several {key} in the optimizer state; cannot tell which to use.") from e


def find_velocity(opt_state):
  """The momentum buffer (``TraceState.trace``) in ``opt_state``; ValueError: none or several."""
  trace_state = _find_one(opt_state, "TraceState")
  if trace_state is None:
    raise ValueError("No optax TraceState (momentum buffer) in the optimizer state: weight "
                     "prediction needs momentum SGD or LARS.")
  return trace_state.trace


def current_learning_rate(opt_state, learning_rate: Union[None, float, optax.Schedule] = None):
  """The next update's rate: ``learning_rate`` itself, a schedule at the state's
  ``ScaleByScheduleState.count``, or (None) an injected ``learning_rate``.

  Raises:
    ValueError: the state lacks what ``learning_rate`` needs.
  """
  if learning_rate is None:
    hyper = _find_one(opt_state, "hyperparams")
    if not isinstance(hyper, dict) or "learning_rate" not in hyper:
      raise ValueError("Give learning_rate: the state has no injected 'learning_rate'.")
    return hyper["learning_rate"]
  if callable(learning_rate):
    sched = _find_one(opt_state, "ScaleByScheduleState")
    if sched is None:
      raise ValueError("A schedule needs a ScaleByScheduleState (its count) in the state.")
    return learning_rate(sched.count)
  return learning_rate


def predict_params(params, opt_state, delay_updates, learning_rate=None, *, scale: float = 1.0):
  """``w_hat = w - eta (scale D) v``: the weights ``D`` updates ahead along the
  velocity ``v`` (:func:`find_velocity`); ``params`` itself for a Python 0.

  ``D`` may be traced; ``eta`` is :func:`current_learning_rate`.
  """
  if isinstance(delay_updates, (int, float)) and delay_updates * scale == 0:
    return params
  velocity = find_velocity(opt_state)
  eta = current_learning_rate(opt_state, learning_rate)
  step = jnp.asarray(eta, jnp.float32) * (jnp.asarray(delay_updates, jnp.float32) * scale)
  return jax.tree.map(lambda w, v: w - (step * v).astype(w.dtype), params, velocity)


class LastUpdateState(NamedTuple):
  """State of :func:`remember_update`."""
  update: optax.Updates  # u_t, the last update applied, like the params


def remember_update() -> optax.GradientTransformation:
  """Keeps the update it passes on unchanged (chain it last) for :func:`predict_by_update`."""

  def init_fn(params):
    return LastUpdateState(jax.tree.map(jnp.zeros_like, params))

  def update_fn(updates, state, params=None):
    del params, state
    return updates, LastUpdateState(updates)

  return optax.GradientTransformation(init_fn, update_fn)


def predict_by_update(params, opt_state, delay_updates, *, scale: float = 1.0):
  """``w_hat = w + (scale D) u_t``: the weights ``D`` updates ahead, each the last update
  ``u_t`` (learning rate included) kept by :func:`remember_update` (marin #6431's weight
  prediction for Muon, ``w - tau lr Delta W``). ``params`` itself for a Python 0.
  ValueError: no (or several) :class:`LastUpdateState`.
  """
  if isinstance(delay_updates, (int, float)) and delay_updates * scale == 0:
    return params
  last = _find_one(opt_state, "LastUpdateState")
  if last is None:
    raise ValueError("update_prediction needs the optimizer's remember_update (none in state).")
  h = jnp.asarray(delay_updates, jnp.float32) * scale
  return jax.tree.map(lambda w, u: w + (h * u).astype(w.dtype), params, last.update)
