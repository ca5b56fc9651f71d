"""Model zoo: Table 2 parameter counts, stage splits, shapes, inverses, CLI."""

import functools
import json
import pathlib
import subprocess
import sys

import chex
import jax
import jax.numpy as jnp
import pytest

from petra_jax import models
from petra_jax.models import summary
from petra_jax.engine.stages import stage as stage_lib
from helpers import random_variables as _random_variables

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
REVNETS = ("revnet18", "revnet34", "revnet50")

# Paper Table 2 ("Param. count" column, ImageNet heads: 1000 classes, 224x224).
TABLE2_PARAMS = {
    "resnet18": 11.7e6, "revnet18": 12.2e6,
    "resnet34": 21.8e6, "revnet34": 22.3e6,
    "resnet50": 25.6e6, "revnet50": 30.4e6,
}
# torchvision's exact counts (resnet18/34/50 with the default 1000-class head).
TORCHVISION_PARAMS = {"resnet18": 11_689_512, "resnet34": 21_797_672,
                      "resnet50": 25_557_032}


# Tracing a model takes ~0.5 s: each (name, dataset, width) is traced once.
_summarize = functools.lru_cache(summary.summarize)


@pytest.mark.parametrize("name", sorted(TABLE2_PARAMS))
def test_imagenet_param_count_matches_table2(name):
  total = _summarize(name, "imagenet", 64)["total_params"]
  assert abs(total - TABLE2_PARAMS[name]) <= 0.02 * TABLE2_PARAMS[name], total
  if name in TORCHVISION_PARAMS:
    assert total == TORCHVISION_PARAMS[name]


def test_revnet18_param_count_matches_reference_without_biases():
  # The authors' count (11,185,802 on CIFAR-10) includes conv biases, which
  # petra_jax drops (a BN follows each conv): stem 128 + group 0 2 * 2 * 64 +
  # groups 1-3 (3 convs in the downsample, 2 in the rev block) 5 * (128 + 256 +
  # 512) = 4,864 biases.
  total = _summarize("revnet18", "cifar10", 64)["total_params"]
  assert total == 11_185_802 - 4_864


@pytest.mark.parametrize("name,n_stages", [
    ("resnet18", 10), ("revnet18", 10), ("resnet34", 18), ("revnet34", 18),
    ("resnet50", 18), ("revnet50", 18)])
def test_stage_counts_and_kinds(name, n_stages):
  stages = models.build_model(name, width=4)
  assert len(stages) == n_stages
  assert not stages[0].reversible and not stages[-1].reversible
  # Reversible = blocks - downsampling blocks (3 in the basic RevNets, one per
  # group in RevNet50); none in a ResNet.
  n_rev = sum(s.reversible for s in stages)
  assert n_rev == {"revnet18": 5, "revnet34": 13, "revnet50": 12}.get(name, 0)
  assert stage_lib.has_reversible(stages) == (n_rev > 0)
  # The family the trainer reads (PETRA needs "revnet") is the built model's.
  assert models.MODEL_SPECS[name].family == ("revnet" if n_rev else "resnet")


def test_revnet18_cifar10_shapes_match_reference_table():
  # Reference notes, "Stage split of RevNet18": output per stream (C x H x W).
  expected = [(64, 32), (64, 32), (64, 32), (128, 16), (128, 16), (256, 8),
              (256, 8), (512, 4), (512, 4)]
  kinds = ["non-reversible", "reversible", "reversible", "non-reversible",
           "reversible", "non-reversible", "reversible", "non-reversible",
           "reversible", "non-reversible"]
  rows = _summarize("revnet18", "cifar10", 64)["stages"]
  assert [r["output_shape"] for r in rows[:-1]] == [[h, h, c] for c, h in expected]
  assert rows[-1]["output_shape"] == [10]
  assert [r["kind"] for r in rows] == kinds
  assert [r["index"] for r in rows] == list(range(10))


@pytest.mark.parametrize("name,dataset,size,classes", [
    ("resnet50", "cifar100", 32, 100), ("revnet50", "imagenet32", 32, 1000),
    ("resnet50", "imagenet", 56, 1000), ("revnet50", "imagenet", 56, 1000)])
def test_dataset_fixes_stem_and_classes(name, dataset, size, classes):
  rows = _summarize(name, dataset, 4)["stages"]
  assert rows[0]["output_shape"] == [size, size, 4]
  assert rows[-2]["output_shape"] == [size // 8, size // 8, 4 * 8 * 4]
  assert rows[-1]["output_shape"] == [classes]


def _chain_variables(stages, x):
  """helpers.random_variables of each stage for the input ``x``, the
  activations' shapes traced (nothing is compiled)."""
  variables, h = [], jax.ShapeDtypeStruct(x.shape, x.dtype)
  for i, s in enumerate(stages):
    variables.append(_random_variables(s, h, i))
    h = jax.eval_shape(lambda v, h, s=s: stage_lib.forward(s, v["params"], v["batch_stats"], h)[0],
                       variables[-1], h)
  return variables


@pytest.mark.parametrize("name", REVNETS)
def test_every_reversible_stage_round_trips(name):
  stages = models.build_model(name, width=4)
  x = jax.random.normal(jax.random.key(0), (4, 16, 16, 3))
  for i, s in enumerate(stages[:-1]):
    v = _random_variables(s, x, i)
    y, _ = stage_lib.forward(s, v["params"], v["batch_stats"], x)
    if s.reversible:
      x_rec = stage_lib.inverse(s, v["params"], v["batch_stats"], y)
      chex.assert_trees_all_close(x_rec, x, atol=1e-5, rtol=1e-5)
      assert float(jnp.abs(y[0] - x[0]).max()) > 0.1  # not vacuous
    else:
      with pytest.raises(ValueError, match="not reversible"):
        stage_lib.inverse(s, v["params"], v["batch_stats"], y)
    x = y


def test_resnet50_forward_gives_logits():
  # One real forward, jitted as one program (eval_shape already traces every
  # model in the tests above; eager, each op would compile on its own).
  stages = models.build_model("resnet50", width=4, num_classes=7)
  x = jax.random.normal(jax.random.key(0), (2, 16, 16, 3))

  @jax.jit
  def run(variables, x):
    for s, v in zip(stages, variables):
      x, _ = stage_lib.forward(s, v["params"], v["batch_stats"], x)
    return x

  x = run(_chain_variables(stages, x), x)
  assert x.shape == (2, 7)
  assert bool(jnp.isfinite(x).all())


def test_build_model_unknown_name_names_the_choices_and_the_flag():
  with pytest.raises(ValueError) as e:
    models.build_model("revnet152")
  msg = str(e.value)
  assert "'revnet152'" in msg and "--config.model.name" in msg and "MODULE:FUNCTION" in msg
  assert all(name in msg for name in REVNETS + ("resnet18", "resnet34", "resnet50"))


def test_importing_models_leaves_data_out():
  # Only the CLI (models.summary) reads the data registry; the trainer's and
  # benchmarks' `import models` must not pull the data pipeline (PIL, tfds).
  code = ("import sys; import petra_jax.models; "
          "print(sorted(m for m in ('petra_jax.data', 'PIL', 'tensorflow_datasets') "
          "if m in sys.modules))")
  out = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True,
                       text=True, timeout=120)
  assert out.returncode == 0, out.stderr
  assert out.stdout.strip() == "[]"


def _cli(*args):
  return subprocess.run([sys.executable, "-m", "petra_jax.models", *args],
                        cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)


def revnet18_cifar_params_by_hand(w, classes):
  """Trainable parameters of each RevNet18 stage on 32x32 images, by hand.

  Convs have no bias; each conv is followed by a BN (scale and bias, 2 per
  channel). Stem: conv3x3 3 -> 2w. Group 0: two reversible F's, each two
  conv3x3 w -> w. Groups g = 1..3 (c = w 2**g channels, c/2 in): a
  downsampling block (conv3x3 c/2 -> c, conv3x3 c -> c, conv1x1 c/2 -> c)
  and one reversible F (two conv3x3 c -> c). Head: Dense 2 * 8w -> classes.
  """
  def conv_bn(k, c_in, c_out):
    return k * k * c_in * c_out + 2 * c_out

  rev = lambda c: 2 * conv_bn(3, c, c)  # noqa: E731
  counts = [conv_bn(3, 3, 2 * w), rev(w), rev(w)]
  for g in (1, 2, 3):
    c = w * 2**g
    counts += [conv_bn(3, c // 2, c) + conv_bn(3, c, c) + conv_bn(1, c // 2, c), rev(c)]
  return counts + [2 * 8 * w * classes + classes]


def test_revnet18_hand_count_matches_reference_at_width_64():
  # The hand count agrees with the authors' total (see above) at width 64.
  assert sum(revnet18_cifar_params_by_hand(64, 10)) == 11_185_802 - 4_864


def test_cli_json_gives_stage_params_and_shapes_by_hand():
  # Width and classes other than the CLI's defaults (64, cifar10's 10), so
  # that a flag the CLI dropped would show.
  w, classes = 4, 100
  out = _cli("revnet18", "--dataset=cifar100", f"--width={w}", "--json")
  assert out.returncode == 0, out.stderr
  got = json.loads(out.stdout)
  assert got == _summarize("revnet18", "cifar100", w)
  want = revnet18_cifar_params_by_hand(w, classes)
  assert [r["params"] for r in got["stages"]] == want
  assert got["total_params"] == sum(want)
  shapes = [[32, 32, w]] * 3 + [[32 >> g, 32 >> g, w << g] for g in (1, 2, 3) for _ in (0, 1)]
  assert [r["output_shape"] for r in got["stages"]] == shapes + [[classes]]
  assert [r["index"] for r in got["stages"]] == list(range(10))
  rev = {1, 2, 4, 6, 8}
  assert [r["kind"] for r in got["stages"]] == [
      "reversible" if i in rev else "non-reversible" for i in range(10)]


def test_cli_unknown_model():
  out = _cli("revnet152", "--dataset=cifar10")
  assert out.returncode == 2
  assert "Traceback" not in out.stderr
  lines = out.stderr.strip().splitlines()
  assert len(lines) == 1 and "revnet152" in lines[0]
  assert all(name in lines[0] for name in models.MODEL_SPECS)


def test_resnet101_matches_torchvision():
  # torchvision.models.resnet101(): 44,549,160 parameters (1000-class head).
  assert _summarize("resnet101", "imagenet", 64)["total_params"] == 44_549_160


def bottleneck_revnet_imagenet_params_by_hand(blocks, w=64, classes=1000):
  """Trainable parameters of each stage of a bottleneck RevNet on 224x224, by hand.

  Convs have no bias; each is followed by a BN (2 per channel). Stem: conv7x7
  3 -> 2w. Group g (hidden h = w 2**g, streams of c = 4h channels, c_in the
  previous group's, w for g = 0): a downsampling block, F = conv1x1 c_in -> h,
  conv3x3 h -> h, conv1x1 h -> c, plus a conv1x1 c_in -> c on each stream; then
  blocks[g] - 1 reversible F's (conv1x1 c -> h, conv3x3 h -> h, conv1x1 h -> c).
  Head: Dense 2 * 32w -> classes.
  """
  def conv_bn(k, c_in, c_out):
    return k * k * c_in * c_out + 2 * c_out

  f = lambda c_in, h, c: conv_bn(1, c_in, h) + conv_bn(3, h, h) + conv_bn(1, h, c)  # noqa: E731
  counts, c_in = [conv_bn(7, 3, 2 * w)], w
  for g, n in enumerate(blocks):
    h = w * 2**g
    c = 4 * h
    counts += [f(c_in, h, c) + 2 * conv_bn(1, c_in, c)] + [f(c, h, c)] * (n - 1)
    c_in = c
  return counts + [2 * c_in * classes + classes]


def test_revnet101_imagenet_params_by_hand():
  # At w = 64: stem 7*7*3*128 + 256 = 19,072. Group 0 (h 64, c 256, c_in 64):
  # down (4,096 + 128) + (36,864 + 128) + (16,384 + 512) + 2 (16,384 + 512) = 91,904,
  # rev F (16,384 + 128) + (36,864 + 128) + (16,384 + 512) = 70,400, twice.
  # Group 1 (h 128, c 512): down 511,488, rev 280,064 x 3. Group 2 (h 256,
  # c 1024): down 2,038,784, rev 1,117,184 x 22. Group 3 (h 512, c 2048): down
  # 8,140,800, rev 4,462,592 x 2. Head 4096 * 1000 + 1000 = 4,097,000.
  # Total 19,072 + 91,904 + 140,800 + 511,488 + 840,192 + 2,038,784 + 24,578,048
  # + 8,140,800 + 8,925,184 + 4,097,000 = 49,383,272.
  got = _summarize("revnet101", "imagenet", 64)
  want = bottleneck_revnet_imagenet_params_by_hand((3, 4, 23, 3))
  assert want[:5] == [19_072, 91_904, 70_400, 70_400, 511_488]
  assert [r["params"] for r in got["stages"]] == want
  assert got["total_params"] == sum(want) == 49_383_272
  assert len(got["stages"]) == 35
  # The same arithmetic gives RevNet50's count (30.4 M in Table 2).
  assert _summarize("revnet50", "imagenet", 64)["total_params"] == sum(
      bottleneck_revnet_imagenet_params_by_hand((3, 4, 6, 3)))


@pytest.mark.parametrize("name", ["revnet101", "resnet101"])
def test_101_layer_models_on_cifar(name):
  stages = models.build_model(name, width=2)
  assert len(stages) == 35 and stages[0].module.imagenet is False
  assert sum(s.reversible for s in stages) == (29 if name == "revnet101" else 0)


def test_cli_prints_revnet101_stages():
  out = _cli("revnet101", "--dataset=imagenet")
  assert out.returncode == 0, out.stderr
  assert "group2_rev22" in out.stdout and "49,383,272" in out.stdout.replace(" ", "")
