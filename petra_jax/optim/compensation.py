"""Delay compensations for the stale gradients of a pipelined stage.

In PETRA (and every ``stream`` method) stage ``j`` of ``J`` applies the
gradient of a micro-batch ``tau_j = 2 (J - 1 - j)`` ticks after its forward
(:func:`stage_delay_ticks`). With ``k``-step accumulation (``optax.MultiSteps``)
the weights change once per ``k`` ticks, so the forward's weights are on
average ``D_j = tau_j / k`` *updates* older than the ones the gradient is
applied to (:func:`delay_in_updates`; exact for every micro-batch when ``k``
divides ``tau_j``, the mean over the ``k`` micro-batches of an update
otherwise). Every compensation below is parameterised by ``D`` and, at
``D = 0``, is the plain optimizer of :func:`petra_jax.optim.make_optimizer`
(same updates, bit for bit).

Compensations (``name``; several may be joined with ``"+"``, e.g.
``"spike+weight_prediction"``):

``none``
  :func:`petra_jax.optim.make_optimizer` itself.

``lr_scale`` -- per-stage learning rate ``eta_j = eta * max(D_j, 1) ** -p``
  (Yang et al., 2021, "PipeMare: Asynchronous Pipeline Parallel DNN
  Training", MLSys; Sec. 3, technique T1 "learning-rate rescheduling", with
  its annealing exponent held fixed at ``p = lr_power``). Cf. Zhuang et al.
  (2021a) who "shrink" the gradient by the delay, cited by PETRA Sec. 2.

``pipemare`` -- PipeMare's delay-dependent warm-up (same Sec. 3, T1):
  ``eta_j(t) = eta(t) * max(D_j, 1) ** -(p * q_t)``, ``q_t = 1 - min(t / K, 1)``
  over the first ``K`` updates (``pipemare_warmup_epochs``): stage ``j``
  starts at ``eta / D_j`` and reaches the base schedule after ``K`` updates.

``spike`` -- spike compensation for momentum SGD (Kosson et al., 2021,
  "Pipelined Backpropagation at Scale: Training Large Models without
  Batches", MLSys; Sec. 4.1 "Spike Compensation"): a gradient that arrives
  ``D`` updates late is applied as a spike holding every contribution the
  momentum would already have given it, then decays as if it had come on
  time. See :func:`spike_coefficients` and :func:`spike_compensated_trace`.

``weight_prediction`` -- linear weight prediction (Kosson et al., 2021,
  Sec. 4.2 "Linear Weight Prediction"; the same idea as SpecTrain, Chen et
  al., 2018): the forward of a micro-batch uses the weights extrapolated
  ``D`` updates ahead along the velocity, ``w - eta D v``, so that its
  gradient is computed (nearly) at the weights it will be applied to. The
  optimizer is the plain one; the engine calls :func:`predict_params` before
  the forward (:func:`make_predictor`).

``nesterov_lookahead`` -- the modified Nesterov method for asynchronous
  pipelines (Ajanthan et al., 2025, "Nesterov Method for Asynchronous Pipeline
  Parallel Optimization", ICML, arXiv:2505.01099; Sec. 3). NAG with its
  gradient term discounted by ``(1 - gamma)`` and a momentum ``gamma`` that
  grows with the stage's delay. See :func:`lookahead_momentum`.

The equations are quoted in each function's docstring. All state lives in the
optax state (a ``scale_by_delay`` update counter; spike compensation keeps
optax's own ``TraceState``), so checkpoints save it. Spike compensation,
weight prediction and the Nesterov look-ahead need a momentum optimizer
(``optim.name`` ``sgd`` or ``lars`` with ``optim.momentum > 0``); ``lr_scale``
and ``pipemare`` work with any.

Equation numbers: the sources' *section* names above were checked; their
equation numbers could not be read here, so the equations are written out in
full rather than cited by number.
"""

from __future__ import annotations

import copy
import functools
from typing import Any, Callable, NamedTuple, Optional, Sequence, Union

import jax
import jax.numpy as jnp
import ml_collections
import optax

from petra_jax import optim

NAMES = ("none", "lr_scale", "pipemare", "spike", "weight_prediction", "nesterov_lookahead")
# Those that change the momentum (rebuilt chain); those that scale the learning rate.
_MOMENTUM = ("spike", "nesterov_lookahead")
_LR = ("lr_scale", "pipemare")

# Defaults of ``config.compensation`` (proposed fields; see ``defaults()``).
DEFAULTS = {
    "name": "none",
    "lr_power": 1.0,                # p of lr_scale / pipemare
    "pipemare_warmup_epochs": 5.0,  # K of pipemare, in epochs
    "prediction_scale": 1.0,        # weight_prediction horizon = prediction_scale * D
    "lookahead_momentum": 0.99,     # nesterov_lookahead: gamma of the most delayed stage
    "lookahead_delay_ref": 0.0,     # delay (updates) that gets lookahead_momentum; 0 = stage 0's
}


def defaults() -> ml_collections.ConfigDict:
  """The proposed ``config.compensation`` block, with its defaults."""
  return ml_collections.ConfigDict(dict(DEFAULTS))


# ----------------------------------------------------------------------------
# Delays.
# ----------------------------------------------------------------------------

def stage_delay_ticks(stage: int, num_stages: int) -> int:
  """``tau_j = 2 (J - 1 - j)``: ticks between stage ``j``'s forward of a
  micro-batch and the application of its gradient (PETRA, Sec. 3)."""
  if not 0 <= stage < num_stages:
    raise ValueError(f"stage {stage} out of range for {num_stages} stages.")
  return 2 * (num_stages - 1 - stage)


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


def parse_name(name: str) -> tuple:
  """``"spike+weight_prediction"`` -> ``("spike", "weight_prediction")``.

  Raises:
    ValueError: an unknown name, ``none`` combined with another, or both
      ``lr_scale`` and ``pipemare``.
  """
  parts = tuple(p.strip() for p in str(name).split("+") if p.strip()) or ("none",)
  for p in parts:
    if p not in NAMES:
      raise ValueError(f"Unknown compensation {p!r}; choose from {NAMES} (join with '+').")
  if len(set(parts)) != len(parts):
    raise ValueError(f"Compensation {name!r} names one method twice.")
  if "none" in parts and len(parts) > 1:
    raise ValueError("'none' cannot be combined with another compensation.")
  if all(p in parts for p in _LR):
    raise ValueError("Choose one of 'lr_scale' and 'pipemare'.")
  return parts


# ----------------------------------------------------------------------------
# (a) Learning-rate scaling by delay (PipeMare T1).
# ----------------------------------------------------------------------------

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


# ----------------------------------------------------------------------------
# (b) Spike compensation (Kosson et al., 2021, Sec. 4.1).
# ----------------------------------------------------------------------------

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


# ----------------------------------------------------------------------------
# (c) Linear weight prediction (Kosson et al., 2021, Sec. 4.2).
# ----------------------------------------------------------------------------

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


# ----------------------------------------------------------------------------
# (d) Nesterov look-ahead for asynchronous pipelines (Ajanthan et al., 2025).
# ----------------------------------------------------------------------------

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


# ----------------------------------------------------------------------------
# Builders.
# ----------------------------------------------------------------------------

def _params(config, overrides: dict) -> dict:
  p = dict(DEFAULTS)
  if "compensation" in config:
    p.update({key: config.compensation[key] for key in config.compensation.keys()})
  p.update(overrides)
  unknown = set(p) - set(DEFAULTS)
  if unknown:
    raise ValueError(f"Unknown compensation parameters {sorted(unknown)}.")
  return p


def _with_k(config, k: int):
  c = copy.deepcopy(config)
  c.accumulation_steps = k
  return c


def _momentum_inner(config, steps_per_epoch: int, momentum: float, grad_scale: float,
                    spike_delay: float) -> optax.GradientTransformation:
  """The ``sgd``/``lars`` chain of :func:`optim.make_optimizer` (no
  accumulation) with its ``optax.trace`` replaced by a spike-compensated one
  of decay ``momentum``, fed gradients times ``grad_scale``. With
  ``momentum = optim.momentum``, ``grad_scale = 1``, ``spike_delay = 0`` its
  updates and state tree are ``make_optimizer``'s."""
  o = config.optim
  schedule = optim.learning_rate_schedule(config, steps_per_epoch)
  core = [] if grad_scale == 1.0 else [optax.scale(grad_scale)]
  core.append(spike_compensated_trace(momentum, o.nesterov, spike_delay))
  core.append(optax.scale_by_learning_rate(schedule))
  if o.name == "sgd":  # as optax.sgd: chain(trace, scale_by_learning_rate)
    return optax.chain(optax.add_decayed_weights(o.weight_decay, mask=optim.kernel_mask),
                       optax.chain(*core))
  return optax.chain(
      optim.scale_by_larc(schedule, o.weight_decay, o.trust_coefficient, o.lars_eps), *core)


def _check_momentum(o: ml_collections.ConfigDict, parts: tuple) -> None:
  """ValueError if a momentum-based compensation lacks momentum SGD/LARS."""
  if any(x in parts for x in ("spike", "weight_prediction", "nesterov_lookahead")):
    if o.name not in ("sgd", "lars") or not o.momentum:
      raise ValueError(f"Compensation {'+'.join(parts)!r} needs momentum SGD or LARS "
                       f"(optim.name={o.name!r}, optim.momentum={o.momentum}).")
  if "nesterov_lookahead" in parts and not o.nesterov:
    raise ValueError("nesterov_lookahead needs optim.nesterov = True.")


def _momentum_part(config, steps_per_epoch: int, parts: tuple, d: float, d_ref: float,
                   lookahead_max: float):
  """The momentum optimizer with spike compensation and/or look-ahead momentum."""
  momentum, grad_scale = config.optim.momentum, 1.0
  if "nesterov_lookahead" in parts:
    momentum = lookahead_momentum(config.optim.momentum, lookahead_max, d, d_ref)
    # (1 - gamma) discount, normalised by the base's (1 - m): each gradient's
    # total contribution eta / (1 - m) is kept, and gamma = m is the base.
    grad_scale = (1.0 - momentum) / (1.0 - config.optim.momentum)
  return _momentum_inner(config, steps_per_epoch, momentum, grad_scale,
                         d if "spike" in parts else 0.0)


def make_compensated_optimizer(config: ml_collections.ConfigDict, steps_per_epoch: int, *,
                               name: Optional[str] = None, delay_ticks: float = 0,
                               accumulation_steps: Optional[int] = None,
                               max_delay_ticks: Optional[float] = None,
                               **params) -> optax.GradientTransformation:
  """One stage's optimizer with its delay compensation.

  Args:
    config: the run config (``optim.*``, ``batch_size``, ``num_epochs``,
      ``accumulation_steps``; ``compensation.*`` if present).
    steps_per_epoch: optimizer updates per epoch.
    name: a compensation or several joined by ``"+"`` (:data:`NAMES`);
      default ``config.compensation.name`` (or ``"none"``).
    delay_ticks: ``tau_j`` of the stage, in micro-batches.
    accumulation_steps: ``k`` (default ``config.accumulation_steps``).
    max_delay_ticks: the pipeline's largest ``tau`` (``nesterov_lookahead``'s
      default ``D_ref``); default ``delay_ticks``.
    **params: overrides of ``config.compensation`` fields (:data:`DEFAULTS`).

  Returns:
    ``"none"``: exactly ``optim.make_optimizer(config, steps_per_epoch)``
    (with ``k``). Otherwise the same chain, modified, wrapped in
    ``optax.MultiSteps(every_k_schedule=k)`` when ``k > 1``; ``update`` needs
    ``params``. ``weight_prediction`` alone leaves the optimizer plain (its
    part is :func:`make_predictor`).

  Raises:
    ValueError: unknown names or parameters; ``spike``,
      ``weight_prediction`` or ``nesterov_lookahead`` without momentum
      (``optim.name == "adam"`` or ``optim.momentum == 0``);
      ``nesterov_lookahead`` without ``optim.nesterov``.
  """
  p = _params(config, params)
  parts = parse_name(p["name"] if name is None else name)
  k = config.accumulation_steps if accumulation_steps is None else accumulation_steps
  base_config = _with_k(config, k) if k != config.accumulation_steps else config
  if parts == ("none",):
    return optim.make_optimizer(base_config, steps_per_epoch)
  _check_momentum(config.optim, parts)
  d = delay_in_updates(delay_ticks, k)
  if any(x in parts for x in _MOMENTUM):
    d_ref = p["lookahead_delay_ref"] or delay_in_updates(
        delay_ticks if max_delay_ticks is None else max_delay_ticks, k)
    inner = _momentum_part(config, steps_per_epoch, parts, d, d_ref, p["lookahead_momentum"])
  else:
    inner = optim.make_optimizer(_with_k(config, 1), steps_per_epoch)
  if "lr_scale" in parts or "pipemare" in parts:
    anneal = (int(round(p["pipemare_warmup_epochs"] * steps_per_epoch))
              if "pipemare" in parts else 0)
    if "pipemare" in parts and anneal <= 0:
      raise ValueError("pipemare needs pipemare_warmup_epochs * steps_per_epoch >= 1.")
    inner = optax.chain(inner, scale_by_delay(d, p["lr_power"], anneal))
  return optax.MultiSteps(inner, every_k_schedule=k) if k > 1 else inner


def make_predictor(config: ml_collections.ConfigDict, steps_per_epoch: int, *,
                   name: Optional[str] = None, delay_ticks: float = 0,
                   accumulation_steps: Optional[int] = None,
                   **params) -> Optional[Callable]:
  """The stage's ``(params, opt_state) -> params`` for its forward, or None.

  ``functools.partial(predict_params, delay_updates=tau/k, learning_rate=
  schedule, scale=prediction_scale)`` when ``name`` includes
  ``weight_prediction`` and the delay is not 0; None otherwise (the forward
  uses the current weights). The form of ``Pipeline(predictors=...)``.
  """
  p = _params(config, params)
  parts = parse_name(p["name"] if name is None else name)
  k = config.accumulation_steps if accumulation_steps is None else accumulation_steps
  d = delay_in_updates(delay_ticks, k)
  if "weight_prediction" not in parts or d * p["prediction_scale"] == 0:
    return None
  if config.optim.name not in ("sgd", "lars") or not config.optim.momentum:
    raise ValueError("weight_prediction needs momentum SGD or LARS.")
  return functools.partial(predict_params, delay_updates=d,
                           learning_rate=optim.learning_rate_schedule(config, steps_per_epoch),
                           scale=p["prediction_scale"])


def _stage_ticks(num_stages: int, delays_ticks: Optional[Sequence[float]]) -> list:
  ticks = ([stage_delay_ticks(j, num_stages) for j in range(num_stages)]
           if delays_ticks is None else list(delays_ticks))
  if len(ticks) != num_stages:
    raise ValueError(f"{len(ticks)} delays for {num_stages} stages.")
  return ticks


def stage_optimizers(config: ml_collections.ConfigDict, steps_per_epoch: int, num_stages: int,
                     delays_ticks: Optional[Sequence[float]] = None, **params) -> list:
  """One compensated optimizer per stage (``Pipeline(tx=...)``).

  ``delays_ticks`` defaults to PETRA's ``tau_j = 2 (J - 1 - j)``; give zeros
  for methods without delay (``not methods.get(name).delayed``), which makes
  every optimizer the plain one.
  """
  ticks = _stage_ticks(num_stages, delays_ticks)
  return [make_compensated_optimizer(config, steps_per_epoch, delay_ticks=t,
                                     max_delay_ticks=max(ticks), **params) for t in ticks]


def stage_predictors(config: ml_collections.ConfigDict, steps_per_epoch: int, num_stages: int,
                     delays_ticks: Optional[Sequence[float]] = None, **params) -> list:
  """One :func:`make_predictor` per stage (``Pipeline(predictors=...)``)."""
  ticks = _stage_ticks(num_stages, delays_ticks)
  return [make_predictor(config, steps_per_epoch, delay_ticks=t, **params) for t in ticks]
