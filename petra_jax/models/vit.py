"""Vision transformers: reversible (``revvit_tiny/small``) and plain (``vit_tiny/small``).

Reversible ViT (Mangalam et al., "Reversible Vision Transformers", CVPR 2022)
couples two token streams through attention ``F`` and MLP ``G``::

  Y1 = X1 + F(X2),   Y2 = X2 + G(Y1)

This project's coupling (:mod:`petra_jax.engine.stage`, paper Fig. 2) is
``(y1, y2) = (x2 + H(x1), x1)``, one residual function per block. A
transformer layer is two such blocks, the attention block (``H = F``) then the
MLP block (``H = G``): on streams ``(a1, a2) = (X2, X1)`` they give
``(X1 + F(X2), X2) = (Y1, X2)``, then ``(X2 + G(Y1), Y1) = (Y2, Y1)``, i.e.
RevViT's layer with the two streams swapped. Each block is one pipeline stage,
its inverse exact to float32 round-off (no BatchNorm, no dropout, no
drop-path: nothing random to replay in the reconstruction).

* ``F`` (:class:`AttentionResidual`) = LayerNorm + multi-head self-attention
  (Flax's ``MultiHeadDotProductAttention``); ``G`` (:class:`MlpResidual`) =
  LayerNorm + Dense(``mlp_ratio * D``) + GELU + Dense(``D``). Tokens are
  ``float32[B, N, D]`` per stream.
* Stem (non-reversible, ``config.model.tokenizer``): :class:`PatchEmbed`
  (``patch``, ViT's), a ``patch x patch`` stride-patch convolution to ``D``
  channels, or :class:`ConvTokenizer` (``conv``, CCT's), 3 x 3 convolutions
  and max-pools; either flattened to ``N = (H / patch) (W / patch)`` tokens,
  plus a learned position embedding; the reversible model duplicates the
  embedding into both streams, as RevViT does.
* Head (:class:`TokenHead`): the streams concatenated (``2D``), the mean over
  tokens, LayerNorm, Dense to the classes.

The non-reversible twins ``vit_tiny/small`` have the same stem, blocks and
head on one stream, each block the pre-norm residual ``x + H(x)``
(:class:`PlainResidual`): the ``backprop`` baseline of the same architecture
(its head sees ``D`` features, not ``2D``).

Sizes. ``width`` (``config.model.width``) is the dimension per attention
head, so the embedding has ``D = heads * width`` per stream; ``depth``
(``config.model.depth``) counts transformer layers (two blocks, two stages
each). At the defaults (``width`` 64, 12 layers, patch 4 on CIFAR-10's 32 x 32
images: 64 tokens) ``revvit_tiny`` (3 heads, D = 192, DeiT-Ti's widths) has
5.4M parameters and ``revvit_small`` (6 heads, D = 384, DeiT-S's) 21.3M; the
``vit_`` twins have the same up to the head. The CPU recipe
(``configs/cifar10_vit_cpu.py``) uses ``revvit_tiny`` at ``width`` 32 (D = 96)
and 4 layers: a few hundred thousand parameters.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import flax.linen as nn
import jax.numpy as jnp

from petra_jax.engine.stage import Stage

if TYPE_CHECKING:
  from petra_jax.models.specs import ModelSpec

dense_init = nn.initializers.xavier_uniform()


class AttentionResidual(nn.Module):
  """``F = MHSA . LayerNorm``: ``[B, N, D] -> [B, N, D]``, ``heads`` heads of ``D / heads``.

  Raises (when traced):
    ValueError: ``D`` not a multiple of ``heads`` (Flax's check).
  """
  heads: int

  @nn.compact
  def __call__(self, x, train: bool = True):
    del train
    h = nn.LayerNorm(epsilon=1e-6)(x)
    return nn.MultiHeadDotProductAttention(num_heads=self.heads, kernel_init=dense_init)(h, h)


class MlpResidual(nn.Module):
  """``G = Dense . GELU . Dense . LayerNorm``: ``[B, N, D] -> [B, N, D]``.

  The hidden layer has ``mlp_ratio * D`` units.
  """
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
  """Stem: image ``[B, H, W, C]`` -> tokens ``[B, N, dim]`` (+ position embedding).

  A ``patch x patch`` convolution of stride ``patch`` (with bias), flattened
  to ``N = (H / patch) (W / patch)`` tokens, plus a learned ``[1, N, dim]``
  position embedding (normal, std 0.02). With ``two_streams`` the tokens are
  returned twice, ``(t, t)`` (RevViT's duplication).

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
  """The stems' common end: ``[B, h, w, D]`` flattened to ``[B, h w, D]``
  tokens plus the stem's learned ``pos_embed`` ``[1, h w, D]`` (normal, std
  0.02), twice ``(t, t)`` if ``stem.two_streams`` (RevViT's duplication)."""
  t = x.reshape(x.shape[0], -1, x.shape[-1])
  pos = stem.param("pos_embed", nn.initializers.normal(0.02), (1, *t.shape[1:]))
  t = t + pos.astype(t.dtype)
  return (t, t) if stem.two_streams else t


class ConvTokenizer(PatchEmbed):
  """CCT's convolutional tokenizer (Hassani et al., "Escaping the Big Data
  Paradigm with Compact Transformers", 2021): image ``[B, H, W, C]`` ->
  tokens ``[B, N, dim]`` (+ position embedding), non-reversible.

  ``log2(patch)`` layers of 3 x 3 convolution (no bias) + ReLU + 3 x 3
  max-pool of stride 2, so ``N = (H / patch) (W / patch)`` as with
  :class:`PatchEmbed`; the hidden layers have ``dim / 2`` channels (at least
  16), the last ``dim``. No BatchNorm (the stem is non-reversible: it
  buffers its input under PETRA). With ``two_streams`` the tokens are
  returned twice.

  Fields as :class:`PatchEmbed`'s.

  Raises (when traced):
    ValueError: ``patch`` not a power of two >= 2, or ``H``, ``W`` not
      multiples of it.
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
  """Head: (concatenated streams) -> mean over tokens -> LayerNorm -> Dense.

  Takes ``(x1, x2)`` of ``[B, N, D]`` each (concatenated to ``2D``) or one
  ``[B, N, D]``; returns ``float32``-able logits ``[B, num_classes]``.
  """
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
  """``[stem, layer0_attn, layer0_mlp, ..., head]`` of a (Rev)ViT.

  Args:
    spec: a ``revvit``/``vit`` :class:`~petra_jax.models.specs.ModelSpec`;
      ``blocks_per_group[0]`` transformer layers, ``spec.heads`` heads.
    width: dimension per head; the embedding has ``D = heads * width``.
    num_classes: classes of the head.
    patch: patch size of the stem.
    tokenizer: the stem, a key of :data:`TOKENIZERS` (``patch``:
      :class:`PatchEmbed`; ``conv``: :class:`ConvTokenizer`).

  Returns:
    ``2 * layers + 2`` stages: reversible blocks for ``revvit``, plain
    residual blocks for ``vit``.

  Raises:
    ValueError: an unknown ``tokenizer``.
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
