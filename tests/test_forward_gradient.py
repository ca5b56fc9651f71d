"""Forward gradients (Fournier et al., 2023): jvp tangents, the projected update,
emulation, the random-guess estimator, and option checks."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import helpers
from petra_jax import config as config_lib
from petra_jax.engine.methods import forward_gradient as fg
from petra_jax.engine.pipeline import Pipeline
from petra_jax.engine.stages import stage as stage_lib
from petra_jax.engine.stages.stage import Stage
from petra_jax.models import auxiliary
from petra_jax.training import validation
from helpers import (batches_of, composed_loss, random_batch, random_variables, rel_err,
                     run_ticks, tiny_revnet)


class Lin(nn.Module):
  """Dense + tanh per sample: no layer mixes samples."""
  features: int
  act: bool = True

  @nn.compact
  def __call__(self, x, train=True):
    x = nn.Dense(self.features)(x)
    return jnp.tanh(x) if self.act else x


def _dense_stages():
  return [Stage("a", Lin(6), False), Stage("b", Lin(5), False), Stage("head", Lin(10, False),
                                                                        False)]


def _small_revnet():
  """stem, rev, head: 3 stages with BatchNorm and a reversible coupling."""
  blocks = tiny_revnet()
  return [blocks[0], blocks[1], blocks[-1]]


def _init(stages, x, seed=0):
  vs, h = [], x
  for j, s in enumerate(stages):
    v = random_variables(s, h, seed + j)
    v = {"params": v["params"], "batch_stats": v.get("batch_stats", {})}
    vs.append(v)
    h = stage_lib.forward(s, v["params"], v["batch_stats"], h)[0]
  return [v["params"] for v in vs], [v["batch_stats"] for v in vs]


def _directional(stages, params, stats, x, labels, j, param_tangent=None, act_tangent=None):
  """s[b] along one tangent started at stage j, through the engine's functions."""
  run = jax.jit(lambda p, v, a: _scalars(stages, p, stats, x, labels, v, a))
  if act_tangent is None:
    return run(params, {j: param_tangent}, {})[0]
  return run(params, {}, {j: act_tangent})[0]


def _scalars(stages, params, stats, x, labels, param_tangents, act_tangents=None):
  """``[n, B]`` scalars of the tangents started at the stages of
  ``param_tangents`` (or ``act_tangents``), in stage order, pushed through
  every later stage as the pipeline does."""
  act_tangents = act_tangents or {}
  h, tangents = x, None
  for i, (s, p, bs) in enumerate(zip(stages[:-1], params, stats)):
    y, _, pushed, own = fg.push(s, p, bs, h, tangents, param_tangents.get(i))
    if i in act_tangents:
      own = act_tangents[i]
    tangents = pushed if own is None else fg.stack(pushed, own)
    h = y
  return fg.loss_scalars(stages[-1], params[-1], stats[-1], h, labels, tangents)


def test_directional_derivatives_equal_grad_dot_tangent():
  """All stages' weight tangents at once (stacked as in the stream): row j
  of the scalars averages to <dL/dtheta_j, v_j>."""
  stages = tiny_revnet()
  x, labels = random_batch()
  params, stats = _init(stages, x)
  grads = jax.jit(jax.grad(lambda p: composed_loss(stages, p, stats, x, labels)))(params)
  rng = np.random.default_rng(1)
  vs = {j: jax.tree.map(lambda a: jnp.asarray(rng.normal(size=a.shape), jnp.float32), params[j])
        for j in range(len(stages) - 1)}
  s = jax.jit(lambda p, v: _scalars(stages, p, stats, x, labels, v))(params, vs)
  assert s.shape == (len(stages) - 1, x.shape[0])
  for j, v in vs.items():
    ref = sum(float(jnp.vdot(a, b)) for a, b in zip(jax.tree.leaves(grads[j]),
                                                     jax.tree.leaves(v)))
    assert abs(float(jnp.mean(s[j])) - ref) <= 1e-4 * max(1.0, abs(ref)), j


def test_activity_directional_derivative_per_sample_without_mixing():
  stages = _dense_stages()
  x = jnp.asarray(np.random.default_rng(0).normal(size=(8, 4)), jnp.float32)
  labels = jnp.arange(8) % 10
  params, stats = _init(stages, x)
  y0 = stage_lib.forward(stages[0], params[0], {}, x)[0]
  dy = jax.grad(lambda y: composed_loss(stages[1:], params[1:], stats[1:], y, labels))(y0)
  v = jnp.asarray(np.random.default_rng(2).normal(size=y0.shape), jnp.float32)
  s = _directional(stages, params, stats, x, labels, 0, act_tangent=v)
  # per sample: s[b] / B = <dL/dy[b], v[b]>
  np.testing.assert_allclose(s / 8, jnp.sum(dy * v, axis=1), rtol=1e-5, atol=1e-7)
  em, _ = fg.emulated_scalars(stages[0], params[0], {}, x, dy, v, "activity")
  np.testing.assert_allclose(em, s, rtol=1e-5, atol=1e-6)


def test_update_with_the_true_gradient_as_guess_is_sgd():
  stages = _small_revnet()
  x, labels = random_batch()
  params, stats = _init(stages, x)
  grads = helpers.composed_grad(stages, params, stats, x, labels)
  j = 1
  s = _directional(stages, params, stats, x, labels, j, param_tangent=grads[j])
  est = fg.estimate(stages[j], params[j], stats[j], None, grads[j], s, "weights", 0.0)
  assert rel_err(est, grads[j]) < 1e-4


@pytest.mark.parametrize("guess", ["true", "random"])
def test_batch_projection_through_batchnorm(guess):
  """Activity perturbation, projection='batch', through train-mode BatchNorm
  (samples mix): with the true dL/dy_1 as the guess the update is the exact
  gradient of stage 1 (jax.grad of the composed model); with a random guess
  it is the vjp along <dL/dy, v> / ||v||^2 v, written out."""
  stages = _small_revnet()
  x, labels = random_batch()
  params, stats = _init(stages, x)
  grads = helpers.composed_grad(stages, params, stats, x, labels)
  j = 1
  h = stage_lib.forward(stages[0], params[0], stats[0], x)[0]
  y, vjp = jax.vjp(lambda p: stage_lib.forward(stages[j], p, stats[j], h)[0], params[j])
  dy = jax.grad(lambda y: composed_loss(stages[2:], params[2:], stats[2:], y, labels))(y)
  v = dy if guess == "true" else jax.tree.map(
      lambda a: jnp.asarray(np.random.default_rng(3).normal(size=a.shape), jnp.float32), dy)
  s = _directional(stages, params, stats, x, labels, j, act_tangent=v)
  est = fg.estimate(stages[j], params[j], stats[j], h, v, s, "activity", 0.0, "batch")
  dot = sum(jnp.vdot(a, b) for a, b in zip(jax.tree.leaves(dy), jax.tree.leaves(v)))
  norm2 = sum(jnp.vdot(a, a) for a in jax.tree.leaves(v))
  want = vjp(jax.tree.map(lambda a: dot / norm2 * a, v))[0]
  assert rel_err(est, want) < 1e-4
  if guess == "true":
    assert rel_err(est, grads[j]) < 1e-4


def _fg_pipe(stages, emulate, perturb):
  options = fg.Options(guess="local", perturb=perturb, emulate=emulate, eps=1e-16, seed=0)
  return Pipeline(stages, optax.sgd(0.5), jax.devices()[:1], method="forward_gradient",
                  forward_gradient=options)


@pytest.mark.parametrize("perturb", ["weights", "activity"])
def test_real_and_emulated_updates_agree_without_delay(perturb):
  """One micro-batch through the pipeline (nothing delayed): the update from
  forward-mode scalars equals the one from backprop's (emulate=True)."""
  stages = auxiliary.with_heads(_dense_stages(), "linear", 10)
  x = jnp.asarray(np.random.default_rng(0).normal(size=(8, 4)), jnp.float32)
  y = jnp.arange(8) % 10
  after = []
  for emulate in (False, True):
    pipe = _fg_pipe(stages, emulate, perturb)
    state = pipe.init(0, x)
    before = [jax.tree.map(jnp.copy, s.params) for s in state.train_states]
    state, _ = helpers.drained_step(pipe, state, x, y)
    after.append(jax.tree.map(lambda b, a: b - a, before,
                              [s.params for s in state.train_states]))
    assert not state.in_flight()
  for j in range(len(stages)):
    assert rel_err(after[0][j], after[1][j]) < 1e-4, j
  assert any(float(jnp.abs(a).max()) > 0 for a in jax.tree.leaves(after[0][0]))


def test_random_guess_is_unbiased_up_to_scale():
  """E[<g, v> v / ||v||^2] = g / n for v ~ N(0, I_n); 20000 draws give the
  mean within about sqrt(n / N) ~ 3 % of g / n (n = 30 parameters):
  tolerance 10 % on the scale, cosine > 0.99."""
  stages = [Stage("a", Lin(6), False), Stage("head", Lin(10, False), False)]
  x = jnp.asarray(np.random.default_rng(0).normal(size=(8, 4)), jnp.float32)
  labels = jnp.arange(8) % 10
  params, stats = _init(stages, x)
  g = jax.grad(lambda p: composed_loss(stages, [p, params[1]], stats, x, labels))(params[0])

  def one(key):
    v = fg.random_guess(key, params[0])
    s = _directional(stages, params, stats, x, labels, 0, param_tangent=v)
    return fg.estimate(stages[0], params[0], {}, None, v, s, "weights", 0.0)

  draws = jax.vmap(one)(jax.random.split(jax.random.key(0), 20000))
  mean = jnp.concatenate([a.mean(0).ravel() for a in jax.tree.leaves(draws)])
  ref = jnp.concatenate([a.ravel() for a in jax.tree.leaves(g)])
  n = ref.size
  cos = float(jnp.vdot(mean, ref) / jnp.linalg.norm(mean) / jnp.linalg.norm(ref))
  scale = float(jnp.vdot(mean, ref) / jnp.vdot(ref, ref)) * n
  assert cos > 0.99 and abs(scale - 1) < 0.1, (cos, scale)


def test_bad_options_are_one_clear_error():
  with pytest.raises(ValueError, match=r"guess='oracle'.*perturb='both'.*--config"):
    fg.check_options("oracle", "both", False, 1e-16)
  with pytest.raises(ValueError, match=r"projection='each'.*'batch', 'sample'"):
    fg.check_options("local", "activity", False, 1e-16, "each")
  config = config_lib.get_config()
  config.method = "forward_gradient"
  config.forward_gradient.perturb = "neurons"
  with pytest.raises(validation.ConfigError, match="perturb='neurons'.*activity"):
    validation.validate_config(config, 1)
  for method, field, value, match in (
      ("forward_gradient", "quantize.forward", "int8", "quantised.*--config.quantize.forward=none"),
      ("local", "grad_quality_every", 5, "--config.grad_quality_every=0"),
      ("petra", "forward_gradient.guess", "random",
       "does not read config.forward_gradient.*--config.method=forward_gradient"),
      ("backprop", "auxiliary.head", "cnn", "drop --config.auxiliary.head"),
      ("forward_gradient", "auxiliary.hidden", 8, "forward_gradient.guess=local")):
    config = config_lib.get_config()
    config.method = method
    *path, last = field.split(".")
    target = config[path[0]] if path else config
    target[last] = value
    if field == "auxiliary.hidden":
      config.forward_gradient.guess = "random"
    with pytest.raises(validation.ConfigError, match=match):
      validation.validate_config(config, 1)
  with pytest.raises(ValueError, match="guess="):
    fg.Options(guess="x")


def test_stream_sends_one_scalar_per_sample_per_upstream_stage():
  """In the stream, the last stage sends float32[J-1, B] back; stage j
  passes rows 0..j-1 on; each stage keeps tau_j guesses and inputs."""
  stages = _small_revnet()
  J = len(stages)
  pipe = Pipeline(stages, optax.sgd(0.1), jax.devices()[:1], method="forward_gradient",
                  forward_gradient=fg.Options(guess="random", perturb="activity"))
  x, _ = random_batch()
  state = pipe.init(0, x)
  state, outs = run_ticks(pipe, state, 3 * J, batches_of(), num_ticks=J)
  assert [o.micro_batch for o in outs] == [0]
  (message,) = state.grad_inbox[J - 2].values()
  assert message.shape == (J - 1, x.shape[0]) and message.dtype == jnp.float32
  table = pipe.schedule(3 * J)
  state, _ = pipe.run(state, (table[t] for t in range(J, 2 * J)), batches_of())
  for j in range(J - 1):  # tau_j micro-batches in flight at stage j
    assert len(state.weight_stash[j]) == len(state.buffers[j]) == 2 * (J - 1 - j)
