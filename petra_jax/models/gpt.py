"""Decoder-only language models: reversible (``revgpt_*``) and plain (``gpt_*``, nanoGPT's layout).

Characters ``int32[B, T]`` -> token + learned position embeddings (a non-reversible
stem) -> per layer a causal self-attention then an MLP residual -> LayerNorm and a
Dense over the vocabulary at every position: logits ``float32[B, T, V]``.

``revgpt``: each residual is a RevViT coupling ``(y1, y2) = (x2 + H(x1), x1)``
(Mangalam et al., CVPR 2022) on two streams ``float32[B, T, D]``, both the
embedding at the stem; the head reads the streams concatenated (``[B, T, 2D]``).
No dropout: the reconstruction ``x1 = y2, x2 = y1 - H(y2)`` is exact.
``gpt``: pre-LayerNorm blocks ``x + H(LN(x))`` (nanoGPT), one stream; no weight tying
(embedding and head live on different stages).
"""

from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp

from petra_jax.engine.stage import Stage
from petra_jax.models.model_spec import ModelSpec
from petra_jax.models.vit import PlainResidual


init = nn.initializers.normal(0.02)  # nanoGPT's


class TokenEmbed(nn.Module):
  """Stem: ids ``[B, T]`` (int, or float holding integers) -> ``[B, T, dim]`` tokens +
  positions; ``(t, t)`` for two streams. Positions are learned up to the input's ``T``."""
  vocab_size: int
  dim: int
  two_streams: bool = True

  @nn.compact
  def __call__(self, ids, train: bool = True):
    del train
    t = nn.Embed(self.vocab_size, self.dim, embedding_init=init)(ids.astype(jnp.int32))
    pos = self.param("pos_embed", init, (1, ids.shape[1], self.dim))
    t = t + pos
    return (t, t) if self.two_streams else t


class CausalAttention(nn.Module):
  """``F = causal MHSA . LayerNorm``: ``[B, T, D] -> [B, T, D]``; position ``t`` attends
  to positions ``<= t`` only."""
  heads: int

  @nn.compact
  def __call__(self, x, train: bool = True):
    del train
    h = nn.LayerNorm(epsilon=1e-5)(x)
    mask = nn.make_causal_mask(jnp.ones(x.shape[:2], jnp.int32))
    return nn.MultiHeadDotProductAttention(num_heads=self.heads, kernel_init=init)(
        h, h, mask=mask)


class Mlp(nn.Module):
  """``G = Dense . GELU . Dense(mlp_ratio D) . LayerNorm``: ``[B, T, D] -> [B, T, D]``."""
  mlp_ratio: int = 4

  @nn.compact
  def __call__(self, x, train: bool = True):
    del train
    d = x.shape[-1]
    h = nn.LayerNorm(epsilon=1e-5)(x)
    h = nn.gelu(nn.Dense(self.mlp_ratio * d, kernel_init=init)(h), approximate=False)
    return nn.Dense(d, kernel_init=init)(h)


class LanguageHead(nn.Module):
  """Streams ``[B, T, D]`` (concatenated if two) -> LayerNorm -> Dense: logits ``[B, T, V]``."""
  vocab_size: int

  @nn.compact
  def __call__(self, x, train: bool = True):
    del train
    if isinstance(x, (tuple, list)):
      x = jnp.concatenate(x, axis=-1)
    return nn.Dense(self.vocab_size, kernel_init=init)(nn.LayerNorm(epsilon=1e-5)(x))


def gpt_stages(spec: ModelSpec, width: int, vocab_size: int) -> list[Stage]:
  """``[stem, layer0_attn, layer0_mlp, ..., head]``: ``2 layers + 2`` stages of
  ``D = heads * width`` features (``width`` per head, as the ViTs)."""
  dim, rev = spec.heads * width, spec.reversible
  stages = [Stage("stem", TokenEmbed(vocab_size, dim, two_streams=rev), reversible=False)]
  for i in range(spec.blocks_per_group[0]):
    for kind, f in (("attn", CausalAttention(spec.heads)), ("mlp", Mlp(spec.mlp_ratio))):
      stages.append(Stage(f"layer{i}_{kind}", f if rev else PlainResidual(f), reversible=rev))
  return stages + [Stage("head", LanguageHead(vocab_size), reversible=False)]
