"""Layers shared by the model zoo: PyTorch-initialised conv + BN, stem and head.

Convolutions have no bias (a BatchNorm follows each one) and use PyTorch's
default initialisation, as the authors' code; BatchNorm has PyTorch's
momentum 0.1 and eps 1e-5. The stem and the head serve both families: RevNets
(two streams) and ResNets (one tensor).
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp

from petra_jax.models import batchnorm

# PyTorch's default initialisation (kaiming-uniform, a=sqrt(5)), as in the
# authors' code: U(-1/sqrt(fan_in), 1/sqrt(fan_in)).
torch_default_init = nn.initializers.variance_scaling(1 / 3, "fan_in", "uniform")


def torch_bias_init(fan_in: int):
  """PyTorch's default bias initialisation ``U(-1/sqrt(fan_in), 1/sqrt(fan_in))``."""
  bound = 1.0 / float(fan_in) ** 0.5
  return lambda key, shape, dtype=jnp.float32: jax.random.uniform(
      key, shape, dtype, -bound, bound)


Conv = functools.partial(
    nn.Conv, use_bias=False, kernel_init=torch_default_init, padding="SAME")
# BN momentum 0.1 in PyTorch terms is 0.9 in Flax terms; eps as PyTorch. Flax's
# BatchNorm with a closed-form backward (petra_jax.models.batchnorm): same
# variables, same values, about 3x faster on XLA-CPU.
BatchNorm = functools.partial(batchnorm.BatchNorm, momentum=0.9, epsilon=1e-5)


def conv_bn(x, features: int, kernel: int, stride: int, train: bool, relu: bool = False):
  """``BN(conv_kxk stride s (x))``: ``[B, H, W, C_in] -> [B, H/s, W/s, features]``.

  Called inside an ``nn.compact`` method: creates one ``Conv`` and one
  ``BatchNorm`` submodule of the caller. With ``relu``, ``ReLU(BN(...))``, the
  ReLU fused into the BatchNorm's pass (same values as ``nn.relu`` after it).
  """
  x = Conv(features, (kernel, kernel), strides=(stride, stride))(x)
  return BatchNorm(use_running_average=not train, relu=relu)(x)


class Stem(nn.Module):
  """Input stage: image ``[B, H, W, 3]`` -> activation of the first group.

  CIFAR stem: conv3x3 stride 1 -> BN -> ReLU. ImageNet stem: conv7x7 stride 2
  -> BN -> ReLU -> max-pool. With ``two_streams`` (RevNets) the conv has
  ``2 * width`` channels, split into streams ``2 x [B, H', W', width]``, and
  the pool is the authors' 2x2 stride 2. Otherwise (ResNets) the output is
  ``[B, H', W', width]`` and the pool is torchvision's 3x3 stride 2 padding 1.
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
  """Last stage: (concat streams) -> global average pool -> Dense -> logits.

  Takes streams ``(x1, x2)`` (RevNets) or one ``[B, H, W, C]`` tensor
  (ResNets); arrays carried after the streams (invertible downsampling, any
  resolution) are average-pooled too and their features appended. Returns
  ``float32[B, num_classes]``; the softmax cross-entropy is applied by the
  engine (:func:`petra_jax.engine.stage.cross_entropy`).
  """
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
