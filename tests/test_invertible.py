"""Invertible downsampling (i-RevNet's psi) and the fixed-size RevNet.

Invariants: psi is a permutation; every stage between stem and head of the
``_inv`` models rebuilds its input; the reverse vjp of a psi stage is the vjp
of its forward (paper Eq. 5); chaining reverse vjps through a whole
revnet18_inv gives jax.grad of the composed model.
"""

import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from petra_jax.training import validation
from petra_jax import models

from petra_jax.models import invertible, summary
from helpers import random_variables as _random_variables
from petra_jax.engine.stages import stage as stage_lib


def _normal(seed, shape):
  return jnp.asarray(np.random.default_rng(seed).normal(size=shape), jnp.float32)


def _model_with_activations(name, batch=4, size=16, width=4):
  """Stages, per-stage variables and the activations ``[image, out_0, ...]``."""
  stages = models.build_model(name, width=width)
  acts, variables = [_normal(0, (batch, size, size, 3))], []
  for i, s in enumerate(stages):
    variables.append(_random_variables(s, acts[-1], i))
    acts.append(stage_lib.forward(s, variables[-1]["params"], variables[-1]["batch_stats"],
                                  acts[-1])[0])
  return stages, variables, acts


def _rel_err(a, b):
  la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
  num = sum(float(jnp.sum((u - v) ** 2)) for u, v in zip(la, lb))
  return (num / sum(float(jnp.sum(v ** 2)) for v in lb)) ** 0.5


# --- psi and the reshuffles -------------------------------------------------------


def test_space_to_depth_round_trips_bit_exactly():
  x = _normal(1, (3, 8, 6, 5))
  y = invertible.space_to_depth(x)
  assert y.shape == (3, 4, 3, 20)
  np.testing.assert_array_equal(invertible.depth_to_space(y), x)
  # The documented layout: out[b, i, j, (2 di + dj) C + c] = x[b, 2i + di, 2j + dj, c].
  for di in (0, 1):
    for dj in (0, 1):
      p = 2 * di + dj
      np.testing.assert_array_equal(y[..., p * 5:(p + 1) * 5], x[:, di::2, dj::2, :])


def test_space_to_depth_rejects_odd_sizes():
  with pytest.raises(ValueError, match="even"):
    invertible.space_to_depth(jnp.zeros((1, 5, 4, 2)))


@pytest.mark.parametrize("pre,carried", [
    (invertible.InvertibleDownsample(4, 8), 0),     # RevNet18: C -> 2C, half set aside
    (invertible.InvertibleDownsample(4, 16), 0),    # 4x growth: nothing set aside
    (invertible.InvertibleDownsample(8, 16), 1),    # with an earlier carried array
    (invertible.InjectivePad(4, 16), 1),            # RevNet50's stride-1 group
])
def test_reshuffle_is_an_isometry_whose_transpose_is_its_vjp(pre, carried):
  c = pre.in_channels
  x = (_normal(2, (2, 8, 8, c)), _normal(3, (2, 8, 8, c)),
       *[_normal(4, (2, 16, 16, 3))] * carried)
  y = pre.apply(x)
  assert y[0].shape[-1] == y[1].shape[-1] == pre.out_channels
  # Exact inverse on the image: P^T P x == x bit for bit.
  jax.tree.map(np.testing.assert_array_equal, pre.transpose(y), x)
  # P^T is P's vjp: compare with JAX's own transpose of the linear map.
  dy = jax.tree.map(lambda a: _normal(5, a.shape), y)
  (expected,) = jax.linear_transpose(pre.apply, x)(dy)
  jax.tree.map(np.testing.assert_array_equal, pre.transpose(dy), expected)
  # A permutation (psi) keeps the number of entries; the padding grows it.
  size = lambda t: sum(a.size for a in jax.tree.leaves(t))
  assert (size(y) == size(x)) == isinstance(pre, invertible.InvertibleDownsample)


# --- invertible-downsampling stages ---------------------------------------------


@pytest.mark.parametrize("name", ["revnet18_inv", "revnet34_inv", "revnet50_inv"])
def test_only_stem_and_head_are_not_reversible(name):
  base = models.build_model(name.removesuffix("_inv"), width=4)
  stages = models.build_model(name, width=4)
  assert [s.name for s in stages] == [s.name for s in base]
  assert [s.reversible for s in stages] == [False] + [True] * (len(stages) - 2) + [False]
  assert models.MODEL_SPECS[name].family == "revnet"
  assert sum(s.pre is not None for s in stages) == (4 if name == "revnet50_inv" else 3)


def test_revnet18_inv_keeps_revnet18_stream_shapes_and_every_entry():
  # CIFAR 32x32, width 64: the streams are RevNet18's; the halves set aside
  # are carried to the head, so every activation holds the stem's 2 x 64 x 32 x 32.
  inv = summary.summarize("revnet18_inv", "cifar10", 64)["stages"]
  ref = summary.summarize("revnet18", "cifar10", 64)["stages"]
  assert [r["output_shape"] for r in inv] == [r["output_shape"] for r in ref]
  assert inv[7]["carried_shapes"] == [[32, 32, 64], [16, 16, 128], [8, 8, 256]]
  for r in inv[:-1]:
    size = 2 * math.prod(r["output_shape"]) + sum(map(math.prod, r.get("carried_shapes", [])))
    assert size == 2 * 64 * 32 * 32, r


@pytest.mark.parametrize("name", ["revnet18_inv", "revnet50_inv"])
def test_invertible_downsampling_stages_rebuild_their_input(name):
  stages, variables, acts = _model_with_activations(name)
  checked = 0
  for j, s in enumerate(stages):
    if s.pre is None:
      continue
    v = variables[j]
    x_rec = stage_lib.inverse(s, v["params"], v["batch_stats"], acts[j + 1])
    # (x2 + F(x1)) - F(x1) in float32, psi^{-1} exact: a few ulps.
    chex.assert_trees_all_close(x_rec, acts[j], atol=1e-5, rtol=1e-5)
    assert float(jnp.abs(acts[j + 1][0] - s.pre.apply(acts[j])[0]).max()) > 0.1  # F not ~0
    checked += 1
  assert checked == (4 if name == "revnet50_inv" else 3)


@pytest.mark.parametrize("name,j", [("revnet18_inv", 3), ("revnet18_inv", 7),
                                    ("revnet50_inv", 1), ("revnet50_inv", 4)])
def test_reverse_vjp_of_psi_stage_is_vjp_of_forward(name, j):
  """Paper Eq. 5 read literally: x~ = F^{-1}(y), and the vjp of the stage's
  forward at x~ (here the true input) for the input and the parameters."""
  stages, variables, acts = _model_with_activations(name)
  s, v, x, y = stages[j], variables[j], acts[j], acts[j + 1]
  assert s.pre is not None
  dy = jax.tree.map(lambda a: _normal(7, a.shape), y)
  x_tilde, dx, dparams, _ = stage_lib.reverse_vjp(s, v["params"], v["batch_stats"], y, dy)
  _, vjp = jax.vjp(lambda p, x: stage_lib.forward(s, p, v["batch_stats"], x)[0],
                   v["params"], x)
  dparams_ref, dx_ref = vjp(dy)
  chex.assert_trees_all_close(x_tilde, x, atol=1e-5, rtol=1e-5)
  assert jax.tree.structure(dx) == jax.tree.structure(x)  # pulled back through psi
  assert _rel_err(dx, dx_ref) < 1e-4
  assert _rel_err(dparams, dparams_ref) < 1e-4


def test_revprop_through_revnet18_inv_equals_jax_grad():
  """Chain reverse_vjp from the last reversible stage down to the stem, as
  PETRA's backward does with no delay: every stage's gradient equals jax.grad
  of the composed model, and only the stem's input (the image) is buffered."""
  stages, variables, acts = _model_with_activations("revnet18_inv")
  labels = jnp.asarray([1, 3, 5, 7], jnp.int32)
  params = [v["params"] for v in variables]
  stats = [v["batch_stats"] for v in variables]
  grads_ref = jax.grad(lambda p: stage_lib.composed_loss(stages, p, stats, acts[0], labels)[0])(
      params)

  _, dy, g_head, _ = stage_lib.loss_vjp(stages[-1], params[-1], stats[-1], acts[-2], labels)
  grads = [None] * len(stages)
  grads[-1] = g_head
  y = acts[-2]  # the head's input: the only activation the backward starts from
  for j in range(len(stages) - 2, 0, -1):
    y, dy, grads[j], _ = stage_lib.reverse_vjp(stages[j], params[j], stats[j], y, dy)
  chex.assert_trees_all_close(y, acts[1], atol=1e-4, rtol=1e-4)  # the stem's output, rebuilt
  _, grads[0], _ = stage_lib.recompute_vjp(stages[0], params[0], stats[0], acts[0], dy,
                                           input_grad=False)
  # float32 round-off through 10 stages (measured ~1e-6); a real mistake is O(1).
  for j, (g, g_ref) in enumerate(zip(grads, grads_ref)):
    assert _rel_err(g, g_ref) < 1e-4, stages[j].name


def test_inv_model_needs_even_width():
  stages = models.build_model("revnet18_inv", width=3)  # builds: checked when traced
  with pytest.raises(ValueError, match="even model width"):
    stage_lib.trace(stages, jax.ShapeDtypeStruct((1, 16, 16, 3), jnp.float32))


# --- fixed-size RevNet -------------------------------------------------------------


def test_revnet_fixed_has_depth_reversible_blocks_and_runs():
  assert len(models.build_model("revnet_fixed", width=4)) == 20 + 2  # default depth
  assert models.MODEL_SPECS["revnet_fixed"].family == "revnet"
  stages = models.build_model("revnet_fixed", width=4, depth=3, num_classes=7)
  assert [s.reversible for s in stages] == [False, True, True, True, False]
  x = _normal(0, (2, 16, 16, 3))
  for i, s in enumerate(stages):
    v = _random_variables(s, x, i)
    x, _ = stage_lib.forward(s, v["params"], v["batch_stats"], x)
    if 0 < i < len(stages) - 1:
      assert [a.shape for a in x] == [(2, 16, 16, 4)] * 2  # constant width and resolution
  assert x.shape == (2, 7) and bool(jnp.isfinite(x).all())


def test_depth_only_for_fixed_size_models():
  with pytest.raises(ValueError, match="revnet_fixed"):
    models.build_model("revnet18", depth=4)
  with pytest.raises(ValueError, match="depth"):
    models.build_model("revnet_fixed", depth=0)


# --- training on the real data ----------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("name, extra", [  # revnet18_inv: long (its stages: the tests above)
    pytest.param("revnet18_inv", {}, marks=pytest.mark.long),
    ("revnet_fixed", {"model.depth": 3})])
def test_new_models_train_with_petra(cifar10_dir, tmp_path, name, extra):
  """Every middle stage of the invertible model reconstructs; loss finite and
  the reconstruction error recorded for each of them."""
  from petra_jax import train
  from petra_jax.training import metrics as metrics_lib
  from helpers import restored_test_metrics, tiny_config
  c = tiny_config(cifar10_dir, **{"model.name": name, "steps_per_epoch": 6,
                                  "reconstruction_error_every": 2, "checkpoint_every": 6,
                                  **extra})
  c.max_steps = 6
  result = train.train_and_evaluate(c, str(tmp_path))
  blocks = models.build_model(name, width=4, depth=extra.get("model.depth"))
  loss, accuracy = restored_test_metrics(c, tmp_path, blocks)  # independent eval forward
  assert result["test_accuracy"] == accuracy
  np.testing.assert_allclose(result["test_loss"], loss, rtol=1e-5)
  records = metrics_lib.read_metrics(str(tmp_path))
  assert all(np.isfinite(r["train_loss"]) for r in records if "train_loss" in r)
  assert all({"epoch", "learning_rate"} <= r.keys() for r in records if "train_loss" in r)
  stages = models.build_model(name, width=4, depth=extra.get("model.depth"))
  reversible = {j for j, s in enumerate(stages) if s.reversible}
  seen = {int(k.rsplit("_", 1)[1]) for r in records for k in r
          if k.startswith("reconstruction_error/")}
  assert seen == reversible and len(reversible) == len(stages) - 2


def test_depth_for_a_fixed_block_model_is_one_config_error():
  from petra_jax import config as config_lib
  c = config_lib.get_config()
  c.model.depth = 4
  with pytest.raises(validation.ConfigError, match="model.depth applies to"):
    validation.validate_config(c, 1)
