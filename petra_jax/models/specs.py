"""The model registry: each model's spec, its family, and :func:`build_model`.

A model is a list of :class:`~petra_jax.engine.stage.Stage` objects, one
residual block per stage, as in the paper (Sec. 4, "Model adaptations"): 10
stages for the 18-layer models (stem, 8 blocks, head), 18 for the 34- and
50-layer ones (stem, 16 blocks, head).
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

from petra_jax.engine.stage import Stage
from petra_jax.models.layers import Head, Stem
from petra_jax.models.resnet import resnet_blocks
from petra_jax.models.revnet import revnet_blocks
from petra_jax.models.vit import vit_stages


REVERSIBLE_FAMILIES = ("revnet", "revvit")


@dataclasses.dataclass(frozen=True)
class ModelSpec:
  """How to build a model.

  Attributes:
    family: ``"revnet"`` (two streams, reversible blocks), ``"resnet"``
      (one tensor, every stage non-reversible), ``"revvit"`` (two token
      streams, reversible attention and MLP blocks) or ``"vit"`` (its
      non-reversible twin); :mod:`petra_jax.models.vit`.
    blocks_per_group: residual blocks per resolution group.
    bottleneck: bottleneck blocks (channel expansion 4) instead of basic ones.
    invertible_downsampling: downsampling blocks are reversible (i-RevNet's
      ``psi``, :mod:`petra_jax.models.invertible`) instead of buffered.
    fixed_size: one group, no downsampling, its block count set by
      ``build_model``'s ``depth`` (``blocks_per_group`` holds the default;
      transformer layers for the ViTs).
    heads: attention heads of a ViT (0 for convolutional models).
    mlp_ratio: a ViT's MLP hidden width over its embedding width.
  """
  family: str
  blocks_per_group: Sequence[int]
  bottleneck: bool = False
  invertible_downsampling: bool = False
  fixed_size: bool = False
  heads: int = 0
  mlp_ratio: int = 4

  @property
  def reversible(self) -> bool:
    """Whether the model has reversible stages."""
    return self.family in REVERSIBLE_FAMILIES

  @property
  def transformer(self) -> bool:
    """Whether the model is a (Rev)ViT (:mod:`petra_jax.models.vit`)."""
    return self.family in ("revvit", "vit")

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
    # Vision transformers (petra_jax.models.vit): depth = transformer layers
    # (default 12, two blocks each), width = dimension per head.
    "revvit_tiny": ModelSpec("revvit", (12,), fixed_size=True, heads=3),
    "revvit_small": ModelSpec("revvit", (12,), fixed_size=True, heads=6),
    "vit_tiny": ModelSpec("vit", (12,), fixed_size=True, heads=3),
    "vit_small": ModelSpec("vit", (12,), fixed_size=True, heads=6),
}

# Model name -> "revnet" | "resnet" | "revvit" | "vit"; reversible models
# (PETRA can reconstruct) are those of REVERSIBLE_FAMILIES, the others run
# backprop / delayed-gradient methods only.
MODEL_FAMILY = {name: spec.family for name, spec in MODEL_SPECS.items()}


def unknown_model_message(name: str) -> str:
  """The error text for a model name not in :data:`MODEL_SPECS`."""
  return f"Unknown model {name!r}; choose one of {sorted(MODEL_SPECS)}."


def default_patch_size(imagenet_stem: bool) -> int:
  """A ViT's patch when none is configured: 16 on ImageNet-size images (the
  ViT paper's), 4 on 32 x 32 ones (64 tokens)."""
  return 16 if imagenet_stem else 4


def _resolve_spec(name: str, depth: Optional[int]) -> ModelSpec:
  """``MODEL_SPECS[name]``, with ``depth`` blocks if a fixed-size model.

  Raises:
    ValueError: a ``depth`` for a model with fixed block counts, or
      ``depth < 1``.
  """
  spec = MODEL_SPECS[name]
  if depth is None:
    return spec
  fixed = sorted(n for n, s in MODEL_SPECS.items() if s.fixed_size)
  if not spec.fixed_size:
    raise ValueError(f"model.depth applies to {fixed} only; {name} has fixed block counts.")
  if depth < 1:
    raise ValueError(f"model.depth must be >= 1, got {depth}.")
  return dataclasses.replace(spec, blocks_per_group=(depth,))


def build_model(name: str, *, width: int = 64, num_classes: int = 10,
                imagenet_stem: bool = False, depth: Optional[int] = None,
                patch_size: Optional[int] = None, tokenizer: str = "patch") -> list[Stage]:
  """Builds the stage list of a model, one residual block per stage.

  Args:
    name: one of ``MODEL_SPECS`` (``resnet18/34/50``, ``revnet18/34/50``,
      ``revnet18_inv/34_inv/50_inv``, ``revnet_fixed``, ``revvit_tiny/small``,
      ``vit_tiny/small``).
    width: base channels (the paper's 64): per stream after the stem for
      RevNets, of the stem's output for ResNets; group ``g`` has base width
      ``width * 2**g`` (times 4 at block outputs for the 50-layer models).
      ``revnet_fixed`` keeps ``width`` throughout; the ``_inv`` models need
      an even width (checked when traced). For the ViTs, the dimension per
      attention head (embedding ``heads * width``).
    num_classes: classes of the head.
    imagenet_stem: 7x7/2 conv + max-pool stem instead of the CIFAR 3x3 one.
    depth: reversible blocks of ``revnet_fixed`` (``config.model.depth``);
      None for the model's default (20). Only fixed-size models take it;
      for the ViTs it counts transformer layers (default 12).
    patch_size: a ViT's patch size (``config.model.patch_size``); None for
      the default (:func:`default_patch_size`). Other models ignore it.
    tokenizer: a ViT's stem, ``patch`` or ``conv`` (``config.model.tokenizer``,
      :data:`petra_jax.models.vit.TOKENIZERS`). Other models ignore it.

  Returns:
    ``[stem, block, ..., head]``: 10 stages for the 18-layer models, 18 for
    the 34- and 50-layer ones, ``depth + 2`` for ``revnet_fixed``,
    ``2 depth + 2`` for the ViTs.

  Raises:
    ValueError: unknown ``name``, ``width < 1``, ``depth < 1``, a
      ``depth`` for a model whose block counts are fixed, or an unknown
      ``tokenizer``.
  """
  if name not in MODEL_SPECS:
    raise ValueError(f"{unknown_model_message(name)} (--config.model.name=...)")
  if width < 1:
    raise ValueError(f"model.width must be >= 1, got {width}.")
  spec = _resolve_spec(name, depth)
  if spec.transformer:
    return vit_stages(spec, width, num_classes, patch_size or default_patch_size(imagenet_stem),
                      tokenizer)
  build = revnet_blocks if spec.reversible else resnet_blocks
  stem = Stem(width, imagenet=imagenet_stem, two_streams=spec.reversible)
  return ([Stage("stem", stem, reversible=False)] + build(spec, width) +
          [Stage("head", Head(num_classes), reversible=False)])
