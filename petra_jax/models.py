"""Reversible networks (RevNets) split into PETRA stages.

A model is a list of :class:`~petra_jax.stage.Stage` objects, one residual
block per stage, as in the paper (Sec. 4, "Model adaptations"): RevNet18 has 10
stages (stem, 8 blocks, head). Activations between stages are *two streams*
``(x1, x2)``, each ``float32[B, H, W, C]``: the stem's ``2C`` output channels
are split in half, the image is not duplicated.

* Reversible stages hold only the residual function ``F`` (one stream in, one
  out); the coupling ``(y1, y2) = (x2 + F(x1), x1)`` and its inverse live in
  :mod:`petra_jax.stage` (paper Fig. 2).
* Non-reversible stages (stem, downsampling, head) are ordinary Flax modules
  on the whole activation; PETRA buffers their input and recomputes.

Architectures follow the authors' code (``../shared/reference``), with two
documented choices: convolutions have no bias (a BatchNorm follows each one),
and the basic downsampling block's ``y2`` is the clean ``BN(conv(x1))`` (the
reference's post-ReLU ``y2`` comes from in-place aliasing).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

from petra_jax.stage import Stage

# PyTorch's default initialisation (kaiming-uniform, a=sqrt(5)), as in the
# authors' code: U(-1/sqrt(fan_in), 1/sqrt(fan_in)).
_torch_default_init = nn.initializers.variance_scaling(1 / 3, "fan_in", "uniform")


def _torch_bias_init(fan_in: int):
  bound = 1.0 / float(fan_in) ** 0.5
  return lambda key, shape, dtype=jnp.float32: jax.random.uniform(
      key, shape, dtype, -bound, bound)


_Conv = functools.partial(
    nn.Conv, use_bias=False, kernel_init=_torch_default_init, padding="SAME")
# BN momentum 0.1 in PyTorch terms is 0.9 in Flax terms; eps as PyTorch.
_BatchNorm = functools.partial(nn.BatchNorm, momentum=0.9, epsilon=1e-5)


class Stem(nn.Module):
  """Input stage: image ``[B, H, W, 3]`` -> streams ``2 x [B, H', W', width]``.

  CIFAR stem: conv3x3 stride 1 -> BN -> ReLU. ImageNet stem: conv7x7 stride 2
  -> BN -> ReLU -> 2x2 max-pool stride 2 (as in the authors' code).
  """
  width: int
  imagenet: bool = False

  @nn.compact
  def __call__(self, x, train: bool = True):
    if self.imagenet:
      x = _Conv(2 * self.width, (7, 7), strides=(2, 2))(x)
    else:
      x = _Conv(2 * self.width, (3, 3))(x)
    x = nn.relu(_BatchNorm(use_running_average=not train)(x))
    if self.imagenet:
      x = nn.max_pool(x, (2, 2), strides=(2, 2))
    x1, x2 = jnp.split(x, 2, axis=-1)
    return x1, x2


class BasicResidual(nn.Module):
  """Residual function F of a reversible basic block, on one stream.

  ``F = ReLU . BN . conv3x3 . ReLU . BN . conv3x3``: ``[B, H, W, C] ->
  [B, H, W, C]`` with ``C = features`` (note the ReLU after the last BN, as in
  the authors' code).
  """
  features: int

  @nn.compact
  def __call__(self, x, train: bool = True):
    x = _Conv(self.features, (3, 3))(x)
    x = nn.relu(_BatchNorm(use_running_average=not train)(x))
    x = _Conv(self.features, (3, 3))(x)
    return nn.relu(_BatchNorm(use_running_average=not train)(x))


class BasicDownsample(nn.Module):
  """Non-reversible downsampling block on two streams.

  ``y2 = BN(conv3x3_s(x1))``, ``y1 = ReLU(BN(conv3x3(ReLU(y2)))) +
  BN(conv1x1_s(x2))``: streams ``[B, H, W, C_in]`` -> ``[B, H/s, W/s, C]``
  with ``C = features`` and ``s = stride``.
  """
  features: int
  stride: int = 2

  @nn.compact
  def __call__(self, x, train: bool = True):
    x1, x2 = x
    s = (self.stride, self.stride)
    y2 = _BatchNorm(use_running_average=not train)(_Conv(self.features, (3, 3), strides=s)(x1))
    h = _Conv(self.features, (3, 3))(nn.relu(y2))
    h = nn.relu(_BatchNorm(use_running_average=not train)(h))
    shortcut = _BatchNorm(use_running_average=not train)(
        _Conv(self.features, (1, 1), strides=s)(x2))
    return h + shortcut, y2


class Head(nn.Module):
  """Last stage: streams -> concat -> global average pool -> Dense -> logits.

  Returns ``float32[B, num_classes]``; the softmax cross-entropy is applied by
  the engine (:func:`petra_jax.stage.head_loss`).
  """
  num_classes: int

  @nn.compact
  def __call__(self, x, train: bool = True):
    del train
    h = jnp.concatenate(x, axis=-1).mean(axis=(1, 2))
    return nn.Dense(self.num_classes, kernel_init=_torch_default_init,
                    bias_init=_torch_bias_init(h.shape[-1]))(h)


@dataclasses.dataclass(frozen=True)
class ModelSpec:
  """How to build a model: blocks per resolution group and block types."""
  blocks_per_group: Sequence[int]
  residual: Callable[[int], nn.Module]
  downsample: Callable[[int, int], nn.Module]


# Reversible blocks per group (the first block of groups 2.. is a non-reversible
# downsampling block, counted in the group). Reference notes: RevNet18 = stem +
# [2 rev] + [ds + rev] x 3 + head; RevNet34 = stem + [3 rev] + [ds + 3 rev] +
# [ds + 5 rev] + [ds + 2 rev] + head.
MODEL_SPECS = {
    "revnet18": ModelSpec((2, 2, 2, 2), BasicResidual, BasicDownsample),
    "revnet34": ModelSpec((3, 4, 6, 3), BasicResidual, BasicDownsample),
}


def build_model(name: str, *, width: int = 64, num_classes: int = 10,
                imagenet_stem: bool = False) -> list[Stage]:
  """Builds the stage list of a RevNet, one residual block per stage.

  Args:
    name: one of ``MODEL_SPECS`` (``revnet18``, ``revnet34``).
    width: channels per stream after the stem (the paper's 64); groups use
      ``width * (1, 2, 4, 8)``.
    num_classes: classes of the head.
    imagenet_stem: 7x7/2 conv + max-pool stem instead of the CIFAR 3x3 one.

  Returns:
    ``[stem, block, ..., head]``: 10 stages for RevNet18, 18 for RevNet34.

  Raises:
    ValueError: unknown ``name`` or ``width < 1``.
  """
  if name not in MODEL_SPECS:
    raise ValueError(f"Unknown model {name!r}; choose one of {sorted(MODEL_SPECS)} "
                     "(--config.model.name=...).")
  if width < 1:
    raise ValueError(f"model.width must be >= 1, got {width}.")
  spec = MODEL_SPECS[name]
  stages = [Stage("stem", Stem(width, imagenet=imagenet_stem), reversible=False)]
  for g, n in enumerate(spec.blocks_per_group):
    c = width * 2**g
    for b in range(n):
      if g > 0 and b == 0:
        stages.append(Stage(f"group{g}_down", spec.downsample(c, 2), reversible=False))
      else:
        stages.append(Stage(f"group{g}_rev{b}", spec.residual(c), reversible=True))
  stages.append(Stage("head", Head(num_classes), reversible=False))
  return stages
