"""Reversible networks (``revnet18/34/50``, ``_inv``, ``revnet_fixed``).

Activations between stages are *two streams* ``(x1, x2)``, each
``float32[B, H, W, C]``: the stem's ``2C`` output channels are split in half,
the image is not duplicated.

* Reversible stages hold only the residual function ``F`` (one stream in, one
  out); the coupling ``(y1, y2) = (x2 + F(x1), x1)`` and its inverse live in
  :mod:`petra_jax.engine.stage` (paper Fig. 2).
* Non-reversible stages (stem, downsampling, head) are ordinary Flax modules
  on the whole activation; PETRA buffers their input and recomputes.

Architectures follow the authors' code (``../shared/reference``), with one
documented choice besides bias-free convolutions: the basic downsampling
block's ``y2`` is the clean ``BN(conv(x1))`` (the reference's post-ReLU
``y2`` comes from in-place aliasing).

RevNet50 widths (the authors' code, checked against Table 2's 30.4M): the stem
gives ``width`` channels per stream; group ``g`` has bottleneck width
``h = width * 2**g`` and stream width ``4 h`` (256/512/1024/2048 per stream at
``width=64``, i.e. torchvision's ResNet50 widths *per stream*). Each group
starts with a bottleneck downsampling block (stride 1 in the first group).
Against ResNet50 this adds one 1x1 projection per group and a head on
``2 x 2048`` features: 25.6M + 2.8M + 2.0M = 30.4M.

Fixed-size RevNet (``revnet_fixed``, the authors' ``make_layers_revnet_fixed_size``
run by their ``main_fixed_size.py``): the stem, ``depth`` reversible basic
blocks at ``width`` channels per stream and the stem's resolution (no
downsampling), the head. Default ``depth`` 20, the authors' ``--n-layers``.
Their ``--hidden-size`` (default 256) counts both streams: it is ``width =
hidden_size / 2`` here (their default is ``width=128``).

Invertible-downsampling RevNets (``revnet18_inv/34_inv/50_inv``): RevNet18/34/50
with every downsampling block made reversible after i-RevNet (Jacobsen et al.,
2018; :mod:`petra_jax.models.invertible`), so only the stem and the head buffer their
input. A downsampling block from ``C`` to ``2C`` channels per stream becomes
``pre`` + coupling: the first ``C/2`` channels of each stream go through the
space-to-depth ``psi`` (``[H, W, C/2] -> [H/2, W/2, 2C]``) and stay on the
streams; the other ``C/2`` of each are set aside unchanged (``[H, W, C]`` for
both streams) and carried after the streams to the head, which average-pools
them with the streams. The coupling's ``F`` is the group's residual function
(``BasicResidual(2C)`` or ``BottleneckResidual``), so every later block sees
RevNet18/34/50's stream widths and resolutions. ``revnet50_inv``'s first group
(stride 1, ``width -> 4 width``) pads the streams with zero channels instead
(i-RevNet's injective padding). Every activation between stem and head holds
as many numbers as the stem's output (4x it in ``revnet50_inv``): nothing is
discarded, so nothing needs a buffer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import flax.linen as nn

from petra_jax.engine.stage import Stage
from petra_jax.models import invertible
from petra_jax.models.layers import conv_bn

if TYPE_CHECKING:
  from petra_jax.models.specs import ModelSpec


class BasicResidual(nn.Module):
  """Residual function F of a reversible basic block, on one stream.

  ``F = ReLU . BN . conv3x3 . ReLU . BN . conv3x3``: ``[B, H, W, C] ->
  [B, H, W, C]`` with ``C = features`` (note the ReLU after the last BN, as in
  the authors' code).
  """
  features: int

  @nn.compact
  def __call__(self, x, train: bool = True):
    x = conv_bn(x, self.features, 3, 1, train, relu=True)
    return conv_bn(x, self.features, 3, 1, train, relu=True)


class BasicDownsample(nn.Module):
  """Non-reversible basic downsampling block on two streams.

  ``y2 = BN(conv3x3_s(x1))``, ``y1 = ReLU(BN(conv3x3(ReLU(y2)))) +
  BN(conv1x1_s(x2))``: streams ``[B, H, W, C_in]`` -> ``[B, H/s, W/s, C]``
  with ``C = features`` and ``s = stride``.
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
  """Bottleneck residual function F of RevNet50, on one stream.

  conv1x1 -> conv3x3 (stride ``stride``) -> conv1x1, each followed by BN and
  ReLU (as in the authors' code): ``[B, H, W, C_in] -> [B, H/s, W/s, C]`` with
  ``C = features`` and ``hidden`` channels inside. Reversible blocks use
  ``stride=1`` and ``C_in = C``.
  """
  features: int
  hidden: int
  stride: int = 1

  @nn.compact
  def __call__(self, x, train: bool = True):
    x = conv_bn(x, self.hidden, 1, 1, train, relu=True)
    x = conv_bn(x, self.hidden, 3, self.stride, train, relu=True)
    return conv_bn(x, self.features, 1, 1, train, relu=True)


class BottleneckDownsample(nn.Module):
  """Non-reversible bottleneck downsampling block of RevNet50, on two streams.

  ``y2 = BN(conv1x1_s(x1))``, ``y1 = F(x1) + BN(conv1x1_s(x2))`` with ``F`` a
  :class:`BottleneckResidual` of stride ``s``: streams ``[B, H, W, C_in]`` ->
  ``[B, H/s, W/s, C]`` with ``C = features``.
  """
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
  """The RevNet block stages (between stem and head).

  Group ``g`` has ``spec.blocks_per_group[g]`` blocks, bottleneck width
  ``width * 2**g`` and stream width ``spec.expansion`` times that. Its first
  block downsamples (groups 1.., and group 0 with bottlenecks, at stride 1):
  non-reversible unless ``spec.invertible_downsampling``
  (:func:`invertible_downsample`); the others are reversible.
  """
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
  """Group ``g``'s first block, reversible: ``pre`` then the group's coupling.

  Streams of ``c_in`` channels in, ``c`` out. Group 0 (RevNet50's stride-1
  block) zero-pads the channels; later groups halve the resolution with
  ``psi`` on ``c / 4`` channels per stream and set the rest aside.
  """
  if g == 0:
    pre = invertible.InjectivePad(c_in, c)
  else:
    pre = invertible.InvertibleDownsample(c_in, c)
  module = BottleneckResidual(c, hidden) if spec.bottleneck else BasicResidual(c)
  return Stage(f"group{g}_down", module, reversible=True, pre=pre)
