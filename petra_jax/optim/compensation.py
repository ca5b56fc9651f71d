"""Per-stage delay compensations (``compensation.name``, joined by ``"+"``); plain at ``D = 0``.

``lr_scale``, ``pipemare`` (PipeMare), ``error_feedback`` (Zmushko et al., 2026):
any optimizer. ``spike``, ``weight_prediction`` (Kosson et al., 2021),
``nesterov_lookahead`` (Ajanthan et al., 2025): momentum SGD/LARS.
``adam_prediction`` (PipeOptim), ``adam_lookahead``, ``adam_momentum``: AdamW.
``update_prediction`` (marin #6431, weight prediction along the last update): any optimizer,
meant for Muon. The look-aheads' momentum ``gamma(D)``: ``lookahead_rule="run_max"`` (the
default, linear in ``D / D_ref``, ``D_ref`` the run's largest delay unless
``lookahead_delay_ref``) or ``"own_delay"`` (:func:`momentum.own_delay_momentum`: from the
stage's own ``D_j = tau_j / k`` only).
"""

from __future__ import annotations

import functools
from typing import Callable, Optional, Sequence

import ml_collections
import optax

from petra_jax import config as config_lib
from petra_jax import optim
from petra_jax.optim import adam_delay
from petra_jax.optim.delays import delay_in_updates, stage_delays
from petra_jax.optim.lr_scaling import scale_by_delay
from petra_jax.optim.momentum import (lookahead_momentum, own_delay_momentum,
                                      spike_compensated_trace)
from petra_jax.optim.prediction import predict_by_update, predict_params, remember_update

NAMES = ("none", "lr_scale", "pipemare", "spike", "weight_prediction", "nesterov_lookahead",
         "adam_prediction", "adam_lookahead", "adam_momentum", "error_feedback",
         "update_prediction")
LOOKAHEAD_RULES = ("run_max", "own_delay")
_PREDICTIONS = ("weight_prediction", "adam_prediction", "update_prediction")
_MOMENTUM = ("spike", "nesterov_lookahead")  # rebuild the sgd/lars chain
_LR = ("lr_scale", "pipemare")
_ADAM = ("adam_prediction", "adam_lookahead", "adam_momentum")
_EXCLUSIVE = (_LR, ("weight_prediction", "adam_prediction"), ("adam_lookahead", "adam_momentum"),
              ("weight_prediction", "update_prediction"), ("adam_prediction", "update_prediction"))

DEFAULTS = config_lib.get_config().compensation.to_dict()  # of ``config.compensation``


def defaults() -> ml_collections.ConfigDict:
  """The proposed ``config.compensation`` block, with its defaults."""
  return ml_collections.ConfigDict(dict(DEFAULTS))


def parse_name(name: str) -> tuple:
  """``"spike+weight_prediction"`` -> ``("spike", "weight_prediction")``.

  Raises:
    ValueError: an unknown name, one twice, ``none`` with another, or both of a
      pair in ``_EXCLUSIVE``.
  """
  parts = tuple(p.strip() for p in str(name).split("+") if p.strip()) or ("none",)
  for p in parts:
    if p not in NAMES:
      raise ValueError(f"Unknown compensation {p!r}; choose from {NAMES} (join with '+').")
  if len(set(parts)) != len(parts):
    raise ValueError(f"Compensation {name!r} names one method twice.")
  if "none" in parts and len(parts) > 1:
    raise ValueError("'none' cannot be combined with another compensation.")
  for a, b in _EXCLUSIVE:
    if a in parts and b in parts:
      raise ValueError(f"Choose one of {a!r} and {b!r}.")
  return parts


def _params(config, overrides: dict) -> dict:
  p = dict(DEFAULTS)
  if "compensation" in config:
    p.update({key: config.compensation[key] for key in config.compensation.keys()})
  p.update(overrides)
  unknown = set(p) - set(DEFAULTS)
  if unknown:
    raise ValueError(f"Unknown compensation parameters {sorted(unknown)}.")
  if p["lookahead_rule"] not in LOOKAHEAD_RULES:
    raise ValueError(f"Unknown compensation.lookahead_rule {p['lookahead_rule']!r}; choose "
                     f"one of {LOOKAHEAD_RULES}.")
  return p


def lookahead_gamma(p: dict, base: float, d: float, d_ref: float) -> float:
  """The look-ahead momentum of a stage ``d`` updates stale, by ``p["lookahead_rule"]``."""
  if p["lookahead_rule"] == "own_delay":
    return own_delay_momentum(base, p["lookahead_momentum"], d)
  return lookahead_momentum(base, p["lookahead_momentum"], d, d_ref)


def check_optimizer(o: ml_collections.ConfigDict, parts: tuple) -> None:
  """ValueError if a compensation does not fit ``optim.name`` (``o`` is ``config.optim``)."""
  if any(x in parts for x in ("spike", "weight_prediction", "nesterov_lookahead")):
    if o.name not in ("sgd", "lars") or not o.momentum:
      raise ValueError(f"Compensation {'+'.join(parts)!r} needs momentum SGD or LARS "
                       f"(optim.name={o.name!r}, optim.momentum={o.momentum}).")
  if "nesterov_lookahead" in parts and not o.nesterov:
    raise ValueError("nesterov_lookahead needs optim.nesterov = True.")
  if any(x in parts for x in _ADAM) and o.name != "adam":
    raise ValueError(f"Compensation {'+'.join(parts)!r} needs optim.name='adam' "
                     f"(got {o.name!r}).")


def _momentum_part(o: ml_collections.ConfigDict, lr_schedule: optax.Schedule, parts: tuple,
                   d: float, d_ref: float, p: dict) -> optax.GradientTransformation:
  """The sgd/lars chain with a spike-compensated and/or look-ahead (``gamma(d)``) trace."""
  momentum, grad_scale = o.momentum, 1.0
  if "nesterov_lookahead" in parts:
    momentum = lookahead_gamma(p, o.momentum, d, d_ref)
    grad_scale = (1.0 - momentum) / (1.0 - o.momentum)
  core = [] if grad_scale == 1.0 else [optax.scale(grad_scale)]
  core.append(spike_compensated_trace(momentum, o.nesterov, d if "spike" in parts else 0.0))
  return optim.momentum_chain(o, lr_schedule, core)


def _adam_part(o: ml_collections.ConfigDict, lr_schedule: optax.Schedule, parts: tuple,
               d: float, d_ref: float, p: dict) -> optax.GradientTransformation:
  """AdamW with ``b1 = gamma(d)``, Nesterov for ``adam_lookahead``; plain at ``d = 0``."""
  b1 = lookahead_gamma(p, o.adam_b1, d, d_ref)
  return adam_delay.lookahead_adamw(lr_schedule, b1, o.adam_b2, o.adam_eps, o.weight_decay,
                                    nesterov="adam_lookahead" in parts and d > 0)


def _lr_part(p: dict, parts: tuple, d: float, steps_per_epoch: int
             ) -> optax.GradientTransformation:
  """``scale_by_delay`` of ``lr_scale`` or ``pipemare`` (ValueError: ``K < 1`` update)."""
  anneal = (int(round(p["pipemare_warmup_epochs"] * steps_per_epoch))
            if "pipemare" in parts else 0)
  if "pipemare" in parts and anneal <= 0:
    raise ValueError("pipemare needs pipemare_warmup_epochs * steps_per_epoch >= 1.")
  return scale_by_delay(d, p["lr_power"], anneal)


def make_compensated_optimizer(config: ml_collections.ConfigDict, steps_per_epoch: int, *,
                               name: Optional[str] = None, delay_ticks: float = 0,
                               accumulation_steps: Optional[int] = None,
                               max_delay_ticks: Optional[float] = None,
                               lr_schedule: Optional[optax.Schedule] = None,
                               **params) -> optax.GradientTransformation:
  """One stage's optimizer for ``D = delay_ticks / k``: ``optim.make_optimizer``'s,
  modified. ``name`` defaults to ``config.compensation.name``, ``k`` to
  ``config.accumulation_steps``, ``max_delay_ticks`` (the look-aheads' ``D_ref``)
  to ``delay_ticks``; ``**params`` override ``config.compensation``.

  Raises:
    ValueError: unknown names or parameters; one that does not fit ``optim.name``.
  """
  p = _params(config, params)
  parts = parse_name(p["name"] if name is None else name)
  k = config.accumulation_steps if accumulation_steps is None else accumulation_steps
  if lr_schedule is None:
    lr_schedule = optim.learning_rate_schedule(config, steps_per_epoch)
  if parts == ("none",):
    return optim.accumulate(optim.base_optimizer(config, lr_schedule), k)
  check_optimizer(config.optim, parts)
  d = delay_in_updates(delay_ticks, k)
  d_ref = p["lookahead_delay_ref"] or delay_in_updates(
      delay_ticks if max_delay_ticks is None else max_delay_ticks, k)
  if any(x in parts for x in _MOMENTUM):
    inner = _momentum_part(config.optim, lr_schedule, parts, d, d_ref, p)
  elif any(x in parts for x in ("adam_lookahead", "adam_momentum")) and d > 0:
    inner = _adam_part(config.optim, lr_schedule, parts, d, d_ref, p)
  else:
    inner = optim.base_optimizer(config, lr_schedule)
  if "error_feedback" in parts and d * p["prediction_scale"] > 0:
    inner = optax.chain(inner, adam_delay.error_feedback(d * p["prediction_scale"]))
  if any(x in parts for x in _LR):
    inner = optax.chain(inner, _lr_part(p, parts, d, steps_per_epoch))
  if "update_prediction" in parts and d * p["prediction_scale"] > 0:
    inner = optax.chain(inner, remember_update())  # last: it keeps the update applied
  return optim.accumulate(inner, k)


def make_predictor(config: ml_collections.ConfigDict, steps_per_epoch: int, *,
                   name: Optional[str] = None, delay_ticks: float = 0,
                   accumulation_steps: Optional[int] = None,
                   lr_schedule: Optional[optax.Schedule] = None,
                   **params) -> Optional[Callable]:
  """The stage's ``(params, opt_state) -> params`` for its forward (``weight_prediction``,
  ``adam_prediction`` or ``update_prediction`` over ``prediction_scale * D`` updates), None
  without.

  Raises:
    ValueError: as :func:`make_compensated_optimizer`.
  """
  p = _params(config, params)
  parts = parse_name(p["name"] if name is None else name)
  k = config.accumulation_steps if accumulation_steps is None else accumulation_steps
  d = delay_in_updates(delay_ticks, k)
  kind = [x for x in parts if x in _PREDICTIONS]
  if not kind or d * p["prediction_scale"] == 0:
    return None
  check_optimizer(config.optim, tuple(kind))
  if kind == ["update_prediction"]:
    return functools.partial(predict_by_update, delay_updates=d, scale=p["prediction_scale"])
  if lr_schedule is None:
    lr_schedule = optim.learning_rate_schedule(config, steps_per_epoch)
  if kind == ["weight_prediction"]:
    return functools.partial(predict_params, delay_updates=d, learning_rate=lr_schedule,
                             scale=p["prediction_scale"])
  o = config.optim
  return functools.partial(adam_delay.adam_predict_params, delay_updates=d,
                           learning_rate=lr_schedule, b1=o.adam_b1, b2=o.adam_b2, eps=o.adam_eps,
                           weight_decay=o.weight_decay, scale=p["prediction_scale"])


def stage_optimizers(config: ml_collections.ConfigDict, steps_per_epoch: int, num_stages: int,
                     delays_ticks: Optional[Sequence[float]] = None, *,
                     lr_schedule: Optional[optax.Schedule] = None, **params) -> list:
  """One compensated optimizer per stage (``Pipeline(tx=...)``); ``delays_ticks``
  default PETRA's ``tau_j = 2 (J - 1 - j)`` (zeros: every optimizer plain)."""
  ticks = stage_delays(num_stages, delays_ticks)
  if lr_schedule is None:
    lr_schedule = optim.learning_rate_schedule(config, steps_per_epoch)
  return [make_compensated_optimizer(config, steps_per_epoch, delay_ticks=t,
                                     max_delay_ticks=max(ticks), lr_schedule=lr_schedule, **params)
          for t in ticks]


def stage_predictors(config: ml_collections.ConfigDict, steps_per_epoch: int, num_stages: int,
                     delays_ticks: Optional[Sequence[float]] = None, *,
                     lr_schedule: Optional[optax.Schedule] = None, **params) -> list:
  """One :func:`make_predictor` per stage (``Pipeline(predictors=...)``)."""
  ticks = stage_delays(num_stages, delays_ticks)
  if lr_schedule is None:
    lr_schedule = optim.learning_rate_schedule(config, steps_per_epoch)
  return [make_predictor(config, steps_per_epoch, delay_ticks=t, lr_schedule=lr_schedule, **params)
          for t in ticks]
