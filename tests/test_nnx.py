"""NNX modules as stages: the same block in linen and NNX trains identically; stage checks."""

import flax.linen as nn
from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import petra_jax
from petra_jax.engine.stages.stage_state import StageState
from helpers import batches_of, random_batch, run_ticks

# Flax's deprecations are errors here: the NNX path (petra_jax/engine/stages/nnx_modules.py) uses
# only current NNX API (a user would otherwise see flax's warnings on every run).
pytestmark = pytest.mark.filterwarnings("error::DeprecationWarning:flax")


class LinenStem(nn.Module):
  width: int

  @nn.compact
  def __call__(self, x, train: bool = True):
    x = nn.Conv(2 * self.width, (3, 3), name="conv")(x)
    x = nn.BatchNorm(use_running_average=not train, momentum=0.9, name="bn")(x)
    return tuple(jnp.split(nn.relu(x), 2, axis=-1))


class LinenF(nn.Module):
  width: int

  @nn.compact
  def __call__(self, x, train: bool = True):
    x = nn.Conv(self.width, (3, 3), name="conv")(x)
    return nn.relu(nn.BatchNorm(use_running_average=not train, momentum=0.9, name="bn")(x))


class LinenHead(nn.Module):
  num_classes: int

  @nn.compact
  def __call__(self, x, train: bool = True):
    return nn.Dense(self.num_classes, name="dense")(jnp.concatenate(x, -1).mean((1, 2)))


class NNXStem(nnx.Module):
  def __init__(self, width, rngs):
    self.conv = nnx.Conv(3, 2 * width, (3, 3), rngs=rngs)
    self.bn = nnx.BatchNorm(2 * width, momentum=0.9, rngs=rngs)

  def __call__(self, x, train: bool = True):
    x = nnx.relu(self.bn(self.conv(x), use_running_average=not train))
    return tuple(jnp.split(x, 2, axis=-1))


class NNXF(nnx.Module):  # train()/eval() instead of a train argument
  def __init__(self, width, rngs):
    self.conv = nnx.Conv(width, width, (3, 3), rngs=rngs)
    self.bn = nnx.BatchNorm(width, momentum=0.9, rngs=rngs)

  def __call__(self, x):
    return nnx.relu(self.bn(self.conv(x)))


class NNXHead(nnx.Module):
  def __init__(self, width, num_classes, rngs):
    self.dense = nnx.Linear(2 * width, num_classes, rngs=rngs)

  def __call__(self, x, train: bool = True):
    return self.dense(jnp.concatenate(x, -1).mean((1, 2)))


def _nnx_stages(w=2):
  rngs = nnx.Rngs(0)
  return [petra_jax.Stage("stem", NNXStem(w, rngs), reversible=False),
          petra_jax.Stage("rev0", NNXF(w, rngs), reversible=True),
          petra_jax.Stage("rev1", NNXF(w, rngs), reversible=True),
          petra_jax.Stage("head", NNXHead(w, 10, rngs), reversible=False)]


def _linen_stages(w=2):
  return [petra_jax.Stage("stem", LinenStem(w), reversible=False),
          petra_jax.Stage("rev0", LinenF(w), reversible=True),
          petra_jax.Stage("rev1", LinenF(w), reversible=True),
          petra_jax.Stage("head", LinenHead(10), reversible=False)]


def _losses(stages, copy_from=None):
  pipe = petra_jax.Pipeline(stages, optax.sgd(0.1, momentum=0.9), jax.devices()[:1],
                            method="petra", accumulation_steps=2)
  x, _ = random_batch()
  state = pipe.init(0, x)
  if copy_from is not None:
    state.stage_states = [StageState.create(v["params"], v["batch_stats"], pipe.txs[j])
                          for j, v in enumerate(copy_from)]
  start = petra_jax.trained_variables(state)
  state, outs = run_ticks(pipe, state, 8, batches_of())
  return [float(o.loss) for o in outs], start, petra_jax.trained_variables(state)


def test_nnx_and_linen_twins_give_equal_petra_losses():
  nnx_losses, nnx_start, nnx_end = _losses(_nnx_stages())
  # The NNX modules start from their own (nnx.Rngs) parameters.
  model = NNXStem(2, nnx.Rngs(0))
  np.testing.assert_array_equal(nnx_start[0]["params"]["conv"]["kernel"], model.conv.kernel[...])
  np.testing.assert_array_equal(nnx_start[0]["batch_stats"]["bn"]["var"], model.bn.var[...])
  linen_losses, linen_start, linen_end = _losses(_linen_stages(), copy_from=nnx_start)
  assert jax.tree.structure(linen_start) == jax.tree.structure(nnx_start)
  assert len(nnx_losses) == 8 and np.all(np.isfinite(nnx_losses))
  assert nnx_losses == linen_losses
  assert nnx_losses[0] != nnx_losses[-1]  # it trained
  jax.tree.map(np.testing.assert_array_equal, nnx_end, linen_end)


def test_trained_variables_go_back_into_the_nnx_module():
  stages = _nnx_stages()
  _, _, end = _losses(stages)
  block = NNXF(2, nnx.Rngs(5))
  petra_jax.update_nnx(block, end[1])
  np.testing.assert_array_equal(block.conv.kernel[...], end[1]["params"]["conv"]["kernel"])
  np.testing.assert_array_equal(block.bn.mean[...], end[1]["batch_stats"]["bn"]["mean"])
  assert float(jnp.abs(block.bn.mean[...]).sum()) > 0  # statistics were trained


class NoPool(nn.Module):
  @nn.compact
  def __call__(self, x, train: bool = True):
    return nn.Conv(10, (1, 1))(jnp.concatenate(x, -1))


class Shrink(nn.Module):
  @nn.compact
  def __call__(self, x, train: bool = True):
    return nn.Conv(1, (3, 3))(x)


@pytest.mark.parametrize("stages, message", [
    (lambda: _linen_stages()[:1], "at least 2 stages"),
    (lambda: [_linen_stages()[0], petra_jax.Stage("rev", Shrink(), True), _linen_stages()[3]],
     "F must keep its input's shape"),
    (lambda: [_linen_stages()[0], petra_jax.Stage("head", NoPool(), False)],
     "must give logits [B, num_classes]"),
])
def test_wrong_stages_are_one_clear_error(stages, message):
  x, _ = random_batch()
  with pytest.raises(ValueError) as e:
    petra_jax.check_stages(stages(), x, 10)
  assert message in str(e.value) and "\n" not in str(e.value)


def test_head_with_wrong_classes_is_named():
  x, _ = random_batch()
  with pytest.raises(ValueError, match=r"\[8, 100\]"):
    petra_jax.check_stages(_linen_stages(), x, 100)


def test_a_module_neither_linen_nor_nnx_is_refused():
  with pytest.raises(ValueError, match="neither a flax.linen nor a flax.nnx Module"):
    petra_jax.Stage("f", lambda x: x, reversible=True)


def test_pipeline_init_checks_the_stages():
  stages = [_linen_stages()[0], petra_jax.Stage("rev", Shrink(), True), _linen_stages()[3]]
  pipe = petra_jax.Pipeline(stages, optax.sgd(0.1), jax.devices()[:1])
  with pytest.raises(ValueError, match="F must keep"):
    pipe.init(0, random_batch()[0])


class Nested(nnx.Module):  # submodules in a list: integer keys
  def __init__(self, width, rngs):
    self.blocks = nnx.List([NNXF(width, rngs) for _ in range(2)])

  def __call__(self, x, train: bool = True):
    for b in self.blocks:
      (b.train if train else b.eval)()
      x = b(x)
    return x


def test_nested_nnx_variables_are_plain_dicts_of_one_structure():
  stage = petra_jax.Stage("f", Nested(2, nnx.Rngs(0)), reversible=True)
  x = jnp.ones((2, 4, 4, 2))
  v = stage.module.init(jax.random.key(0), x)
  assert set(v["params"]["blocks"]) == {"0", "1"}
  assert type(v["params"]["blocks"]["0"]["conv"]) is dict
  _, new = stage.module.apply(v, x, train=True, mutable=["batch_stats"])
  assert jax.tree.structure(new["batch_stats"]) == jax.tree.structure(v["batch_stats"])
  model = Nested(2, nnx.Rngs(0))
  np.testing.assert_array_equal(v["params"]["blocks"]["1"]["conv"]["kernel"],
                                model.blocks[1].conv.kernel[...])
