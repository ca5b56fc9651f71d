"""Linear weight prediction (Kosson et al., 2021, Sec. 4.2; SpecTrain): ``weight_prediction``."""

from __future__ import annotations

from typing import Union

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
