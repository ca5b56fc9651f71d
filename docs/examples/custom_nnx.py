"""The reversible CNN of custom_linen.py written in Flax NNX, trained with PETRA on CIFAR-10.

An NNX module goes wherever a linen one does: ``petra_jax.Stage`` converts it
once (``nnx.split``/``nnx.merge``); training starts from the module's own
parameters (here ``nnx.Rngs(0)``), and ``petra_jax.update_nnx`` writes trained
ones back. A module's ``__call__`` may take ``train`` or use ``train()``/``eval()``::

  python docs/examples/custom_nnx.py --steps 20 [--data_dir TFDS_DIR]
"""

import argparse

from flax import nnx
import jax.numpy as jnp

import petra_jax
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


def reversible_cnn(num_classes: int = 10, width: int = 16) -> list:
  rngs = nnx.Rngs(0)
  return [petra_jax.Stage("stem", Stem(width, rngs), reversible=False),
          petra_jax.Stage("rev0", F(width, rngs), reversible=True),
          petra_jax.Stage("down", Down(width, 2 * width, rngs), reversible=False),
          petra_jax.Stage("rev1", F(2 * width, rngs), reversible=True),
          petra_jax.Stage("head", Head(2 * width, num_classes, rngs), reversible=False)]


if __name__ == "__main__":
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--steps", type=int, default=20)
  p.add_argument("--data_dir", default="")
  p.add_argument("--width", type=int, default=16)
  args = p.parse_args()
  print(train("custom_nnx:reversible_cnn", args.steps, args.data_dir, args.width))
