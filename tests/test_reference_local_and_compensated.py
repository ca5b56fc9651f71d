"""The methods without a cotangent (``local``, ``forward_gradient``) and the delay
compensations against the independent reference (``tests/reference_loop.py``), with
real delays.

* ``local`` (DGL) and ``forward_gradient`` (random guesses from the engine's seed,
  perturbing activities or weights; local guesses from the auxiliary heads) on the
  RevNet of J = 4 stages (stem | reversible | reversible | head), k = 2;
* ``weight_prediction`` (momentum SGD), ``adam_lookahead`` (AdamW with a
  per-stage ``b1``), ``update_prediction`` (Muon) and ``error_feedback`` (momentum SGD)
  under ``petra`` and ``delayed`` (tau_j = 6, 4, 2, 0 ticks; k = 2: D_j = 3, 2, 1, 0
  updates) on that RevNet, and weight prediction and error feedback on a RevViT of
  J = 3 at k = 2; the engine's optimizers come from ``compensation.stage_optimizers``
  and ``stage_predictors`` (what a run builds), the reference's from its own
  formulas (:func:`reference_loop.momentum_sgd`, :func:`reference_loop.lookahead_b1`,
  :class:`reference_loop.Compensation`); Muon's own step is the engine's
  ``optim.muon.muon`` (its prediction and feedback are the reference's).

12 micro-batches each; per-micro-batch losses, final weights and BatchNorm
statistics within the tolerances of ``test_reference_methods``.
"""

import functools

import jax
import numpy as np
import optax
import pytest

import reference_loop as ref
from helpers import drained_run, reference_revnet, reference_revvit
from helpers import random_batch
from petra_jax import config as config_lib
from petra_jax.engine import pipeline
from petra_jax.engine.methods import forward_gradient as fg_lib
from petra_jax.models import auxiliary
from petra_jax.optim import compensation
from petra_jax.optim.muon import muon

NUM_MICRO, POOL, K, LR = 12, 4, 2, 0.05
# Measured float32 round-off over every case below (relative): losses at most 1.8e-7,
# weights (max over stages of ||a - b|| / ||b||) 1.5e-7, BatchNorm statistics 1.1e-7.
LOSS_RTOL, PARAMS_RTOL = 1e-6, 1e-6


def _batches(m):
  return random_batch(batch=8, size=8, seed=m % POOL)


_revnet, _revvit = reference_revnet, reference_revvit


def _with_heads(stages):
  return auxiliary.with_heads(stages, "linear", 10)


def _run_engine(stages, txs, method, predictors=None, options=None):
  """The engine over ``NUM_MICRO`` micro-batches, drained: ``(p0, s0, losses, params, stats)``."""
  pipe = pipeline.Pipeline(stages, txs, jax.devices()[:1], method=method, accumulation_steps=K,
                           predictors=predictors, forward_gradient=options)
  return drained_run(pipe, _batches, NUM_MICRO)


def _check(engine, want, loss_rtol=LOSS_RTOL, params_rtol=PARAMS_RTOL):
  _, _, losses, params, stats = engine
  np.testing.assert_allclose(losses, want.losses, rtol=loss_rtol)
  assert ref.max_rel_diff(params, want.params) < params_rtol
  assert ref.max_rel_diff(stats, want.batch_stats) < params_rtol


def _sgd_tx():
  return optax.sgd(LR, momentum=0.9)


def test_local_equals_the_reference():
  """DGL: each stage from its own head's loss (SGD-momentum and AdamW stages)."""
  stages = _with_heads(_revnet())
  txs = [_sgd_tx(), optax.adamw(1e-2, weight_decay=0.05), _sgd_tx(), _sgd_tx()]
  engine = _run_engine(stages, [optax.MultiSteps(t, K) for t in txs], "local")
  want = ref.run_local(ref.StageFunctions(stages), txs, K, engine[0], engine[1], _batches,
                       NUM_MICRO)
  _check(engine, want)
  # no cotangent: a stage's weights do not depend on the stages after it
  other = ref.run_local(ref.StageFunctions(stages), txs[:3] + [optax.sgd(0.5)], K, engine[0],
                        engine[1], _batches, NUM_MICRO)
  assert ref.max_rel_diff(other.params[:3], want.params[:3]) == 0.0


FG_CASES = {  # name: (guess, perturb, with heads)
    "random_activity": ("random", "activity", False),
    "random_weights": ("random", "weights", False),
    "local_activity": ("local", "activity", True),
}


@pytest.mark.parametrize("case", [
    pytest.param(c, marks=[] if c == "random_activity" else [pytest.mark.long]) for c in FG_CASES])
def test_forward_gradient_equals_the_reference(case):
  """Forward gradients on the stream, delays 6, 4, 2, 0 ticks, k = 2, seed 5: the same
  guesses from the same key derivation, the same estimate; not the exact gradient."""
  guess, perturb, heads = FG_CASES[case]
  stages = _with_heads(_revnet()) if heads else _revnet()
  options = fg_lib.Options(guess=guess, perturb=perturb, seed=5)
  engine = _run_engine(stages, [optax.MultiSteps(_sgd_tx(), K)] * 4, "forward_gradient",
                       options=options)
  fns = ref.StageFunctions(stages)
  fg = ref.ForwardGradient(guess, perturb, seed=5)
  want = ref.run_forward_gradient(fns, fg, [_sgd_tx()] * 4, K, engine[0], engine[1], _batches,
                                  NUM_MICRO)
  _check(engine, want)
  other = ref.run_forward_gradient(fns, fg._replace(seed=6), [_sgd_tx()] * 4, K, engine[0],
                                   engine[1], _batches, NUM_MICRO)
  if guess == "random":  # the guesses are the seed's
    assert ref.max_rel_diff(other.params[:3], want.params[:3]) > 1e-3


def _config(name, comp):
  c = config_lib.get_config()
  c.accumulation_steps, c.batch_size, c.num_epochs = K, 8, 10
  c.optim.name, c.optim.schedule, c.optim.warmup_epochs = name, "constant", 0.0
  c.optim.learning_rate, c.optim.momentum, c.optim.nesterov = LR, 0.9, False
  c.optim.weight_decay = 5e-4 if name == "sgd" else 0.05
  if name != "sgd":
    c.optim.learning_rate = 1e-2
  c.compensation.name = comp
  return c


def _horizons(J):
  return [2 * (J - 1 - j) / K for j in range(J)]  # D_j = tau_j / k updates, scale 1


def _reference_optimizers(comp, J):
  """``(txs, compensations)`` of the reference for ``comp``, from their formulas."""
  d = _horizons(J)
  c = _config("sgd", comp)
  if comp == "weight_prediction":
    return ([ref.momentum_sgd(LR, 0.9, 5e-4)] * J,
            [ref.Compensation("velocity", h, LR) for h in d])
  if comp == "error_feedback":
    return ([ref.momentum_sgd(LR, 0.9, 5e-4)] * J,
            [ref.Compensation("error_feedback", h) for h in d])
  if comp == "adam_lookahead":
    o = _config("adam", comp).optim
    b1 = [ref.lookahead_b1(o.adam_b1, c.compensation.lookahead_momentum, h, d[0]) for h in d]
    return ([optax.adamw(1e-2, b1=b, b2=o.adam_b2, eps=o.adam_eps, weight_decay=0.05,
                         mask=ref.kernel_mask, nesterov=h > 0) for b, h in zip(b1, d)],
            [ref.Compensation()] * J)
  o = _config("muon", comp).optim  # update_prediction
  tx = muon(optax.constant_schedule(1e-2), optax.constant_schedule(o.muon_learning_rate),
            momentum=o.muon_momentum, weight_decay=0.05, b1=o.adam_b1, b2=o.adam_b2,
            eps=o.adam_eps, decay_mask=ref.kernel_mask)
  return [tx] * J, [ref.Compensation("last_update", h) for h in d]


COMPENSATIONS = {  # compensation: the engine's optimizer
    "weight_prediction": "sgd", "adam_lookahead": "adam", "update_prediction": "muon",
    "error_feedback": "sgd"}
MODELS = {"revnet": _revnet, "revvit": _revvit}


@functools.lru_cache(maxsize=None)
def _compensated(model, comp, method):
  stages = MODELS[model]()
  J = len(stages)
  c = _config(COMPENSATIONS[comp], comp)
  txs = compensation.stage_optimizers(c, 10, J)
  predictors = compensation.stage_predictors(c, 10, J)
  engine = _run_engine(stages, txs, method, predictors=predictors)
  ref_txs, comps = _reference_optimizers(comp, J)
  want = ref.run(ref.StageFunctions(stages), ref.ROWS[method], ref_txs, K, engine[0],
                 engine[1], _batches, NUM_MICRO, comps)
  plain = ref.run(ref.StageFunctions(stages), ref.ROWS[method], ref_txs, K, engine[0],
                  engine[1], _batches, NUM_MICRO)
  return engine, want, plain


@pytest.mark.parametrize("method, comp", [
    pytest.param(m, c, marks=[] if m == "petra" else [pytest.mark.long])
    for m in ("petra", "delayed") for c in COMPENSATIONS])
def test_compensation_equals_the_reference_revnet(comp, method):
  """Each compensation, as a run builds it, at D_j = 3, 2, 1, 0 updates; it changes the
  trajectory (the reference without it differs)."""
  engine, want, plain = _compensated("revnet", comp, method)
  _check(engine, want)
  if comp != "adam_lookahead":  # (its b1 is the reference optimizer's own)
    assert ref.max_rel_diff(want.params, plain.params) > 100 * PARAMS_RTOL


@pytest.mark.parametrize("comp", ["weight_prediction", "error_feedback"])
def test_compensation_equals_the_reference_revvit(comp):
  """A RevViT (stem | attention + MLP couplings | head), petra, k = 2, delays 4, 2, 0."""
  engine, want, plain = _compensated("revvit", comp, "petra")
  _check(engine, want)
  assert ref.max_rel_diff(want.params, plain.params) > 100 * PARAMS_RTOL
