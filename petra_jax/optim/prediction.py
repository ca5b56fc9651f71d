"""Linear weight prediction (Kosson et al., 2021, Sec. 4.2): ``weight_prediction``.

The forward of a micro-batch uses the weights extrapolated ``D`` updates ahead
along the momentum velocity, ``w - eta D v``, so that its gradient is computed
(nearly) at the weights it will be applied to (the same idea as SpecTrain,
Chen et al., 2018). The optimizer stays the plain one; the engine calls the
stage's predictor (:func:`petra_jax.optim.compensation.make_predictor`)
before the forward.
"""

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
  """The momentum buffer ``v`` (optax ``TraceState.trace``) in ``opt_state``.

  Located by the NamedTuple's name with ``optax.tree_utils.tree_get``, so it
  is found whatever wraps it: ``optax.MultiSteps``
  (``MultiStepsState.inner_opt_state``), ``optax.chain`` tuples,
  ``optax.inject_hyperparams`` (``.inner_state``), ``optax.masked``. For the
  project's SGD it is ``opt_state[1][0].trace`` (``k = 1``) or
  ``opt_state.inner_opt_state[1][0].trace`` (``k > 1``).

  Raises:
    ValueError: no ``TraceState`` (no momentum, or Adam), or several.
  """
  trace_state = _find_one(opt_state, "TraceState")
  if trace_state is None:
    raise ValueError("No optax TraceState (momentum buffer) in the optimizer state: weight "
                     "prediction needs momentum SGD or LARS.")
  return trace_state.trace


def current_learning_rate(opt_state, learning_rate: Union[None, float, optax.Schedule] = None):
  """The learning rate ``eta`` of the next update.

  Args:
    opt_state: the stage's optimizer state.
    learning_rate: a number (used as is); a schedule, evaluated at the count
      of the state's ``ScaleByScheduleState`` (``optax.scale_by_learning_rate``
      of a schedule; inside ``MultiSteps`` it counts updates); or None: the
      ``learning_rate`` hyperparameter of an ``optax.inject_hyperparams``
      state (the rate of its last update).

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
  """The weights ``D`` updates ahead: ``w - eta * (scale D) * v``.

  Linear weight prediction (Kosson et al., 2021, Sec. 4.2): in momentum SGD
  (``v <- m v + g``, ``w <- w - eta v``) the weights move by ``-eta v`` per
  update while the velocity ``v`` changes slowly, so the weights ``D``
  updates ahead are predicted as ``w_hat = w - eta D v``; the forward of a
  micro-batch whose gradient will be applied ``D`` updates later uses
  ``w_hat`` (SpecTrain, Chen et al., 2018, predicts
  ``W_hat_{t+s} = W_t - s eta v_{t-1}`` likewise).

  What it extrapolates with, for the project's SGD with Nesterov momentum
  (``optax.trace(m, nesterov=True)`` then ``scale_by_learning_rate``):
  optax keeps ``b <- m b + g`` (``g`` includes the weight decay) in
  ``TraceState.trace`` and steps ``w <- w - eta (g + m b)``. Its params are
  the Nesterov look-ahead points, and with slowly varying gradients
  ``g + m b ~ b`` (both ``g / (1 - m)``), so ``v = b`` -- the buffer itself --
  is the velocity for Nesterov as for heavy-ball momentum (and for LARS,
  whose trust ratio is applied before the trace). ``eta`` is the rate of the
  next update (:func:`current_learning_rate`); the pending gradients of an
  unfinished ``MultiSteps`` accumulation are not used.

  Args:
    params: the stage's current weights.
    opt_state: its optimizer state (any nesting, see :func:`find_velocity`).
    delay_updates: ``D``, in updates (``tau_j / k``); may be a traced scalar
      (e.g. a per-micro-batch delay). A Python 0 returns ``params`` itself.
    learning_rate: see :func:`current_learning_rate`.
    scale: multiplies the horizon (``prediction_scale``; 1 in the paper).

  Returns:
    The predicted weights, a tree like ``params``.
  """
  if isinstance(delay_updates, (int, float)) and delay_updates * scale == 0:
    return params
  velocity = find_velocity(opt_state)
  eta = current_learning_rate(opt_state, learning_rate)
  step = jnp.asarray(eta, jnp.float32) * (jnp.asarray(delay_updates, jnp.float32) * scale)
  return jax.tree.map(lambda w, v: w - (step * v).astype(w.dtype), params, velocity)
