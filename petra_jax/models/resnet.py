"""torchvision's ResNets (``resnet18/34/50/101``, v1.5) on one tensor: the backprop baselines."""

from __future__ import annotations

import flax.linen as nn

from petra_jax.engine.stages.stage import Stage
from petra_jax.models.layers import conv_bn
from petra_jax.models.model_spec import ModelSpec


class ResNetBasicBlock(nn.Module):
  """``ReLU(BN(conv3x3(ReLU(BN(conv3x3_s(x))))) + sc)``, ``sc = BN(conv1x1_s(x))`` or ``x``."""
  features: int
  stride: int = 1

  @nn.compact
  def __call__(self, x, train: bool = True):
    h = nn.relu(conv_bn(x, self.features, 3, self.stride, train))
    h = conv_bn(h, self.features, 3, 1, train)
    if self.stride != 1 or x.shape[-1] != self.features:
      x = conv_bn(x, self.features, 1, self.stride, train)
    return nn.relu(h + x)


class ResNetBottleneck(nn.Module):
  """conv1x1, conv3x3_s, conv1x1 (x4), each BN (ReLU but the last), ``+ sc``, ReLU."""
  features: int
  stride: int = 1
  expansion: int = 4

  @nn.compact
  def __call__(self, x, train: bool = True):
    out = self.expansion * self.features
    h = nn.relu(conv_bn(x, self.features, 1, 1, train))
    h = nn.relu(conv_bn(h, self.features, 3, self.stride, train))
    h = conv_bn(h, out, 1, 1, train)
    if self.stride != 1 or x.shape[-1] != out:
      x = conv_bn(x, out, 1, self.stride, train)
    return nn.relu(h + x)


def resnet_blocks(spec: ModelSpec, width: int) -> list[Stage]:
  """The ResNet stages between stem and head; groups 1.. start with stride 2."""
  block = ResNetBottleneck if spec.bottleneck else ResNetBasicBlock
  stages = []
  for g, n in enumerate(spec.blocks_per_group):
    for b in range(n):
      stride = 2 if (b == 0 and g > 0) else 1
      stages.append(Stage(f"group{g}_block{b}", block(width * 2**g, stride),
                          reversible=False))
  return stages
