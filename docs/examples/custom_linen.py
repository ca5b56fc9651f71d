"""A small reversible CNN written from scratch in Flax linen, trained with PETRA on CIFAR-10.

Shows the three kinds of stage: a non-reversible module from input to output
(stem, downsampling), a reversible stage whose module is the residual ``F`` of
the coupling ``(y1, y2) = (x2 + F(x1), x1)`` (shape-preserving, on one stream),
and a last stage giving logits ``[B, num_classes]``. ``train_and_evaluate``
finds the model by ``MODULE:FUNCTION``, as ``--config.model.name`` does::

  python docs/examples/custom_linen.py --steps 20 [--data_dir TFDS_DIR]
"""

import argparse
import tempfile

import flax.linen as nn
import jax.numpy as jnp

import petra_jax


def conv_bn(x, features, train, stride=1):
  x = nn.Conv(features, (3, 3), strides=stride, use_bias=False)(x)
  return nn.relu(nn.BatchNorm(use_running_average=not train, momentum=0.9)(x))


class Stem(nn.Module):
  """Image ``[B, 32, 32, 3]`` -> streams ``2 x [B, 32, 32, width]``."""
  width: int

  @nn.compact
  def __call__(self, x, train: bool = True):
    return tuple(jnp.split(conv_bn(x, 2 * self.width, train), 2, axis=-1))


class F(nn.Module):
  """The residual function of a reversible block: ``[B, H, W, C] -> [B, H, W, C]``."""
  width: int

  @nn.compact
  def __call__(self, x, train: bool = True):
    return conv_bn(conv_bn(x, self.width, train), self.width, train)


class Down(nn.Module):
  """Non-reversible: streams ``[B, H, W, C]`` -> ``[B, H/2, W/2, 2C]``."""
  width: int

  @nn.compact
  def __call__(self, x, train: bool = True):
    return tuple(conv_bn(s, self.width, train, stride=2) for s in x)


class Head(nn.Module):
  """Streams -> global average pool -> logits ``[B, num_classes]``."""
  num_classes: int

  @nn.compact
  def __call__(self, x, train: bool = True):
    return nn.Dense(self.num_classes)(jnp.concatenate(x, axis=-1).mean(axis=(1, 2)))


def reversible_cnn(num_classes: int = 10, width: int = 16) -> list:
  return [petra_jax.Stage("stem", Stem(width), reversible=False),
          petra_jax.Stage("rev0", F(width), reversible=True),
          petra_jax.Stage("down", Down(2 * width), reversible=False),
          petra_jax.Stage("rev1", F(2 * width), reversible=True),
          petra_jax.Stage("head", Head(num_classes), reversible=False)]


def train(model: str, steps: int, data_dir: str, width: int) -> dict:
  """PETRA on CIFAR-10 for ``steps`` updates of 2 micro-batches of 32; test metrics."""
  config = petra_jax.get_config()
  config.model.name, config.model.width, config.method = model, width, "petra"
  config.batch_size, config.accumulation_steps = 64, 2
  config.max_steps, config.eval_every, config.log_every = steps, 0, 10
  config.optim.warmup_epochs, config.data_dir = 0, data_dir
  return petra_jax.train_and_evaluate(config, tempfile.mkdtemp(prefix="petra_example_"))


if __name__ == "__main__":
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--steps", type=int, default=20)
  p.add_argument("--data_dir", default="")
  p.add_argument("--width", type=int, default=16)
  args = p.parse_args()
  print(train("custom_linen:reversible_cnn", args.steps, args.data_dir, args.width))
