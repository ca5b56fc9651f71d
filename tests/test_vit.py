"""Reversible ViTs (petra_jax.models.vit) in the pipeline: the coupling's
inverse, exact gradients at zero delay for every method, and every method,
quantised messages and bfloat16 running with real delays."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from petra_jax.training import assembly
from petra_jax.engine.stages import partition
from helpers import (batches_of, composed_loss, config_file, random_batch, rel_err, run_ticks,
                     tiny_config, zero_delay_update_errors)
from petra_jax import models
from petra_jax.engine import methods
from petra_jax.engine import pipeline
from petra_jax.engine.arrays import quantize
from petra_jax.engine.stages import stage as stage_lib
from petra_jax.models import summary

PIPELINED = [m for m in methods.METHODS if m != "backprop"]


def tiny_revvit(name="revvit_tiny", depth=1):
  """stem, (attn, mlp) x depth, head: D = 3 heads x 2 = 6, patch 4 on 16 x 16."""
  return models.build_model(name, width=2, depth=depth)


def test_registry_sizes_and_stage_list():
  stages = tiny_revvit(depth=2)
  assert [s.name for s in stages] == ["stem", "layer0_attn", "layer0_mlp", "layer1_attn",
                                      "layer1_mlp", "head"]
  assert [s.reversible for s in stages] == [False, True, True, True, True, False]
  assert not any(s.reversible for s in tiny_revvit("vit_small", 2))
  assert models.MODEL_SPECS["revvit_small"].reversible
  assert not models.MODEL_SPECS["vit_tiny"].reversible
  # DeiT-Ti / DeiT-S widths at the defaults: 12 layers of 12 D^2 + 13 D weights.
  for name, d in (("revvit_tiny", 192), ("revvit_small", 384)):
    total = summary.summarize(name, "cifar10")["total_params"]
    per_layer = 12 * d * d + 13 * d
    stem = 48 * d + d + 64 * d
    head = 4 * d + 2 * d * 10 + 10
    assert total == 12 * per_layer + stem + head, name


def test_coupling_inverse_round_trip():
  """forward then inverse of the attention and MLP couplings rebuilds the input."""
  stages = tiny_revvit(depth=2)
  x, _ = random_batch()
  state = pipeline.Pipeline(stages, optax.sgd(0.1), jax.devices()[:1]).init(0, x)
  variables = [(s.params, s.batch_stats) for s in state.train_states]
  h = stage_lib.forward(stages[0], *variables[0], x)[0]
  body = stage_lib.group(stages[1:-1])
  params = {f"block_{i}": v[0] for i, v in enumerate(variables[1:-1])}
  stats = {f"block_{i}": v[1] for i, v in enumerate(variables[1:-1])}
  y = stage_lib.forward(body, params, stats, h)[0]
  # RevViT's layer, spelt out independently: Y1 = X1 + F(X2), Y2 = X2 + G(Y1),
  # with this project's stream order (X2, X1) in and (Y2, Y1) out.
  x2, x1 = h
  for i in range(2):
    f = stages[1 + 2 * i].module.apply({"params": variables[1 + 2 * i][0]}, x2)
    y1 = x1 + f
    y2 = x2 + stages[2 + 2 * i].module.apply({"params": variables[2 + 2 * i][0]}, y1)
    x1, x2 = y1, y2
  np.testing.assert_allclose(y[0], x2, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(y[1], x1, rtol=1e-5, atol=1e-5)
  back = stage_lib.inverse(body, params, stats, y)
  assert rel_err(back, h) < 1e-5


# The other methods at zero delay: test_methods (a RevNet); on a RevViT with real delays:
# test_reference_methods (its revvit rows). Here a reconstructing and a delayed one; the rest long.
@pytest.mark.parametrize("method", [
    m if m in ("revprop", "petra") else pytest.param(m, marks=pytest.mark.long) for m in PIPELINED])
def test_zero_delay_equals_jax_grad(method):
  """Drained after every micro-batch (every delay 0), each method's update on
  a RevViT is -lr * jax.grad of the composed model (helpers.composed_loss)."""
  errors = zero_delay_update_errors(tiny_revvit(), method)
  assert max(errors) < 1e-4, (method, errors)


def _losses(stages, method, formats=None, num_micro=4):
  """Per-micro-batch losses of ``num_micro`` micro-batches drained through
  the pipeline (SGD 0.05), and the initial parameters of each stage."""
  pipe = pipeline.Pipeline(stages, optax.sgd(LR), jax.devices()[:1], method=method,
                           formats=formats)
  state = pipe.init(0, random_batch()[0])
  init = [jax.tree.map(np.array, s.params) for s in state.train_states]
  state, out = run_ticks(pipe, state, num_micro, batches_of())
  assert state.in_flight() == 0
  return np.array([float(o.loss) for o in sorted(out)]), init


LR = 0.05
SYNCHRONOUS = tuple(n for n, m in methods.METHODS.items() if not m.delayed)  # no stale weight at k = 1


def _reference_losses(blocks, params, num_micro=4):
  """Sequential SGD on the composed model (helpers.composed_loss): the loss
  of micro-batch m at the weights after micro-batches 0 .. m-1."""
  out = []
  step = jax.jit(jax.value_and_grad(
      lambda p, x, y: composed_loss(blocks, p, [{}] * len(blocks), x, y)))
  for m in range(num_micro):
    loss, g = step(params, *batches_of()(m))
    out.append(float(loss))
    params = jax.tree.map(lambda p, d: p - LR * d, params, g)
  return np.array(out)


# Each method on a RevViT with real delays against the reference loop: test_reference_methods
# (its revvit rows). Here the stream and the vit_ twin; the rest long (CI time).
@pytest.mark.parametrize("method", [
    m if m in ("petra", "backprop") else pytest.param(m, marks=pytest.mark.long)
    for m in methods.METHODS])
def test_every_method_with_real_delays_against_sgd_on_the_composed_model(method):
  """3 stages of 2 blocks (stem+attn | mlp+attn | mlp+head), 4 micro-batches
  (backprop on the vit_ twin). The synchronous methods are sequential SGD
  on the composed model. In the stream, micro-batch 1 reaches the head
  (tick 3) after the head's update from micro-batch 0 (tick 2) and stages 0
  and 1 before theirs (ticks 4 and 3): its loss is the composed model's with
  only the head's two blocks stepped by micro-batch 0's gradient."""
  reversible = method != "backprop"
  blocks = tiny_revvit("revvit_tiny" if reversible else "vit_tiny", depth=2)
  stages = partition.group_stages(blocks, [2, 2, 2])
  assert [s.reversible for s in stages] == [False, reversible, False]
  losses, init = _losses(stages, method)
  flat = [group[f"block_{i}"] for group in init for i in range(2)]
  want = _reference_losses(blocks, flat)
  if method in SYNCHRONOUS:
    np.testing.assert_allclose(losses, want, rtol=1e-6)
    return
  x, y = batches_of()(0)
  g = jax.jit(jax.grad(lambda p: composed_loss(blocks, p, [{}] * 6, x, y)))(flat)
  stale = flat[:4] + [jax.tree.map(lambda p, d: p - LR * d, a, b) for a, b in zip(flat[4:], g[4:])]
  x1, y1 = batches_of()(1)
  stale_loss = float(jax.jit(lambda p: composed_loss(blocks, p, [{}] * 6, x1, y1))(stale))
  np.testing.assert_allclose(losses[:2], [want[0], stale_loss], rtol=1e-6)
  assert np.all(np.abs(losses[1:] / want[1:] - 1) > 1e-3)  # staler than SGD


def test_int8_messages_and_bfloat16_move_losses_by_their_measured_effect():
  # Measured on this model: int8 messages move the 4 losses by 0.01-0.11 %,
  # bfloat16 compute by 0.05-0.21 %; 0.5 % allows that and no more.
  blocks = tiny_revvit(depth=1)
  formats = quantize.MessageFormats("int8", "int8", "int8")
  q8 = _losses(blocks, "petra", formats)[0]
  bf16 = stage_lib.with_precision(blocks, stage_lib.Precision("bfloat16", "bfloat16"))
  half = _losses(bf16, "petra")[0]
  ref = _losses(blocks, "petra")[0]
  for losses in (q8, half):
    np.testing.assert_allclose(losses, ref, rtol=5e-3)
    assert np.max(np.abs(losses / ref - 1)) > 1e-5  # the format did apply


@pytest.mark.parametrize("overrides, message", [
    ({"model.name": "vit_tiny"}, "needs a reversible model.*revvit_small"),
    ({"model.name": "revvit_tiny", "model.reversible_backward": "fast"},
     "pareprop.*--config.model.reversible_backward"),
    ({"model.name": "revvit_tiny", "model.patch_size": -1}, "model.patch_size"),
])
def test_config_checks_name_the_fix(overrides, message):
  from petra_jax import config as config_lib  # pylint: disable=g-import-not-at-top
  from petra_jax.training import validation  # pylint: disable=g-import-not-at-top
  c = config_lib.get_config()
  for k, v in overrides.items():
    section, name = k.split(".")
    c[section][name] = v
  with pytest.raises(validation.ConfigError, match=message):
    validation.validate_config(c, 1)
  c.model.name, c.model.reversible_backward, c.model.patch_size = "revvit_tiny", "pareprop", 4
  validation.validate_config(c, 1)


def test_patch_size_must_divide_the_image():
  stages = models.build_model("revvit_tiny", width=2, depth=1, patch_size=5)
  with pytest.raises(ValueError, match="patch size dividing"):
    stage_lib.trace(stages, jax.ShapeDtypeStruct((1, 16, 16, 3), jnp.float32))


@pytest.mark.slow
@pytest.mark.long  # test_reshard's in-process regrouped restore covers the values
def test_train_checkpoint_and_reshard_on_real_cifar10(cifar10_dir, tmp_path):
  """The training CLI on a RevViT: 4 stages (one block each), a drained
  checkpoint at update 2, resumed regrouped into 2 stages with PaReprop's
  backward; the regrouped run's blocks start from the saved arrays and its
  losses stay finite."""
  from petra_jax import train  # pylint: disable=g-import-not-at-top
  from petra_jax.training import metrics as metrics_lib  # pylint: disable=g-import-not-at-top
  wd = str(tmp_path)
  base = {"model.name": "revvit_tiny", "model.width": 2, "model.depth": 1,
          "model.stage_sizes": (), "batch_size": 16, "accumulation_steps": 2,
          "steps_per_epoch": 4, "checkpoint_every": 2, "checkpoint_drain": True,
          "eval_every": 0, "reconstruction_error_every": 1, "optim.name": "adam",
          "optim.learning_rate": 1e-3}
  train.train_and_evaluate(tiny_config(cifar10_dir, **base), wd)
  records = metrics_lib.read_metrics(wd)
  assert any("reconstruction" in str(r) for r in records)
  c2 = tiny_config(cifar10_dir, **dict(base, **{"model.num_stages": 2, "num_epochs": 2,
                                                 "model.reversible_backward": "pareprop"}))
  run, _ = assembly.setup(c2, wd)
  assert run.restored_step == 4 and run.pipe.num_stages == 2
  run.checkpointer.close()
  train.train_and_evaluate(c2, wd)
  losses = {r["step"]: r["train_loss"] for r in metrics_lib.read_metrics(wd)
            if "train_loss" in r}
  assert sorted(losses) == list(range(1, 9)) and np.isfinite(list(losses.values())).all()


@pytest.mark.parametrize("variant", ["", "runlocal"])
def test_cpu_recipe_validates_and_has_its_documented_size(variant):
  from petra_jax.training import validation  # pylint: disable=g-import-not-at-top
  c = config_file("configs/cifar10_vit_cpu.py", *([variant] if variant else []))
  validation.validate_config(c, 1)
  if not variant:
    s = summary.summarize(c.model.name, "cifar10", c.model.width, c.model.depth,
                          c.model.tokenizer, c.model.patch_size)
    # D = 3 x 32 = 96, 16 tokens: the conv tokenizer 3->48->48->96 (3x3, no bias) and the
    # position embedding; per layer 12 D^2 + 13 D; the head on 2D = 192 features.
    stem = 9 * (3 * 48 + 48 * 48 + 48 * 96) + 16 * 96
    layer = 12 * 96 * 96 + 13 * 96
    head = 2 * 192 + 192 * 10 + 10
    assert s["total_params"] == stem + 4 * layer + head == 514714
    assert len(s["stages"]) == sum(c.model.stage_sizes)


def test_conv_tokenizer_is_cct_written_out():
  """CCT's tokenizer (conv 3x3, ReLU, 3x3/2 max-pool, twice for patch 4)
  against the same layers written with lax, and its parameter count."""
  stages = models.build_model("revvit_tiny", width=4, depth=1, tokenizer="conv")
  x, _ = random_batch()
  variables = stages[0].module.init(jax.random.PRNGKey(1), x)
  t1, t2 = stages[0].module.apply(variables, x)
  p = variables["params"]
  h = x
  for name in ("Conv_0", "Conv_1"):
    h = jax.lax.conv_general_dilated(h, p[name]["kernel"], (1, 1), "SAME",
                                     dimension_numbers=("NHWC", "HWIO", "NHWC"))
    h = jax.lax.reduce_window(jnp.maximum(h, 0), -jnp.inf, jax.lax.max, (1, 3, 3, 1),
                              (1, 2, 2, 1), "SAME")
  b, hh, ww, d = h.shape
  want = h.reshape(b, hh * ww, d) + p["pos_embed"]
  assert d == 12 and t1.shape == (b, (x.shape[1] // 4) * (x.shape[2] // 4), 12)
  np.testing.assert_allclose(t1, want, rtol=1e-5, atol=1e-5)
  assert t2 is t1  # RevViT's duplication into the two streams
  n = sum(a.size for a in jax.tree.leaves(p))
  hidden = 16  # max(16, 12 // 2)
  assert n == 9 * 3 * hidden + 9 * hidden * 12 + hh * ww * 12


def test_conv_tokenizer_zero_delay_equals_jax_grad():
  stages = models.build_model("revvit_tiny", width=2, depth=1, tokenizer="conv")
  errors = zero_delay_update_errors(stages, "petra")
  assert max(errors) < 1e-4, errors


@pytest.mark.parametrize("patch", [3, 6])
def test_conv_tokenizer_needs_a_power_of_two_patch(patch):
  stages = models.build_model("revvit_tiny", width=2, depth=1, patch_size=patch,
                              tokenizer="conv")
  with pytest.raises(ValueError, match="power-of-two patch.*model.patch_size"):
    stage_lib.trace(stages, jax.ShapeDtypeStruct((1, 12, 12, 3), jnp.float32))


def test_unknown_tokenizer_is_one_config_error():
  from petra_jax import config as config_lib  # pylint: disable=g-import-not-at-top
  from petra_jax.training import validation  # pylint: disable=g-import-not-at-top
  c = config_lib.get_config()
  c.model.name, c.model.tokenizer = "revvit_tiny", "cct"
  with pytest.raises(validation.ConfigError, match="tokenizer 'cct'.*model.tokenizer"):
    validation.validate_config(c, 1)
