"""ResNets and reversible networks (RevNets) split into PETRA stages.

A model is a list of :class:`~petra_jax.engine.stage.Stage` objects, one residual
block per stage, as in the paper (Sec. 4, "Model adaptations"): 10 stages for
the 18-layer models (stem, 8 blocks, head), 18 for the 34- and 50-layer ones
(stem, 16 blocks, head).

RevNets (``revnet18/34/50``). Activations between stages are *two streams*
``(x1, x2)``, each ``float32[B, H, W, C]``: the stem's ``2C`` output channels
are split in half, the image is not duplicated.

* Reversible stages hold only the residual function ``F`` (one stream in, one
  out); the coupling ``(y1, y2) = (x2 + F(x1), x1)`` and its inverse live in
  :mod:`petra_jax.engine.stage` (paper Fig. 2).
* Non-reversible stages (stem, downsampling, head) are ordinary Flax modules
  on the whole activation; PETRA buffers their input and recomputes.

ResNets (``resnet18/34/50``) are the torchvision models (v1.5 bottleneck,
stride on the 3x3 conv) on a single ``[B, H, W, C]`` tensor; every stage is
non-reversible. They are the paper's backprop baselines.

Architectures follow the authors' code (``../shared/reference``), with two
documented choices: convolutions have no bias (a BatchNorm follows each one),
and the basic downsampling block's ``y2`` is the clean ``BN(conv(x1))`` (the
reference's post-ReLU ``y2`` comes from in-place aliasing).

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

Run ``python -m petra_jax.models NAME --dataset=cifar10 [--width=W] [--depth=N] [--json]``
to print the stages, their output shapes and parameter counts.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import sys
from typing import Optional, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

from petra_jax.models import invertible
from petra_jax.engine import stage as stage_lib
from petra_jax.engine.stage import Stage

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


def _conv_bn(x, features: int, kernel: int, stride: int, train: bool):
  """``BN(conv_kxk stride s (x))``: ``[B, H, W, C_in] -> [B, H/s, W/s, features]``."""
  x = _Conv(features, (kernel, kernel), strides=(stride, stride))(x)
  return _BatchNorm(use_running_average=not train)(x)


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
      x = _Conv(channels, (7, 7), strides=(2, 2))(x)
    else:
      x = _Conv(channels, (3, 3))(x)
    x = nn.relu(_BatchNorm(use_running_average=not train)(x))
    if self.imagenet and self.two_streams:
      x = nn.max_pool(x, (2, 2), strides=(2, 2))
    elif self.imagenet:
      x = nn.max_pool(x, (3, 3), strides=(2, 2), padding=((1, 1), (1, 1)))
    if not self.two_streams:
      return x
    x1, x2 = jnp.split(x, 2, axis=-1)
    return x1, x2


# --- RevNet blocks -----------------------------------------------------------


class BasicResidual(nn.Module):
  """Residual function F of a reversible basic block, on one stream.

  ``F = ReLU . BN . conv3x3 . ReLU . BN . conv3x3``: ``[B, H, W, C] ->
  [B, H, W, C]`` with ``C = features`` (note the ReLU after the last BN, as in
  the authors' code).
  """
  features: int

  @nn.compact
  def __call__(self, x, train: bool = True):
    x = nn.relu(_conv_bn(x, self.features, 3, 1, train))
    return nn.relu(_conv_bn(x, self.features, 3, 1, train))


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
    y2 = _conv_bn(x1, self.features, 3, self.stride, train)
    h = nn.relu(_conv_bn(nn.relu(y2), self.features, 3, 1, train))
    return h + _conv_bn(x2, self.features, 1, self.stride, train), y2


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
    x = nn.relu(_conv_bn(x, self.hidden, 1, 1, train))
    x = nn.relu(_conv_bn(x, self.hidden, 3, self.stride, train))
    return nn.relu(_conv_bn(x, self.features, 1, 1, train))


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
    y2 = _conv_bn(x1, self.features, 1, self.stride, train)
    return f + _conv_bn(x2, self.features, 1, self.stride, train), y2


# --- ResNet blocks (torchvision layout) ---------------------------------------


class ResNetBasicBlock(nn.Module):
  """torchvision's BasicBlock: ``ReLU(BN(conv3x3(ReLU(BN(conv3x3_s(x))))) + sc)``.

  ``[B, H, W, C_in] -> [B, H/s, W/s, C]`` with ``C = features``; the shortcut
  ``sc`` is ``BN(conv1x1_s(x))`` when the shape changes, else ``x``.
  """
  features: int
  stride: int = 1

  @nn.compact
  def __call__(self, x, train: bool = True):
    h = nn.relu(_conv_bn(x, self.features, 3, self.stride, train))
    h = _conv_bn(h, self.features, 3, 1, train)
    if self.stride != 1 or x.shape[-1] != self.features:
      x = _conv_bn(x, self.features, 1, self.stride, train)
    return nn.relu(h + x)


class ResNetBottleneck(nn.Module):
  """torchvision's Bottleneck (v1.5, stride on the 3x3 conv).

  ``ReLU(BN(conv1x1(ReLU(BN(conv3x3_s(ReLU(BN(conv1x1(x))))))))) + sc)``:
  ``[B, H, W, C_in] -> [B, H/s, W/s, 4 * features]``; the shortcut is
  ``BN(conv1x1_s(x))`` when the shape changes, else ``x``.
  """
  features: int
  stride: int = 1
  expansion: int = 4

  @nn.compact
  def __call__(self, x, train: bool = True):
    out = self.expansion * self.features
    h = nn.relu(_conv_bn(x, self.features, 1, 1, train))
    h = nn.relu(_conv_bn(h, self.features, 3, self.stride, train))
    h = _conv_bn(h, out, 1, 1, train)
    if self.stride != 1 or x.shape[-1] != out:
      x = _conv_bn(x, out, 1, self.stride, train)
    return nn.relu(h + x)


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
    return nn.Dense(self.num_classes, kernel_init=_torch_default_init,
                    bias_init=_torch_bias_init(h.shape[-1]))(h)


# --- Model specs ------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ModelSpec:
  """How to build a model.

  Attributes:
    family: ``"revnet"`` (two streams, reversible blocks) or ``"resnet"``
      (one tensor, every stage non-reversible).
    blocks_per_group: residual blocks per resolution group.
    bottleneck: bottleneck blocks (channel expansion 4) instead of basic ones.
    invertible_downsampling: downsampling blocks are reversible (i-RevNet's
      ``psi``, :mod:`petra_jax.models.invertible`) instead of buffered.
    fixed_size: one group, no downsampling, its block count set by
      ``build_model``'s ``depth`` (``blocks_per_group`` holds the default).
  """
  family: str
  blocks_per_group: Sequence[int]
  bottleneck: bool = False
  invertible_downsampling: bool = False
  fixed_size: bool = False

  @property
  def reversible(self) -> bool:
    """Whether the model has reversible stages."""
    return self.family == "revnet"

  @property
  def expansion(self) -> int:
    """Output channels of a block over its base width."""
    return 4 if self.bottleneck else 1


# Blocks per group, stages = stem + sum(blocks) + head. RevNets: the first
# block of groups 2.. (and of group 1 with bottlenecks) is a non-reversible
# downsampling block, counted in the group. Reference notes: RevNet18 = stem +
# [2 rev] + [ds + rev] x 3 + head; RevNet34 = stem + [3 rev] + [ds + 3 rev] +
# [ds + 5 rev] + [ds + 2 rev] + head; RevNet50 = stem + [ds(stride 1) + 2] +
# [ds + 3] + [ds + 5] + [ds + 2] + head.
MODEL_SPECS = {
    "resnet18": ModelSpec("resnet", (2, 2, 2, 2)),
    "resnet34": ModelSpec("resnet", (3, 4, 6, 3)),
    "resnet50": ModelSpec("resnet", (3, 4, 6, 3), bottleneck=True),
    "revnet18": ModelSpec("revnet", (2, 2, 2, 2)),
    "revnet34": ModelSpec("revnet", (3, 4, 6, 3)),
    "revnet50": ModelSpec("revnet", (3, 4, 6, 3), bottleneck=True),
    # The same with reversible (invertible) downsampling blocks.
    "revnet18_inv": ModelSpec("revnet", (2, 2, 2, 2), invertible_downsampling=True),
    "revnet34_inv": ModelSpec("revnet", (3, 4, 6, 3), invertible_downsampling=True),
    "revnet50_inv": ModelSpec("revnet", (3, 4, 6, 3), bottleneck=True,
                              invertible_downsampling=True),
    # Stem + depth reversible blocks + head; default depth 20 (the authors'
    # main_fixed_size.py --n-layers).
    "revnet_fixed": ModelSpec("revnet", (20,), fixed_size=True),
}

# Model name -> "revnet" | "resnet": lets the trainer tell reversible models
# (PETRA can reconstruct) from plain ones (backprop / delayed-gradient only).
MODEL_FAMILY = {name: spec.family for name, spec in MODEL_SPECS.items()}


# The data sets' input shapes, classes and stems: the one registry, in data.py.
from petra_jax.data import DATASETS  # noqa: E402  pylint: disable=g-import-not-at-top


def _unknown_model_message(name: str) -> str:
  return f"Unknown model {name!r}; choose one of {sorted(MODEL_SPECS)}."


def build_model(name: str, *, width: int = 64, num_classes: int = 10,
                imagenet_stem: bool = False, depth: Optional[int] = None) -> list[Stage]:
  """Builds the stage list of a model, one residual block per stage.

  Args:
    name: one of ``MODEL_SPECS`` (``resnet18/34/50``, ``revnet18/34/50``,
      ``revnet18_inv/34_inv/50_inv``, ``revnet_fixed``).
    width: base channels (the paper's 64): per stream after the stem for
      RevNets, of the stem's output for ResNets; group ``g`` has base width
      ``width * 2**g`` (times 4 at block outputs for the 50-layer models).
      ``revnet_fixed`` keeps ``width`` throughout; the ``_inv`` models need
      an even width (checked when traced).
    num_classes: classes of the head.
    imagenet_stem: 7x7/2 conv + max-pool stem instead of the CIFAR 3x3 one.
    depth: reversible blocks of ``revnet_fixed`` (``config.model.depth``);
      None for the model's default (20). Only fixed-size models take it.

  Returns:
    ``[stem, block, ..., head]``: 10 stages for the 18-layer models, 18 for
    the 34- and 50-layer ones, ``depth + 2`` for ``revnet_fixed``.

  Raises:
    ValueError: unknown ``name``, ``width < 1``, ``depth < 1``, or a
      ``depth`` for a model whose block counts are fixed.
  """
  if name not in MODEL_SPECS:
    raise ValueError(f"{_unknown_model_message(name)} (--config.model.name=...)")
  if width < 1:
    raise ValueError(f"model.width must be >= 1, got {width}.")
  spec = MODEL_SPECS[name]
  if depth is not None:
    fixed = sorted(n for n, s in MODEL_SPECS.items() if s.fixed_size)
    if not spec.fixed_size:
      raise ValueError(f"model.depth applies to {fixed} only; {name} has fixed block counts.")
    if depth < 1:
      raise ValueError(f"model.depth must be >= 1, got {depth}.")
    spec = dataclasses.replace(spec, blocks_per_group=(depth,))
  build = _revnet_blocks if spec.reversible else _resnet_blocks
  stem = Stem(width, imagenet=imagenet_stem, two_streams=spec.reversible)
  return ([Stage("stem", stem, reversible=False)] + build(spec, width) +
          [Stage("head", Head(num_classes), reversible=False)])


def _revnet_blocks(spec: ModelSpec, width: int) -> list[Stage]:
  """The RevNet block stages: downsampling (non-reversible unless
  ``spec.invertible_downsampling``) and reversible."""
  stages, c_in = [], width
  for g, n in enumerate(spec.blocks_per_group):
    hidden = width * 2**g
    c = spec.expansion * hidden
    for b in range(n):
      if b == 0 and (spec.bottleneck or g > 0) and spec.invertible_downsampling:
        stages.append(_invertible_downsample(spec, g, c_in, c, hidden))
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


def _invertible_downsample(spec: ModelSpec, g: int, c_in: int, c: int, hidden: int) -> Stage:
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


def _resnet_blocks(spec: ModelSpec, width: int) -> list[Stage]:
  """The ResNet block stages, all non-reversible."""
  block = ResNetBottleneck if spec.bottleneck else ResNetBasicBlock
  stages = []
  for g, n in enumerate(spec.blocks_per_group):
    for b in range(n):
      stride = 2 if (b == 0 and g > 0) else 1
      stages.append(Stage(f"group{g}_block{b}", block(width * 2**g, stride),
                          reversible=False))
  return stages


def supports_reversible(stages: Sequence[Stage]) -> bool:
  """Whether any block is reversible (PETRA's input reconstruction applies)."""
  return any(b.reversible for s in stages for b in (s.blocks or (s,)))


# --- Stage balancing -------------------------------------------------------------


def group_stages(blocks: Sequence[Stage], sizes: Sequence[int]) -> list[Stage]:
  """Groups consecutive blocks into stages: stage ``g`` runs ``sizes[g]`` blocks.

  Args:
    blocks: a model from :func:`build_model` (one block per stage).
    sizes: blocks per stage, each >= 1, summing to ``len(blocks)``.

  Returns:
    ``len(sizes)`` stages (:func:`petra_jax.engine.stage.group`).

  Raises:
    ValueError: sizes that do not cover the blocks exactly, fewer than 2
      stages, or more stages than blocks.
  """
  sizes = [int(n) for n in sizes]
  if len(sizes) > len(blocks):
    raise ValueError(f"{len(sizes)} stages but the model has only {len(blocks)} blocks; "
                     f"use --config.model.num_stages <= {len(blocks)}.")
  if len(sizes) < 2 or min(sizes) < 1 or sum(sizes) != len(blocks):
    raise ValueError(f"model.stage_sizes={tuple(sizes)} must be >= 2 positive counts summing "
                     f"to the model's {len(blocks)} blocks.")
  out, i = [], 0
  for n in sizes:
    out.append(stage_lib.group(blocks[i:i + n]))
    i += n
  return out


def block_flops(blocks: Sequence[Stage], input_shape: Sequence[int]) -> list[float]:
  """Forward FLOPs of each block on a ``float32[input_shape]`` batch.

  From XLA's cost analysis of the lowered forward (nothing is compiled or
  run). A block's backward (recompute or reconstruct, then vjp) costs about
  three forwards whatever its kind, so forward FLOPs rank the blocks' tick
  costs.
  """
  x = jax.ShapeDtypeStruct(tuple(input_shape), jnp.float32)
  flops = []
  for s, (variables, y) in zip(blocks, stage_lib.trace(blocks, x)):
    fwd = lambda v, x, s=s: stage_lib.forward(s, v["params"], v["batch_stats"], x)[0]
    cost = jax.jit(fwd).lower(variables, x).cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    flops.append(float((cost or {}).get("flops", 0.0)))
    x = y
  return flops


def balanced_stage_sizes(blocks: Sequence[Stage], num_stages: int,
                         input_shape: Sequence[int],
                         costs: Optional[Sequence[float]] = None) -> list[int]:
  """Blocks per stage that minimise the slowest stage's cost.

  Args:
    blocks: a model from :func:`build_model` (one block per stage).
    num_stages: ``J'``, the stages to group the blocks into.
    input_shape: a micro-batch's shape ``[B, H, W, C]`` (for the FLOPs).
    costs: per-block cost, e.g. measured ms per tick
      (:func:`petra_jax.engine.timing.measure_stage_costs`); default: forward FLOPs
      (:func:`block_flops`).

  Returns:
    ``num_stages`` block counts (each >= 1, summing to ``len(blocks)``) for
    :func:`group_stages`.

  Raises:
    ValueError: ``num_stages`` outside ``[2, len(blocks)]``, or ``costs`` of
      the wrong length.
  """
  from petra_jax.engine import partition  # pylint: disable=g-import-not-at-top
  if not 2 <= num_stages <= len(blocks):
    raise ValueError(f"num_stages={num_stages} must be in [2, {len(blocks)}] (the model has "
                     f"{len(blocks)} blocks); use --config.model.num_stages <= {len(blocks)}.")
  if costs is None:
    costs = block_flops(blocks, input_shape)
  if len(costs) != len(blocks):
    raise ValueError(f"{len(costs)} costs for {len(blocks)} blocks.")
  groups, _ = partition.balanced_partition(costs, num_stages)
  return partition.group_sizes(groups)


# --- Summaries and CLI ---------------------------------------------------------


def stage_summaries(stages: Sequence[Stage], image_shape: Sequence[int]) -> list[dict]:
  """Per-stage output shape and parameter count, without allocating weights.

  Shapes are traced with :func:`jax.eval_shape` on a batch of one, so this is
  fast even for ImageNet-size models.

  Args:
    stages: a model from :func:`build_model`.
    image_shape: ``(H, W, C)`` of the input image.

  Returns:
    One dict per stage: ``index``, ``name``, ``kind`` (``"reversible"`` or
    ``"non-reversible"``), ``output_shape`` (per stream, without the batch:
    ``[H, W, C]``, or ``[num_classes]`` for the head) and ``params`` (number of
    trainable parameters; BatchNorm statistics excluded). Where the output
    carries arrays after the streams (invertible downsampling), also
    ``carried_shapes``: their ``[H, W, C]``s.
  """
  x = jax.ShapeDtypeStruct((1, *image_shape), jnp.float32)
  rows = []
  for i, (s, (variables, y)) in enumerate(zip(stages, stage_lib.trace(stages, x))):
    out = y[0] if isinstance(y, tuple) else y
    rows.append({
        "index": i,
        "name": s.name,
        "kind": "reversible" if s.reversible else "non-reversible",
        "output_shape": list(out.shape[1:]),
        "params": sum(math.prod(p.shape) for p in jax.tree.leaves(variables["params"])),
    })
    if isinstance(y, tuple) and len(y) > 2:
      rows[-1]["carried_shapes"] = [list(c.shape[1:]) for c in y[2:]]
  return rows


def count_params(stages: Sequence[Stage], image_shape: Sequence[int]) -> int:
  """Total trainable parameters of a model on ``image_shape = (H, W, C)``."""
  return sum(r["params"] for r in stage_summaries(stages, image_shape))


def summarize(name: str, dataset: str, width: int = 64, depth: Optional[int] = None) -> dict:
  """The CLI's JSON: ``{"total_params": int, "stages": [...]}``.

  The dataset fixes the input size, the stem and the classes (``DATASETS``);
  stages are as in :func:`stage_summaries`; ``depth`` as in
  :func:`build_model`.

  Raises:
    ValueError: unknown ``name`` or ``dataset``.
  """
  if dataset not in DATASETS:
    raise ValueError(f"Unknown dataset {dataset!r}; choose one of {sorted(DATASETS)}.")
  d = DATASETS[dataset]
  stages = build_model(name, width=width, num_classes=d.num_classes,
                       imagenet_stem=d.imagenet_stem, depth=depth)
  rows = stage_summaries(stages, d.image_shape)
  return {"total_params": sum(r["params"] for r in rows), "stages": rows}


def main(argv: Sequence[str] | None = None) -> int:
  """``python -m petra_jax.models NAME --dataset=D [--width=W] [--depth=N] [--json]``."""
  parser = argparse.ArgumentParser(
      prog="python -m petra_jax.models",
      description="Print a model's PETRA stages, output shapes (per stream, "
                  "[H, W, C]) and parameter counts.")
  parser.add_argument("name", help=f"model: one of {sorted(MODEL_SPECS)}")
  parser.add_argument("--dataset", choices=sorted(DATASETS), default="cifar10",
                      help="fixes input size, stem and classes (default cifar10)")
  parser.add_argument("--width", type=int, default=64, help="base width (default 64)")
  parser.add_argument("--depth", type=int, default=None,
                      help="reversible blocks of a fixed-size model (revnet_fixed; default 20)")
  parser.add_argument("--json", action="store_true", help="print JSON")
  args = parser.parse_args(argv)
  if args.name not in MODEL_SPECS:
    print(f"error: {_unknown_model_message(args.name)}", file=sys.stderr)
    return 2
  if args.width < 1:
    print(f"error: --width must be >= 1, got {args.width}.", file=sys.stderr)
    return 2
  try:
    summary = summarize(args.name, args.dataset, args.width, args.depth)
  except ValueError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  if args.json:
    print(json.dumps(summary))
    return 0
  family = MODEL_FAMILY[args.name]
  print(f"{args.name} ({family}) on {args.dataset}, width {args.width}: "
        f"{len(summary['stages'])} stages")
  shapes = []
  for r in summary["stages"]:
    shape = "x".join(map(str, r["output_shape"]))
    if family == "revnet" and r["name"] != "head":
      shape = f"2 x {shape}"
    if r.get("carried_shapes"):
      shape += " + " + ", ".join("x".join(map(str, c)) for c in r["carried_shapes"])
    shapes.append(shape)
  col = max(22, *map(len, shapes))
  print(f"{'idx':>3}  {'name':<14} {'kind':<15} {'output (HxWxC)':<{col}} {'params':>12}")
  for r, shape in zip(summary["stages"], shapes):
    print(f"{r['index']:>3}  {r['name']:<14} {r['kind']:<15} {shape:<{col}} {r['params']:>12,}")
  if any(r.get("carried_shapes") for r in summary["stages"]):
    print("(after '+': arrays set aside by invertible downsampling, carried to the head)")
  print(f"total: {summary['total_params']:,} parameters")
  return 0

