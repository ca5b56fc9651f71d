"""Conv + BN as PyTorch initialises them (no conv bias; BN momentum 0.1, eps 1e-5); stem, head."""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp

from petra_jax.models import batchnorm

# PyTorch's default U(-1/sqrt(fan_in), 1/sqrt(fan_in)), as the authors' code.
torch_default_init = nn.initializers.variance_scaling(1 / 3, "fan_in", "uniform")


def torch_bias_init(fan_in: int):
  """PyTorch's default bias initialisation ``U(-1/sqrt(fan_in), 1/sqrt(fan_in))``."""
  bound = 1.0 / float(fan_in) ** 0.5
  return lambda key, shape, dtype=jnp.float32: jax.random.uniform(
      key, shape, dtype, -bound, bound)


Conv = functools.partial(
    nn.Conv, use_bias=False, kernel_init=torch_default_init, padding="SAME")
# PyTorch's momentum 0.1 is Flax's 0.9; petra_jax.models.batchnorm has a closed-form backward.
BatchNorm = functools.partial(batchnorm.BatchNorm, momentum=0.9, epsilon=1e-5)


def conv_bn(x, features: int, kernel: int, stride: int, train: bool, relu: bool = False):
  """``BN(conv_kxk_s(x))``, ReLU fused if ``relu``: ``[B, H, W, C] -> [B, H/s, W/s, features]``."""
  x = Conv(features, (kernel, kernel), strides=(stride, stride))(x)
  return BatchNorm(use_running_average=not train, relu=relu)(x)


class Stem(nn.Module):
  """Image ``[B, H, W, 3]`` -> conv3x3 (ImageNet: conv7x7/2) -> BN -> ReLU (ImageNet: max-pool).

  ``two_streams`` (RevNets): ``2 width`` channels split into ``2 x [B, H', W', width]``,
  2x2/2 pool; else (ResNets) ``[B, H', W', width]``, torchvision's 3x3/2 pool.
  """
  width: int
  imagenet: bool = False
  two_streams: bool = True

  @nn.compact
  def __call__(self, x, train: bool = True):
    channels = 2 * self.width if self.two_streams else self.width
    if self.imagenet:
      x = Conv(channels, (7, 7), strides=(2, 2))(x)
    else:
      x = Conv(channels, (3, 3))(x)
    x = BatchNorm(use_running_average=not train, relu=True)(x)
    if self.imagenet and self.two_streams:
      x = nn.max_pool(x, (2, 2), strides=(2, 2))
    elif self.imagenet:
      x = nn.max_pool(x, (3, 3), strides=(2, 2), padding=((1, 1), (1, 1)))
    if not self.two_streams:
      return x
    x1, x2 = jnp.split(x, 2, axis=-1)
    return x1, x2


class Head(nn.Module):
  """Streams (and carried arrays) or ``[B, H, W, C]`` -> average pool -> logits ``[B, K]``."""
  num_classes: int

  @nn.compact
  def __call__(self, x, train: bool = True):
    del train
    carried = ()
    if isinstance(x, (tuple, list)):
      x, carried = jnp.concatenate(x[:2], axis=-1), x[2:]
    h = x.mean(axis=(1, 2))
    if carried:
      h = jnp.concatenate([h, *(c.mean(axis=(1, 2)) for c in carried)], axis=-1)
    return nn.Dense(self.num_classes, kernel_init=torch_default_init,
                    bias_init=torch_bias_init(h.shape[-1]))(h)
