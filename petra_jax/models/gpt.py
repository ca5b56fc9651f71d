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
import jax
import jax.numpy as jnp

from petra_jax.engine.stages.stage import Stage
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


def gelu(x):
  """Exact GELU ``x Phi(x) = x (1 + erf(x / sqrt 2)) / 2`` (torch's ``nn.GELU()``, nanoGPT's).

  The same function as ``nn.gelu(x, approximate=False)``, written with ``erf`` rather than
  its ``erfc``, which XLA:CPU computes more slowly (docs/benchmarks.md, ``gpt_nano``).
  """
  return 0.5 * x * (1.0 + jax.lax.erf(x * (2.0 ** -0.5)))


class Weights(nn.Module):
  """A Dense's variables, returned unused: ``kernel`` of ``shape`` (nanoGPT's init) and a zero
  ``bias`` of ``shape[-out_dims:]`` (flax's ``DenseGeneral`` layout)."""
  shape: tuple
  out_dims: int = 1

  @nn.compact
  def __call__(self):
    return (self.param("kernel", init, self.shape),
            self.param("bias", nn.initializers.zeros, self.shape[-self.out_dims:]))


class CausalSelfAttention(nn.Module):
  """Causal multi-head self-attention ``[B, T, D] -> [B, T, D]`` with flax
  ``MultiHeadDotProductAttention``'s variables (``query``/``key``/``value`` kernels
  ``[D, heads, D / heads]``, ``out`` ``[heads, D / heads, D]``) and function:
  ``softmax(q k^T / sqrt(D / heads) + mask) v`` per head, position ``t`` attending to ``<= t``.

  Computed as one ``[B T, D] x [D, 3D]`` product for q, k, v and attention in ``[B, H, T, d]``
  (fewer, larger XLA ops than flax's per-projection einsums).
  """
  heads: int

  @nn.compact
  def __call__(self, x):
    b, t, d = x.shape
    hd = d // self.heads
    qkv = [Weights((d, self.heads, hd), 2, name=n)() for n in ("query", "key", "value")]
    w_out, b_out = Weights((self.heads, hd, d), 1, name="out")()
    w = jnp.concatenate([k.reshape(d, d) for k, _ in qkv], axis=1)
    bias = jnp.concatenate([bb.reshape(d) for _, bb in qkv])
    qkv = (x.reshape(b * t, d) @ w + bias).reshape(b, t, 3, self.heads, hd)
    q, k, v = qkv.transpose(2, 0, 3, 1, 4)                      # each [B, H, T, d]
    scores = (q / jnp.sqrt(hd).astype(q.dtype)) @ k.swapaxes(-1, -2)  # [B, H, T, T]
    causal = jnp.tril(jnp.ones((t, t), bool))
    scores = jnp.where(causal, scores, jnp.finfo(scores.dtype).min)
    y = (jax.nn.softmax(scores, axis=-1) @ v).transpose(0, 2, 1, 3).reshape(b * t, d)
    return (y @ w_out.reshape(d, d) + b_out).reshape(b, t, d)


class CausalAttention(nn.Module):
  """``F = causal MHSA . LayerNorm``: ``[B, T, D] -> [B, T, D]``; position ``t`` attends
  to positions ``<= t`` only."""
  heads: int

  @nn.compact
  def __call__(self, x, train: bool = True):
    del train
    h = nn.LayerNorm(epsilon=1e-5)(x)
    return CausalSelfAttention(self.heads, name="MultiHeadDotProductAttention_0")(h)


class Mlp(nn.Module):
  """``G = Dense . GELU . Dense(mlp_ratio D) . LayerNorm``: ``[B, T, D] -> [B, T, D]``
  (exact GELU, :func:`gelu`; the Denses on ``[B T, D]``)."""
  mlp_ratio: int = 4

  @nn.compact
  def __call__(self, x, train: bool = True):
    del train
    b, t, d = x.shape
    h = nn.LayerNorm(epsilon=1e-5)(x).reshape(b * t, d)
    h = gelu(nn.Dense(self.mlp_ratio * d, kernel_init=init)(h))
    return nn.Dense(d, kernel_init=init)(h).reshape(b, t, d)


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
