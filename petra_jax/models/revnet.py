"""RevNets (``revnet18/34/50/101``, ``_inv``, ``revnet_fixed``) as in the authors' code.

Two streams ``(x1, x2)`` of ``float32[B, H, W, C]``; reversible stages hold ``F`` only.
``_inv``: i-RevNet's reversible downsampling; ``revnet_fixed``: ``depth`` blocks, one width.
"""

from __future__ import annotations

import flax.linen as nn

from petra_jax.engine.stages.stage import Stage
from petra_jax.models import invertible
from petra_jax.models.layers import conv_bn
from petra_jax.models.model_spec import ModelSpec


class BasicResidual(nn.Module):
  """``F = ReLU . BN . conv3x3 . ReLU . BN . conv3x3``: ``[B, H, W, C] -> [B, H, W, C]``."""
  features: int

  @nn.compact
  def __call__(self, x, train: bool = True):
    x = conv_bn(x, self.features, 3, 1, train, relu=True)
    return conv_bn(x, self.features, 3, 1, train, relu=True)


class BasicDownsample(nn.Module):
  """``y2 = BN(conv3x3_s(x1))``, ``y1 = ReLU(BN(conv3x3(ReLU(y2)))) + BN(conv1x1_s(x2))``.

  Streams ``[B, H, W, C_in]`` -> ``[B, H/s, W/s, features]``.
  """
  features: int
  stride: int = 2

  @nn.compact
  def __call__(self, x, train: bool = True):
    x1, x2 = x
    y2 = conv_bn(x1, self.features, 3, self.stride, train)
    h = conv_bn(nn.relu(y2), self.features, 3, 1, train, relu=True)
    return h + conv_bn(x2, self.features, 1, self.stride, train), y2


class BottleneckResidual(nn.Module):
  """``F`` = conv1x1, conv3x3_s, conv1x1, each BN + ReLU: ``[B, H, W, C] -> [B, H/s, W/s, C']``."""
  features: int
  hidden: int
  stride: int = 1

  @nn.compact
  def __call__(self, x, train: bool = True):
    x = conv_bn(x, self.hidden, 1, 1, train, relu=True)
    x = conv_bn(x, self.hidden, 3, self.stride, train, relu=True)
    return conv_bn(x, self.features, 1, 1, train, relu=True)


class BottleneckDownsample(nn.Module):
  """``y2 = BN(conv1x1_s(x1))``, ``y1 = F(x1) + BN(conv1x1_s(x2))``, ``F`` of stride ``s``."""
  features: int
  hidden: int
  stride: int = 2

  @nn.compact
  def __call__(self, x, train: bool = True):
    x1, x2 = x
    f = BottleneckResidual(self.features, self.hidden, self.stride)(x1, train)
    y2 = conv_bn(x1, self.features, 1, self.stride, train)
    return f + conv_bn(x2, self.features, 1, self.stride, train), y2


def revnet_blocks(spec: ModelSpec, width: int) -> list[Stage]:
  """The RevNet stages between stem and head; group ``g``'s first block downsamples."""
  stages, c_in = [], width
  for g, n in enumerate(spec.blocks_per_group):
    hidden = width * 2**g
    c = spec.expansion * hidden
    for b in range(n):
      if b == 0 and (spec.bottleneck or g > 0) and spec.invertible_downsampling:
        stages.append(invertible_downsample(spec, g, c_in, c, hidden))
      elif b == 0 and spec.bottleneck:
        module = BottleneckDownsample(c, hidden, stride=1 if g == 0 else 2)
        stages.append(Stage(f"group{g}_down", module, reversible=False))
      elif b == 0 and g > 0:
        stages.append(Stage(f"group{g}_down", BasicDownsample(c, 2), reversible=False))
      elif spec.bottleneck:
        stages.append(Stage(f"group{g}_rev{b}", BottleneckResidual(c, hidden), reversible=True))
      else:
        stages.append(Stage(f"group{g}_rev{b}", BasicResidual(c), reversible=True))
    c_in = c
  return stages


def invertible_downsample(spec: ModelSpec, g: int, c_in: int, c: int, hidden: int) -> Stage:
  """Group ``g``'s first block, reversible: ``pre`` (``psi``; group 0: zero-padding), coupling."""
  if g == 0:
    pre = invertible.InjectivePad(c_in, c)
  else:
    pre = invertible.InvertibleDownsample(c_in, c)
  module = BottleneckResidual(c, hidden) if spec.bottleneck else BasicResidual(c)
  return Stage(f"group{g}_down", module, reversible=True, pre=pre)
