"""The reversible CNN of custom_linen.py written in Flax NNX, trained with PETRA on CIFAR-10.

An NNX module goes wherever a linen one does: ``petra_jax.Stage`` converts it
once (``nnx.split``/``nnx.merge``); training starts from the module's own
parameters (here ``nnx.Rngs(0)``), and ``petra_jax.update_nnx`` writes trained
ones back (:func:`write_back`: the pipeline from your own loop, then plain NNX).
A module's ``__call__`` may take ``train`` or use ``train()``/``eval()``::

  python docs/examples/custom_nnx.py --steps 20 [--data_dir TFDS_DIR]
"""

import argparse

from flax import nnx
import jax
import jax.numpy as jnp
import optax

import petra_jax
from petra_jax import data
from custom_linen import train


class ConvBN(nnx.Module):
  def __init__(self, c_in, c_out, rngs, stride=1):
    self.conv = nnx.Conv(c_in, c_out, (3, 3), strides=stride, use_bias=False, rngs=rngs)
    self.bn = nnx.BatchNorm(c_out, momentum=0.9, rngs=rngs)

  def __call__(self, x, train: bool = True):
    return nnx.relu(self.bn(self.conv(x), use_running_average=not train))


class Stem(nnx.Module):
  def __init__(self, width, rngs):
    self.layer = ConvBN(3, 2 * width, rngs)

  def __call__(self, x, train: bool = True):
    return tuple(jnp.split(self.layer(x, train), 2, axis=-1))


class F(nnx.Module):
  """The residual function: ``[B, H, W, C] -> [B, H, W, C]``."""

  def __init__(self, width, rngs):
    self.a, self.b = ConvBN(width, width, rngs), ConvBN(width, width, rngs)

  def __call__(self, x, train: bool = True):
    return self.b(self.a(x, train), train)


class Down(nnx.Module):
  def __init__(self, c_in, c_out, rngs):
    self.x1, self.x2 = ConvBN(c_in, c_out, rngs, 2), ConvBN(c_in, c_out, rngs, 2)

  def __call__(self, x, train: bool = True):
    return self.x1(x[0], train), self.x2(x[1], train)


class Head(nnx.Module):
  def __init__(self, width, num_classes, rngs):
    self.dense = nnx.Linear(2 * width, num_classes, rngs=rngs)

  def __call__(self, x, train: bool = True):
    return self.dense(jnp.concatenate(x, axis=-1).mean(axis=(1, 2)))


def nnx_modules(num_classes: int = 10, width: int = 16) -> list:
  """``(name, NNX module, reversible)`` per stage."""
  rngs = nnx.Rngs(0)
  return [("stem", Stem(width, rngs), False), ("rev0", F(width, rngs), True),
          ("down", Down(width, 2 * width, rngs), False), ("rev1", F(2 * width, rngs), True),
          ("head", Head(2 * width, num_classes, rngs), False)]


def reversible_cnn(num_classes: int = 10, width: int = 16) -> list:
  return [petra_jax.Stage(name, module, reversible=rev)
          for name, module, rev in nnx_modules(num_classes, width)]


def write_back(steps: int, data_dir: str, width: int) -> bool:
  """PETRA for ``steps`` updates (k = 1) from your own loop, the trained weights
  written into the NNX modules; whether plain NNX then gives the pipeline's logits."""
  info = data.get_dataset_info("cifar10")
  split = data.open_split("cifar10", info.train_split, data_dir or None)
  parts = nnx_modules(info.num_classes, width)
  stages = [petra_jax.Stage(name, module, reversible=rev) for name, module, rev in parts]
  pipe = petra_jax.Pipeline(stages, optax.sgd(0.05, momentum=0.9), method="petra")
  batch_fn = data.make_train_batch_fn(info, pipe.input_device)
  rows = data.batch_indices(len(split), 32, seed=0, epoch=0, steps_per_epoch=steps)
  batches = lambda m: batch_fn(split, rows[m], jax.random.key(m))  # noqa: E731
  state = pipe.init(0, batches(0)[0])
  for tick in pipe.schedule(len(rows)):  # micro-batches: k = 1, so one per update
    state, _ = pipe.run_tick(state, tick, batches)
  for stage, variables in zip(stages, petra_jax.trained_variables(state)):
    petra_jax.update_nnx(stage.module, variables)  # into the NNX module the stage was built from
  images = batches(0)[0]
  x = images
  for _, module, rev in parts:  # the NNX modules alone, evaluation mode
    f = module(x[0] if rev else x, train=False)
    x = (x[1] + f, x[0]) if rev else f
  return bool(jnp.abs(x - pipe.predict(state, images)).max() < 1e-4)


if __name__ == "__main__":
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--steps", type=int, default=20)
  p.add_argument("--data_dir", default="")
  p.add_argument("--width", type=int, default=16)
  args = p.parse_args()
  print("NNX modules hold the trained weights:", write_back(args.steps, args.data_dir, args.width))
  print(train("custom_nnx:reversible_cnn", args.steps, args.data_dir, args.width))
