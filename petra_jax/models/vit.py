"""Vision transformers: reversible (``revvit_tiny/small``) and plain (``vit_tiny/small``).

A RevViT layer (Mangalam et al., CVPR 2022) is two couplings ``(y1, y2) = (x2 + H(x1),
x1)``, attention then MLP, on tokens ``float32[B, N, heads * width]`` per stream.
"""

from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp

from petra_jax.engine.stages.stage import Stage
from petra_jax.models.model_spec import ModelSpec

dense_init = nn.initializers.xavier_uniform()


class AttentionResidual(nn.Module):
  """``F = MHSA . LayerNorm``: ``[B, N, D] -> [B, N, D]``, ``heads`` heads of ``D / heads``."""
  heads: int

  @nn.compact
  def __call__(self, x, train: bool = True):
    del train
    h = nn.LayerNorm(epsilon=1e-6)(x)
    return nn.MultiHeadDotProductAttention(num_heads=self.heads, kernel_init=dense_init)(h, h)


class MlpResidual(nn.Module):
  """``G = Dense . GELU . Dense(mlp_ratio D) . LayerNorm``: ``[B, N, D] -> [B, N, D]``."""
  mlp_ratio: int = 4

  @nn.compact
  def __call__(self, x, train: bool = True):
    del train
    d = x.shape[-1]
    h = nn.LayerNorm(epsilon=1e-6)(x)
    h = nn.gelu(nn.Dense(self.mlp_ratio * d, kernel_init=dense_init)(h))
    return nn.Dense(d, kernel_init=dense_init)(h)


class PlainResidual(nn.Module):
  """A non-reversible pre-norm transformer block: ``x + H(x)`` on one stream."""
  residual: nn.Module

  @nn.compact
  def __call__(self, x, train: bool = True):
    return x + self.residual(x, train)


class PatchEmbed(nn.Module):
  """Stem: image ``[B, H, W, C]`` -> ``patch``-strided conv -> tokens ``[B, N, dim]``.

  Raises (when traced):
    ValueError: ``H`` or ``W`` not a multiple of ``patch``.
  """
  dim: int
  patch: int
  two_streams: bool = True

  @nn.compact
  def __call__(self, x, train: bool = True):
    del train
    _, h, w, _ = x.shape
    if h % self.patch or w % self.patch:
      raise ValueError(f"image {h}x{w} does not split into {self.patch}x{self.patch} patches; "
                       "use a patch size dividing the image size.")
    x = nn.Conv(self.dim, (self.patch, self.patch), strides=(self.patch, self.patch),
                padding="VALID")(x)
    return embed_tokens(self, x)


def embed_tokens(stem: nn.Module, x):
  """``[B, h, w, D]`` -> tokens ``[B, h w, D]`` + ``pos_embed``; ``(t, t)`` for two streams."""
  t = x.reshape(x.shape[0], -1, x.shape[-1])
  pos = stem.param("pos_embed", nn.initializers.normal(0.02), (1, *t.shape[1:]))
  t = t + pos.astype(t.dtype)
  return (t, t) if stem.two_streams else t


class ConvTokenizer(PatchEmbed):
  """CCT's tokenizer (Hassani et al., 2021): ``log2(patch)`` x (conv3x3 + ReLU +
  max-pool/2), then tokens as :class:`PatchEmbed`.

  Raises (when traced):
    ValueError: ``patch`` not a power of two >= 2 dividing ``H`` and ``W``.
  """

  @nn.compact
  def __call__(self, x, train: bool = True):
    del train
    _, h, w, _ = x.shape
    layers = self.patch.bit_length() - 1
    if self.patch < 2 or 2 ** layers != self.patch or h % self.patch or w % self.patch:
      raise ValueError(f"the conv tokenizer needs a power-of-two patch (>= 2) dividing the "
                       f"{h}x{w} image, got {self.patch}; set --config.model.patch_size.")
    for i in range(layers):
      ch = self.dim if i == layers - 1 else max(16, self.dim // 2)
      x = nn.relu(nn.Conv(ch, (3, 3), padding="SAME", use_bias=False)(x))
      x = nn.max_pool(x, (3, 3), strides=(2, 2), padding="SAME")
    return embed_tokens(self, x)


TOKENIZERS = {"patch": PatchEmbed, "conv": ConvTokenizer}


class TokenHead(nn.Module):
  """Streams ``[B, N, D]`` (concatenated) -> token mean -> LayerNorm -> logits ``[B, K]``."""
  num_classes: int

  @nn.compact
  def __call__(self, x, train: bool = True):
    del train
    if isinstance(x, (tuple, list)):
      x = jnp.concatenate(x, axis=-1)
    h = nn.LayerNorm(epsilon=1e-6)(x.mean(axis=1))
    return nn.Dense(self.num_classes, kernel_init=dense_init)(h)


def vit_stages(spec: ModelSpec, width: int, num_classes: int, patch: int,
               tokenizer: str = "patch") -> list[Stage]:
  """``[stem, layer0_attn, layer0_mlp, ..., head]``: ``2 layers + 2`` stages.

  Raises:
    ValueError: an unknown ``tokenizer`` (a key of :data:`TOKENIZERS`).
  """
  if tokenizer not in TOKENIZERS:
    raise ValueError(f"Unknown tokenizer {tokenizer!r}; choose one of {sorted(TOKENIZERS)} "
                     "(--config.model.tokenizer).")
  dim, rev = spec.heads * width, spec.reversible
  stem = TOKENIZERS[tokenizer](dim, patch, two_streams=rev)
  stages = [Stage("stem", stem, reversible=False)]
  for i in range(spec.blocks_per_group[0]):
    for kind, f in (("attn", AttentionResidual(spec.heads)), ("mlp", MlpResidual(spec.mlp_ratio))):
      module = f if rev else PlainResidual(f)
      stages.append(Stage(f"layer{i}_{kind}", module, reversible=rev))
  return stages + [Stage("head", TokenHead(num_classes), reversible=False)]
