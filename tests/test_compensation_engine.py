"""Delay compensation wired into the engine: each stage gets its own delay,
and predicted weights are what the forward (and a weight stash) use."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from petra_jax import config as config_lib

from petra_jax.optim import compensation

from petra_jax.engine import pipeline

from petra_jax.engine.stages import stage as stage_lib
from petra_jax.training import assembly
from helpers import random_batch, tiny_revnet


def _config(name, **fields):
  c = config_lib.get_config()
  c.model.width, c.batch_size, c.accumulation_steps = 4, 8, 2
  c.optim.learning_rate, c.optim.warmup_epochs, c.optim.schedule = 0.1, 0.0, "constant"
  c.optim.weight_decay = 0.0
  c.compensation.name = name
  for k, v in fields.items():
    setattr(c.model, k, v)
  return c


def _first_update(tx, params):
  """The update of one step on a gradient of ones (k micro-batches)."""
  state, grads = tx.init(params), jax.tree.map(jnp.ones_like, params)
  for _ in range(2):
    updates, state = tx.update(grads, state, params)
  return updates


@pytest.mark.parametrize("sizes", [(1, 2, 2, 5), ()])
def test_each_stage_gets_its_own_delay_in_the_grouped_pipeline(sizes, monkeypatch):
  """lr_scale divides stage j's rate by max(tau_j / k, 1), tau_j = 2(J-1-j) of
  the pipeline as grouped (4 stages, or the paper's 10)."""
  c = _config("lr_scale", stage_sizes=sizes)
  info = assembly.data_lib.DATASETS["cifar10"]
  pipe, _, _ = assembly.build_pipeline(c, "/nonexistent", info, 4, steps_per_epoch=10)
  J = pipe.num_stages
  assert J == (len(sizes) or 10)
  params = {"w": jnp.ones((3,))}
  plain = _first_update(optax.MultiSteps(optax.sgd(0.1, momentum=0.9, nesterov=True), 2),
                        params)["w"]
  for j, tx in enumerate(pipe.txs):
    tau, k = 2 * (J - 1 - j), 2
    got = _first_update(tx, params)["w"]
    np.testing.assert_allclose(got, plain / max(tau / k, 1.0), rtol=1e-6, err_msg=str(j))


def test_methods_without_delay_get_the_plain_optimizer():
  c = _config("lr_scale", stage_sizes=(1, 2, 2, 5))
  c.method = "revprop"
  info = assembly.data_lib.DATASETS["cifar10"]
  pipe, _, _ = assembly.build_pipeline(c, "/nonexistent", info, 4, steps_per_epoch=10)
  params = {"w": jnp.ones((3,))}
  ref = _first_update(pipe.txs[-1], params)["w"]
  for tx in pipe.txs:
    np.testing.assert_array_equal(_first_update(tx, params)["w"], ref)


@pytest.mark.parametrize("method", ["petra", "delayed"])
def test_forward_uses_the_predicted_weights(method):
  """A predictor that shifts every weight by +0.01: stage 0's forward output
  is the forward at the shifted weights; ``delayed`` stashes those weights."""
  stages = tiny_revnet()
  shift = lambda p, opt_state: jax.tree.map(lambda a: a + 0.01, p)  # noqa: E731
  predictors = [shift] + [None] * (len(stages) - 1)
  pipe = pipeline.Pipeline(stages, optax.sgd(0.1), jax.devices()[:1], method=method,
                           predictors=predictors)
  x, y = random_batch()
  state = pipe.init(0, x)
  st = state.train_states[0]
  shifted = jax.tree.map(lambda a: a + 0.01, st.params)
  expected = stage_lib.forward(stages[0], shifted, st.batch_stats, x)[0]
  unshifted = stage_lib.forward(stages[0], st.params, st.batch_stats, x)[0]
  table = pipe.schedule(1)
  state, _ = pipe.run_tick(state, table[0], lambda m: (x, y))
  got = state.inbox[1][0]
  np.testing.assert_allclose(got[0], expected[0], rtol=1e-6, atol=1e-6)
  assert not np.allclose(got[0], unshifted[0])
  if method == "delayed":
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, b),
                 state.weight_stash[0][0], shifted)


def test_weight_prediction_predictor_matches_its_formula():
  """w_hat = w - lr * D * v, D = tau_j / k, v the momentum buffer."""
  c = _config("weight_prediction", stage_sizes=(1, 2, 2, 5))
  preds = compensation.stage_predictors(c, 10, 4)
  params = {"w": jnp.array([1.0, -2.0])}
  tx = compensation.stage_optimizers(c, 10, 4)[0]
  state = tx.init(params)
  g = {"w": jnp.array([0.5, 0.25])}
  for _ in range(2):  # one update of k = 2 micro-batches
    updates, state = tx.update(g, state, params)
    params = optax.apply_updates(params, updates)
  v = g["w"]  # momentum buffer after one update from zero: the mean gradient
  D = 2 * 3 / 2  # stage 0 of 4, k = 2
  np.testing.assert_allclose(preds[0](params, state)["w"], params["w"] - 0.1 * D * v,
                             rtol=1e-6)


def test_compensated_pipeline_resumes_bit_exactly(tmp_path):
  """Spike compensation and weight prediction keep all their state in the
  optax state: a checkpoint mid-flight resumes with identical losses (tiny
  RevNet, J = 5)."""
  from petra_jax.training import checkpoint
  c = _config("spike+weight_prediction")
  stages = tiny_revnet()
  J = len(stages)

  def build():
    pipe = pipeline.Pipeline(stages, compensation.stage_optimizers(c, 10, J), jax.devices()[:1],
                             accumulation_steps=2,
                             predictors=compensation.stage_predictors(c, 10, J))
    return pipe, pipe.init(0, random_batch()[0])

  batches = lambda m: random_batch(seed=m)  # noqa: E731
  pipe, state = build()
  table = pipe.schedule(24)
  state, _ = pipe.run(state, (table[t] for t in range(13)), batches)
  ckpt = checkpoint.Checkpointer(str(tmp_path), keep=1, fingerprint={})
  ckpt.save(1, state, extra={})
  ckpt.wait()
  _, expected = pipe.run(state, (table[t] for t in range(13, len(table))), batches)
  pipe2, template = build()
  _, restored, _, _ = ckpt.restore(template, pipe2.devices)
  _, got = pipe2.run(restored, (table[t] for t in range(13, len(table))), batches)
  assert len(got) == len(expected) > 10
  np.testing.assert_array_equal([float(o.loss) for o in got], [float(o.loss) for o in expected])
