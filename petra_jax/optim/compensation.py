"""Delay compensations for the stale gradients of a pipelined stage.

In PETRA (and every ``stream`` method) stage ``j`` of ``J`` applies the
gradient of a micro-batch ``tau_j = 2 (J - 1 - j)`` ticks after its forward
(:func:`petra_jax.engine.schedule.delay`). With ``k``-step accumulation (``optax.MultiSteps``)
the weights change once per ``k`` ticks, so the forward's weights are on
average ``D_j = tau_j / k`` *updates* older than the ones the gradient is
applied to (:func:`petra_jax.optim.delays.delay_in_updates`; exact for every micro-batch when ``k``
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
  starts at ``eta / D_j`` and reaches the base schedule after ``K`` updates
  (:mod:`petra_jax.optim.lr_scaling`).

``spike`` -- spike compensation for momentum SGD (Kosson et al., 2021,
  "Pipelined Backpropagation at Scale: Training Large Models without
  Batches", MLSys; Sec. 4.1 "Spike Compensation"): a gradient that arrives
  ``D`` updates late is applied as a spike holding every contribution the
  momentum would already have given it, then decays as if it had come on
  time. See :mod:`petra_jax.optim.momentum`.

``weight_prediction`` -- linear weight prediction (Kosson et al., 2021,
  Sec. 4.2 "Linear Weight Prediction"; the same idea as SpecTrain, Chen et
  al., 2018): the forward of a micro-batch uses the weights extrapolated
  ``D`` updates ahead along the velocity, ``w - eta D v``, so that its
  gradient is computed (nearly) at the weights it will be applied to. The
  optimizer is the plain one; the engine calls ``predict_params`` before
  the forward (:func:`make_predictor`, :mod:`petra_jax.optim.prediction`).

``nesterov_lookahead`` -- the modified Nesterov method for asynchronous
  pipelines (Ajanthan et al., 2025, "Nesterov Method for Asynchronous Pipeline
  Parallel Optimization", ICML, arXiv:2505.01099; Sec. 3). NAG with its
  gradient term discounted by ``(1 - gamma)`` and a momentum ``gamma`` that
  grows with the stage's delay. See :mod:`petra_jax.optim.momentum`.

The equations are quoted in each function's docstring; this module parses
``compensation.name`` and builds the per-stage optimizers and predictors. All state lives in the
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

import functools
from typing import Callable, Optional, Sequence

import ml_collections
import optax

from petra_jax import config as config_lib
from petra_jax import optim
from petra_jax.optim.delays import delay_in_updates, stage_delays
from petra_jax.optim.lr_scaling import scale_by_delay
from petra_jax.optim.momentum import lookahead_momentum, spike_compensated_trace
from petra_jax.optim.prediction import predict_params

NAMES = ("none", "lr_scale", "pipemare", "spike", "weight_prediction", "nesterov_lookahead")
# Those that change the momentum (rebuilt chain); those that scale the learning rate.
_MOMENTUM = ("spike", "nesterov_lookahead")
_LR = ("lr_scale", "pipemare")

DEFAULTS = config_lib.get_config().compensation.to_dict()  # of ``config.compensation``


def defaults() -> ml_collections.ConfigDict:
  """The proposed ``config.compensation`` block, with its defaults."""
  return ml_collections.ConfigDict(dict(DEFAULTS))


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


def _params(config, overrides: dict) -> dict:
  p = dict(DEFAULTS)
  if "compensation" in config:
    p.update({key: config.compensation[key] for key in config.compensation.keys()})
  p.update(overrides)
  unknown = set(p) - set(DEFAULTS)
  if unknown:
    raise ValueError(f"Unknown compensation parameters {sorted(unknown)}.")
  return p


def _check_momentum(o: ml_collections.ConfigDict, parts: tuple) -> None:
  """ValueError if a momentum-based compensation lacks momentum SGD/LARS."""
  if any(x in parts for x in ("spike", "weight_prediction", "nesterov_lookahead")):
    if o.name not in ("sgd", "lars") or not o.momentum:
      raise ValueError(f"Compensation {'+'.join(parts)!r} needs momentum SGD or LARS "
                       f"(optim.name={o.name!r}, optim.momentum={o.momentum}).")
  if "nesterov_lookahead" in parts and not o.nesterov:
    raise ValueError("nesterov_lookahead needs optim.nesterov = True.")


def _momentum_part(o: ml_collections.ConfigDict, schedule: optax.Schedule, parts: tuple,
                   d: float, d_ref: float, lookahead_max: float) -> optax.GradientTransformation:
  """The ``sgd``/``lars`` chain with spike compensation and/or look-ahead momentum.

  :func:`petra_jax.optim.momentum_chain` with its ``optax.trace`` replaced by
  a spike-compensated one (delay ``d`` if ``spike`` is in ``parts``, else
  0: the plain trace) of decay ``gamma(d)`` (``nesterov_lookahead``) or
  ``o.momentum``, fed the gradients times ``(1 - gamma) / (1 - m)``. With
  neither it is ``optim.make_optimizer``'s chain (updates and state tree).
  """
  momentum, grad_scale = o.momentum, 1.0
  if "nesterov_lookahead" in parts:
    momentum = lookahead_momentum(o.momentum, lookahead_max, d, d_ref)
    # (1 - gamma) discount, normalised by the base's (1 - m): each gradient's
    # total contribution eta / (1 - m) is kept, and gamma = m is the base.
    grad_scale = (1.0 - momentum) / (1.0 - o.momentum)
  core = [] if grad_scale == 1.0 else [optax.scale(grad_scale)]
  core.append(spike_compensated_trace(momentum, o.nesterov, d if "spike" in parts else 0.0))
  return optim.momentum_chain(o, schedule, core)


def _lr_part(p: dict, parts: tuple, d: float, steps_per_epoch: int
             ) -> optax.GradientTransformation:
  """``scale_by_delay`` of ``lr_scale`` (fixed) or ``pipemare`` (annealed).

  Raises:
    ValueError: ``pipemare`` with an annealing of less than one update.
  """
  anneal = (int(round(p["pipemare_warmup_epochs"] * steps_per_epoch))
            if "pipemare" in parts else 0)
  if "pipemare" in parts and anneal <= 0:
    raise ValueError("pipemare needs pipemare_warmup_epochs * steps_per_epoch >= 1.")
  return scale_by_delay(d, p["lr_power"], anneal)


def make_compensated_optimizer(config: ml_collections.ConfigDict, steps_per_epoch: int, *,
                               name: Optional[str] = None, delay_ticks: float = 0,
                               accumulation_steps: Optional[int] = None,
                               max_delay_ticks: Optional[float] = None,
                               schedule: Optional[optax.Schedule] = None,
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
    schedule: the run's learning-rate schedule; default
      ``optim.learning_rate_schedule(config, steps_per_epoch)``.
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
  if schedule is None:
    schedule = optim.learning_rate_schedule(config, steps_per_epoch)
  if parts == ("none",):
    return optim.accumulate(optim.base_optimizer(config, schedule), k)
  _check_momentum(config.optim, parts)
  d = delay_in_updates(delay_ticks, k)
  if any(x in parts for x in _MOMENTUM):
    d_ref = p["lookahead_delay_ref"] or delay_in_updates(
        delay_ticks if max_delay_ticks is None else max_delay_ticks, k)
    inner = _momentum_part(config.optim, schedule, parts, d, d_ref, p["lookahead_momentum"])
  else:
    inner = optim.base_optimizer(config, schedule)
  if any(x in parts for x in _LR):
    inner = optax.chain(inner, _lr_part(p, parts, d, steps_per_epoch))
  return optim.accumulate(inner, k)


def make_predictor(config: ml_collections.ConfigDict, steps_per_epoch: int, *,
                   name: Optional[str] = None, delay_ticks: float = 0,
                   accumulation_steps: Optional[int] = None,
                   schedule: Optional[optax.Schedule] = None,
                   **params) -> Optional[Callable]:
  """The stage's ``(params, opt_state) -> params`` for its forward, or None.

  ``functools.partial(predict_params, delay_updates=tau/k, learning_rate=
  schedule, scale=prediction_scale)`` when ``name`` includes
  ``weight_prediction`` and the delay is not 0; None otherwise (the forward
  uses the current weights). The form of ``Pipeline(predictors=...)``.
  ``schedule`` as in :func:`make_compensated_optimizer`.

  Raises:
    ValueError: as :func:`make_compensated_optimizer`; ``weight_prediction``
      without momentum SGD or LARS.
  """
  p = _params(config, params)
  parts = parse_name(p["name"] if name is None else name)
  k = config.accumulation_steps if accumulation_steps is None else accumulation_steps
  d = delay_in_updates(delay_ticks, k)
  if "weight_prediction" not in parts or d * p["prediction_scale"] == 0:
    return None
  _check_momentum(config.optim, ("weight_prediction",))
  if schedule is None:
    schedule = optim.learning_rate_schedule(config, steps_per_epoch)
  return functools.partial(predict_params, delay_updates=d, learning_rate=schedule,
                           scale=p["prediction_scale"])


def stage_optimizers(config: ml_collections.ConfigDict, steps_per_epoch: int, num_stages: int,
                     delays_ticks: Optional[Sequence[float]] = None, *,
                     schedule: Optional[optax.Schedule] = None, **params) -> list:
  """One compensated optimizer per stage (``Pipeline(tx=...)``).

  ``delays_ticks`` defaults to PETRA's ``tau_j = 2 (J - 1 - j)``
  (:func:`petra_jax.engine.schedule.delay`); give zeros for methods without
  delay (``not methods.get(name).delayed``), which makes every optimizer the
  plain one. One ``schedule`` serves every stage (default: built once from
  ``config``); ``**params`` as in :func:`make_compensated_optimizer`.
  """
  ticks = stage_delays(num_stages, delays_ticks)
  if schedule is None:
    schedule = optim.learning_rate_schedule(config, steps_per_epoch)
  return [make_compensated_optimizer(config, steps_per_epoch, delay_ticks=t,
                                     max_delay_ticks=max(ticks), schedule=schedule, **params)
          for t in ticks]


def stage_predictors(config: ml_collections.ConfigDict, steps_per_epoch: int, num_stages: int,
                     delays_ticks: Optional[Sequence[float]] = None, *,
                     schedule: Optional[optax.Schedule] = None, **params) -> list:
  """One :func:`make_predictor` per stage (``Pipeline(predictors=...)``), one schedule for all."""
  ticks = stage_delays(num_stages, delays_ticks)
  if schedule is None:
    schedule = optim.learning_rate_schedule(config, steps_per_epoch)
  return [make_predictor(config, steps_per_epoch, delay_ticks=t, schedule=schedule, **params)
          for t in ticks]
