"""PaReprop's backward (petra_jax.engine.reversible_backward) equals the vanilla
reversible backward and jax.vjp of the stage's forward, for RevNet and RevViT
stages of 1 to 4 blocks (odd depths included: the authors' parity bug)."""

import functools

import jax
import numpy as np
import optax
import pytest

from petra_jax.engine.stages import partition
from helpers import random_batch, random_variables, rel_err, run_ticks, batches_of
from petra_jax import models
from petra_jax.benchmarks import reversible_backward as bench
from petra_jax.engine import pipeline
from petra_jax.engine.stages import stage as stage_lib
from petra_jax.engine.stages.stage import Stage


def _stage_and_inputs(model, n):
  """A group of the model's first n reversible blocks, its variables, and
  (x, y, dy): the group's input, output and a random output cotangent."""
  if model == "revnet":
    blocks = models.build_model("revnet_fixed", width=2, depth=n)
  else:
    blocks = models.build_model("revvit_tiny", width=2, depth=(n + 1) // 2)
  images = random_batch()[0]
  v = random_variables(blocks[0], images, 0)
  x = stage_lib.forward(blocks[0], v["params"], v["batch_stats"], images)[0]
  rev = blocks[1:1 + n]
  params, stats, h = {}, {}, x
  for i, b in enumerate(rev):
    v = random_variables(b, h, 10 + i)
    params[f"block_{i}"], stats[f"block_{i}"] = v["params"], v["batch_stats"]
    h = stage_lib.forward(b, v["params"], v["batch_stats"], h)[0]
  rng = np.random.default_rng(n)
  dy = jax.tree.map(lambda a: rng.normal(size=a.shape).astype(np.float32), h)
  return tuple(rev), params, stats, x, h, dy


@pytest.mark.parametrize("model", ["revnet", "revvit"])
@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_pareprop_equals_vanilla_and_jax_vjp(model, n):
  blocks, params, stats, x, y, dy = _stage_and_inputs(model, n)
  vanilla = Stage("g", None, True, blocks)
  pareprop = Stage("g", None, True, blocks, reversible_backward="pareprop")
  ref_vjp = jax.vjp(lambda p, x: stage_lib.forward(vanilla, p, stats, x)[0], params, x)[1]
  ref_dparams, ref_dx = ref_vjp(dy)
  got = {}
  for name, stage in (("vanilla", vanilla), ("pareprop", pareprop)):
    fn = functools.partial(stage_lib.reverse_vjp, stage)
    got[name] = fn(params, stats, y, dy)
  for name, (x_tilde, dx, dparams, _) in got.items():
    assert rel_err(x_tilde, x) < 1e-5, (name, n)
    assert rel_err(dx, ref_dx) < 1e-4, (name, n)
    for i in range(n):  # every block, the last of odd depths included
      assert rel_err(dparams[f"block_{i}"], ref_dparams[f"block_{i}"]) < 1e-4, (name, n, i)
  # PaReprop against vanilla: the same operations, to float32 round-off.
  assert rel_err(got["pareprop"][2], got["vanilla"][2]) < 1e-5
  assert rel_err(got["pareprop"][1], got["vanilla"][1]) < 1e-5


def test_petra_losses_with_pareprop_equal_vanilla():
  """The config switch reaches the engine: PETRA on a grouped RevViT loses the
  same per micro-batch with either backward (float32 round-off)."""
  blocks = models.build_model("revvit_tiny", width=2, depth=2)
  losses = {}
  for name in stage_lib.REVERSIBLE_BACKWARDS:
    stages = partition.group_stages(
        stage_lib.with_reversible_backward(blocks, name), [1, 4, 1])
    assert stages[1].reversible_backward == name
    pipe = pipeline.Pipeline(stages, optax.sgd(0.05), jax.devices()[:1], method="petra")
    state = pipe.init(0, random_batch()[0])
    state, out = run_ticks(pipe, state, 6, batches_of())
    losses[name] = np.array([float(o.loss) for o in sorted(out)])
  np.testing.assert_allclose(losses["pareprop"], losses["vanilla"], rtol=1e-5)


def test_unknown_backward_and_non_group_are_refused():
  with pytest.raises(ValueError, match="model.reversible_backward"):
    stage_lib.with_reversible_backward([], "fast")
  block = models.build_model("revvit_tiny", width=2, depth=1)[1]
  with pytest.raises(ValueError, match="group of reversible blocks"):
    stage_lib.pareprop_vjp(block, {}, {}, None, None)


def test_benchmark_finds_the_reversible_run_and_reports_three_backwards():
  assert bench.reversible_run(models.build_model("revnet18", width=2)) == (1, 3)
  assert bench.reversible_run(models.build_model("revnet18_inv", width=2)) == (1, 9)
  stages = models.build_model("revvit_tiny", width=2, depth=1)
  assert bench.reversible_run(stages) == (1, 3)
  with pytest.raises(ValueError, match="no reversible block"):
    bench.reversible_run(models.build_model("vit_tiny", width=2, depth=1))
  r = bench.measure(stages, (16, 16, 3), batch_size=2, iters=1, warmup=0)
  assert r["blocks"] == ["layer0_attn", "layer0_mlp"]
  for key in ("images_per_s", "ms", "peak_bytes", "temp_bytes"):
    assert sorted(r[key]) == sorted(bench.BACKWARDS)
  assert all(v > 0 for v in r["images_per_s"].values())
