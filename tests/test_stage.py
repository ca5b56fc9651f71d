"""Reversible stage: inverse round-trip and the reverse vjp against jax.grad."""

import chex
import jax
import jax.numpy as jnp
import optax
import pytest

import helpers
from petra_jax import models

from petra_jax.engine import pipeline
from petra_jax.engine.stages import stage as stage_lib
from helpers import jitted, random_batch, rel_err


@pytest.fixture(scope="module")
def tiny():
  stages = models.build_model("revnet18", width=4)
  pipe = pipeline.Pipeline(stages, optax.sgd(1.0), jax.devices()[:1])
  x, y = random_batch()
  state = pipe.init(0, x)
  return stages, pipe, state, x, y


def test_inverse_round_trips():
  s = models.build_model("revnet18", width=4)[1]
  assert s.reversible
  key = jax.random.key(1)
  x = (jax.random.normal(key, (8, 16, 16, 4)), jax.random.normal(jax.random.key(2), (8, 16, 16, 4)))
  v = s.init(jax.random.key(3), x)
  y, _ = stage_lib.forward(s, v["params"], v["batch_stats"], x)
  x_rec = stage_lib.inverse(s, v["params"], v["batch_stats"], y)
  # x2 = (x2 + F(x1)) - F(x1) in float32: error of a few ulps of |x2 + F(x1)| ~ 1e-6.
  chex.assert_trees_all_close(x_rec, x, atol=1e-5, rtol=1e-5)
  # The round-trip is not vacuous: y differs from x.
  assert float(jnp.abs(y[0] - x[0]).max()) > 0.1


def test_inverse_of_non_reversible_raises():
  s = models.build_model("revnet18", width=4)[3]
  with pytest.raises(ValueError, match="not reversible"):
    stage_lib.inverse(s, {}, {}, None)


def test_reverse_vjp_chain_matches_jax_grad(tiny):
  """Reconstructed inputs, cotangents and parameter gradients at every stage
  equal jax.grad of the composed model (no delay)."""
  stages, _, state, x, y = tiny
  params = [s.params for s in state.train_states]
  stats = [s.batch_stats for s in state.train_states]
  acts = [x]
  for s, p, bs in zip(stages[:-1], params, stats):
    acts.append(jitted(stage_lib.forward, s)(p, bs, acts[-1])[0])
  # The composed model's parameter gradients and every stage output's cotangent, one grad.
  ref_grads, ref_dys = helpers.composed_cotangents(stages, params, stats, x, y, acts[1:])
  _, dy, g_last, _ = jitted(stage_lib.loss_vjp, stages[-1])(params[-1], stats[-1], acts[-1], y)
  # float32 round-off through 10 stages: relative error ~1e-6 measured; 1e-4
  # leaves room for other CPUs while still catching any real mistake (O(1)).
  assert rel_err(g_last, ref_grads[-1]) < 1e-4
  y_rec = acts[-1]
  for j in range(len(stages) - 2, -1, -1):
    s = stages[j]
    assert rel_err(dy, ref_dys[j]) < 1e-4, j  # the cotangent of stage j's output
    if s.reversible:
      x_rec, dy, g, _ = jitted(stage_lib.reverse_vjp, s)(params[j], stats[j], y_rec, dy)
      chex.assert_trees_all_close(x_rec, acts[j], atol=1e-5, rtol=1e-5)
    else:
      x_rec = acts[j]
      dy, g, _ = jitted(stage_lib.recompute_vjp, s, input_grad=j > 0)(params[j], stats[j], x_rec, dy)
    assert rel_err(g, ref_grads[j]) < 1e-4, (j, s.name)
    y_rec = x_rec


def test_revprop_engine_update_equals_jax_grad(tiny):
  """One revprop step with SGD(lr=1) moves every parameter by -jax.grad."""
  stages, pipe, state, x, y = tiny
  params = [s.params for s in state.train_states]
  stats = [s.batch_stats for s in state.train_states]
  ref = helpers.composed_grad(stages, params, stats, x, y)
  before = jax.tree.map(lambda a: a.copy(), params)  # the step donates state
  state, loss = helpers.drained_step(pipe, state, x, y)
  after = [s.params for s in state.train_states]
  step = jax.tree.map(lambda b, a: b - a, before, after)
  for j in range(len(stages)):
    assert rel_err(step[j], ref[j]) < 1e-4, (j, stages[j].name)
  assert jnp.isfinite(loss)
