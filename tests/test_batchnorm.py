"""The closed-form BatchNorm (petra_jax.models.batchnorm) against Flax's BatchNorm.

Values, gradients and running statistics must agree with autodiff of
``flax.linen.BatchNorm`` (momentum 0.9, eps 1e-5, as the models use it) to
float32 round-off, and the channel sums with a float64 sum.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from petra_jax.models import batchnorm

SHAPES = [(8, 6, 6, 5), (4, 3, 5, 16)]


def _variables(c, key=1):
  k1, k2, k3, k4 = jax.random.split(jax.random.key(key), 4)
  return {"params": {"scale": 1 + 0.5 * jax.random.normal(k1, (c,)),
                     "bias": jax.random.normal(k2, (c,))},
          "batch_stats": {"mean": jax.random.normal(k3, (c,)),
                          "var": 1 + jax.random.uniform(k4, (c,))}}


def _run(module, variables, x, w, relu_after, train=True):
  """Loss ``sum(w * act(module(x)))``, its gradient (params, x), output and stats."""
  def loss(params, x):
    v = {"params": params, "batch_stats": variables["batch_stats"]}
    if train:
      y, mutated = module.apply(v, x, use_running_average=False, mutable=["batch_stats"])
      stats = mutated["batch_stats"]
    else:
      y, stats = module.apply(v, x, use_running_average=True), variables["batch_stats"]
    y = nn.relu(y) if relu_after else y
    return (y.astype(jnp.float32) * w).sum(), (y, stats)
  return jax.grad(loss, argnums=(0, 1), has_aux=True)(variables["params"], x)


def _assert_close(a, b, rtol=2e-5):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  np.testing.assert_allclose(a, b, rtol=rtol, atol=rtol * max(1.0, np.abs(b).max()))


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("relu", [False, True])
@pytest.mark.parametrize("train", [True, False])
def test_matches_flax(shape, relu, train):
  x = 3 * jax.random.normal(jax.random.key(0), shape) + 1
  w = jax.random.normal(jax.random.key(2), shape)
  v = _variables(shape[-1])
  ref = _run(nn.BatchNorm(momentum=0.9, epsilon=1e-5), v, x, w, relu, train)
  new = _run(batchnorm.BatchNorm(momentum=0.9, epsilon=1e-5, relu=relu), v, x, w, False, train)
  assert jax.tree.structure(ref) == jax.tree.structure(new)
  for a, b in zip(jax.tree.leaves(new), jax.tree.leaves(ref)):
    assert a.shape == b.shape and a.dtype == b.dtype
    _assert_close(a, b)


def test_same_variables_as_flax():
  """Same names, shapes, dtypes and initial values: checkpoints interchange."""
  x = jnp.ones((2, 4, 4, 6))
  ref = nn.BatchNorm(use_running_average=False).init(jax.random.key(0), x)
  new = batchnorm.BatchNorm(use_running_average=False).init(jax.random.key(0), x)
  assert jax.tree.structure(ref) == jax.tree.structure(new)
  for a, b in zip(jax.tree.leaves(new), jax.tree.leaves(ref)):
    np.testing.assert_array_equal(a, b)
    assert a.dtype == b.dtype


def test_bfloat16_input_keeps_dtype_and_float32_stats():
  x = jax.random.normal(jax.random.key(0), (4, 5, 5, 8)).astype(jnp.bfloat16)
  v = _variables(8)
  params = jax.tree.map(lambda a: a.astype(jnp.bfloat16), v["params"])
  bf = {"params": params, "batch_stats": v["batch_stats"]}
  w = jnp.ones(x.shape)
  ref = _run(nn.BatchNorm(momentum=0.9, epsilon=1e-5), bf, x, w, True)
  new = _run(batchnorm.BatchNorm(momentum=0.9, epsilon=1e-5, relu=True), bf, x, w, False)
  for a, b in zip(jax.tree.leaves(new), jax.tree.leaves(ref)):
    assert a.dtype == b.dtype
    _assert_close(a.astype(jnp.float32), b.astype(jnp.float32), rtol=2e-2)


def _reference_batch_norm(x, scale, bias, eps=1e-5):
  mean = x.mean((0, 1, 2))
  var = jnp.maximum(0.0, (x * x).mean((0, 1, 2)) - mean**2)
  return (x - mean) * (jax.lax.rsqrt(var + eps) * scale) + bias, mean, var


def test_gradient_through_returned_statistics():
  """Cotangents on the returned mean and var (unused by the models) are exact too."""
  x = jax.random.normal(jax.random.key(0), (4, 3, 3, 6)) + 2
  v = _variables(6)["params"]
  wm, wv = jnp.arange(6.0), jnp.linspace(-1, 1, 6)
  wy = jax.random.normal(jax.random.key(3), x.shape)

  def loss(f):
    def inner(x, scale, bias):
      y, mean, var = f(x, scale, bias)
      return (wy * y).sum() + (wm * mean).sum() + (wv * var).sum()
    return jax.grad(inner, argnums=(0, 1, 2))(x, v["scale"], v["bias"])
  for a, b in zip(loss(batchnorm.batch_norm), loss(_reference_batch_norm)):
    _assert_close(a, b)


@pytest.mark.parametrize("n", [64 * 9, 7])
def test_channel_sums_of_several_arrays_match_float64(n):
  a, b, c = (jax.random.normal(jax.random.key(i), (n, 2, 12)) * (i + 1) + i for i in range(3))
  sums = batchnorm.channel_sums(a, b, c)
  assert len(sums) == 3
  for got, arr in zip(sums, (a, b, c)):
    _assert_close(got, np.asarray(arr, np.float64).sum((0, 1)), rtol=1e-6)
  with pytest.raises(ValueError, match="one shape"):
    batchnorm.channel_sums(a, a[:1])


def test_revnet_loss_and_gradient_as_with_flax_batchnorm():
  """A tiny RevNet18 (ReLUs fused into conv_bn) against the same with Flax's layer."""
  from petra_jax.benchmarks import cli, profile_step
  from petra_jax.engine.stages import stage as stage_lib
  from helpers import jitted
  x = jax.random.normal(jax.random.key(0), (4, 8, 8, 3))
  labels = jnp.arange(4) % 10

  def loss_and_grad(layer, rename):
    with profile_step.batchnorm_layer(layer):
      stages = cli.build("revnet18", "cifar10", 2)
      if rename:
        variables = [_rename_all(v, "BatchNorm_", "FlaxBatchNorm_") for v in fast_vars]
      else:
        variables, a = [], x
        for j, s in enumerate(stages):
          variables.append(s.init(jax.random.key(j), a))
          a = jitted(stage_lib.forward, s)(
              variables[-1]["params"], variables[-1]["batch_stats"], a)[0]
      params = [v["params"] for v in variables]
      stats = [v["batch_stats"] for v in variables]
      fn = lambda p: stage_lib.composed_loss(stages, p, stats, x, labels)  # noqa: E731
      return variables, jax.jit(jax.value_and_grad(fn, has_aux=True))(params)
  fast_vars, fast = loss_and_grad("fast", False)
  _, ref = loss_and_grad("flax", True)
  for a, b in zip(jax.tree.leaves(fast), jax.tree.leaves(_rename_all(ref))):
    _assert_close(a, b, rtol=5e-5)


def _rename_all(tree, old="FlaxBatchNorm_", new="BatchNorm_"):
  """Module names ``old`` -> ``new`` in nested dicts, lists and tuples."""
  if isinstance(tree, dict):
    return {k.replace(old, new): _rename_all(v, old, new) for k, v in tree.items()}
  if isinstance(tree, (list, tuple)):
    return type(tree)(_rename_all(v, old, new) for v in tree)
  return tree
