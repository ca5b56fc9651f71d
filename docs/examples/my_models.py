"""A model for the CLI hook: ``--config.model.name=my_models:tiny_revnet``.

The training CLI imports ``MODULE`` and calls ``FUNCTION(num_classes=...,
width=config.model.width, depth=config.model.depth)`` with the keywords the
function accepts (``depth`` only when set); every method, stage grouping,
checkpoint and data-parallel option of the zoo applies. From the repository root::

  PYTHONPATH=docs/examples python -m petra_jax.train --config=configs/cifar10.py \
    --config.model.name=my_models:tiny_revnet --config.model.width=8 \
    --config.max_steps=20 --workdir=runs/my_models

``--steps N`` runs that command for N steps on CIFAR-10 (``--data_dir``: its tfds directory).
"""

import argparse
import os
import subprocess
import sys

import flax.linen as nn
import jax.numpy as jnp

import petra_jax


class Residual(nn.Module):
  """``F``: conv3x3 -> BN -> ReLU, ``[B, H, W, C] -> [B, H, W, C]``."""
  width: int

  @nn.compact
  def __call__(self, x, train: bool = True):
    x = nn.Conv(self.width, (3, 3), use_bias=False)(x)
    return nn.relu(nn.BatchNorm(use_running_average=not train, momentum=0.9)(x))


class Stem(nn.Module):
  """Image ``[B, H, W, 3]`` -> two streams ``2 x [B, H/2, W/2, width]`` (conv3x3, stride 2)."""
  width: int

  @nn.compact
  def __call__(self, x, train: bool = True):
    x = nn.Conv(2 * self.width, (3, 3), strides=2, use_bias=False)(x)
    x = nn.relu(nn.BatchNorm(use_running_average=not train, momentum=0.9)(x))
    return tuple(jnp.split(x, 2, axis=-1))


class Head(nn.Module):
  """Streams -> global average pool -> logits ``[B, num_classes]``."""
  num_classes: int

  @nn.compact
  def __call__(self, x, train: bool = True):
    return nn.Dense(self.num_classes)(jnp.concatenate(x, axis=-1).mean(axis=(1, 2)))


def tiny_revnet(num_classes: int, width: int = 8, depth: int = 3) -> list:
  """Stem, ``depth`` reversible blocks ``(y1, y2) = (x2 + F(x1), x1)``, head."""
  return ([petra_jax.Stage("stem", Stem(width), reversible=False)]
          + [petra_jax.Stage(f"rev{i}", Residual(width), reversible=True) for i in range(depth)]
          + [petra_jax.Stage("head", Head(num_classes), reversible=False)])


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--steps", type=int, default=20)
  p.add_argument("--data_dir", default="")
  p.add_argument("--workdir", default="runs/my_models")
  args = p.parse_args()
  here = os.path.dirname(os.path.abspath(__file__))
  env = dict(os.environ, PYTHONPATH=os.pathsep.join([here, os.environ.get("PYTHONPATH", "")]))
  config = os.path.join(here, "..", "..", "configs", "cifar10.py")
  return subprocess.call(
      [sys.executable, "-m", "petra_jax.train", f"--config={config}",
       "--config.model.name=my_models:tiny_revnet", "--config.model.width=8",
       f"--config.max_steps={args.steps}", "--config.eval_every=0",
       f"--config.data_dir={args.data_dir}", f"--workdir={args.workdir}"], env=env)


if __name__ == "__main__":
  sys.exit(main())
