"""i-RevNet's invertible downsampling (Jacobsen et al., ICLR 2018, Sec. 3.1) as a stage's ``pre``.

``psi``: ``[B, H, W, C] -> [B, H/2, W/2, 4C]``; activations ``(x1, x2, *carried)``.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


def space_to_depth(x_BxHxWxC: jax.Array) -> jax.Array:
  """``psi``: ``y[b, i, j, (2 di + dj) C + c] = x[b, 2i + di, 2j + dj, c]`` (H, W even)."""
  b, h, w, c = x_BxHxWxC.shape
  if h % 2 or w % 2:
    raise ValueError(f"space_to_depth needs an even height and width, got {h}x{w}; use an "
                     "input size divisible by 2 at every invertible downsampling.")
  x = x_BxHxWxC.reshape(b, h // 2, 2, w // 2, 2, c)
  return x.transpose(0, 1, 3, 2, 4, 5).reshape(b, h // 2, w // 2, 4 * c)


def depth_to_space(y_BxHxWx4C: jax.Array) -> jax.Array:
  """``psi^{-1}``: ``[B, H, W, 4C] -> [B, 2H, 2W, C]``, the inverse permutation."""
  b, h, w, c4 = y_BxHxWx4C.shape
  y = y_BxHxWx4C.reshape(b, h, w, 2, 2, c4 // 4).transpose(0, 1, 3, 2, 4, 5)
  return y.reshape(b, 2 * h, 2 * w, c4 // 4)


@dataclasses.dataclass(frozen=True)
class InvertibleDownsample:
  """``P (x1, x2, *c) = (psi(a1), psi(a2), *c, [b1 | b2])``, ``x_i = [a_i | b_i]``,
  ``a_i`` the first ``k = out_channels / 4`` channels; a permutation (``P^T = P^{-1}``)."""
  in_channels: int
  out_channels: int

  @property
  def keep(self) -> int:
    return self.out_channels // 4

  def _check(self, x1):
    if self.out_channels % 4 or not 1 <= self.keep <= self.in_channels:
      raise ValueError(
          f"invertible downsampling from {self.in_channels} to {self.out_channels} channels per "
          "stream needs out_channels = 4k with 1 <= k <= in_channels; use an even model width.")
    if x1.shape[-1] != self.in_channels:
      raise ValueError(f"expected streams of {self.in_channels} channels, got {x1.shape[-1]}.")

  def apply(self, x):
    x1, x2, *carried = x
    self._check(x1)
    k = self.keep
    out = (space_to_depth(x1[..., :k]), space_to_depth(x2[..., :k]), *carried)
    if k == self.in_channels:
      return out
    return (*out, jnp.concatenate([x1[..., k:], x2[..., k:]], axis=-1))

  def transpose(self, y):
    u1, u2, *carried = y
    a1, a2 = depth_to_space(u1), depth_to_space(u2)
    if self.keep == self.in_channels:
      return (a1, a2, *carried)
    *carried, b = carried
    b1, b2 = jnp.split(b, 2, axis=-1)
    return (jnp.concatenate([a1, b1], axis=-1), jnp.concatenate([a2, b2], axis=-1), *carried)


@dataclasses.dataclass(frozen=True)
class InjectivePad:
  """``P x_i = [x_i | 0]`` up to ``out_channels`` (injective); ``P^T`` drops the padding."""
  in_channels: int
  out_channels: int

  def apply(self, x):
    x1, x2, *carried = x
    if x1.shape[-1] != self.in_channels or self.out_channels < self.in_channels:
      raise ValueError(f"cannot pad streams of {x1.shape[-1]} channels from {self.in_channels} "
                       f"to {self.out_channels}.")
    pad = [(0, 0)] * (x1.ndim - 1) + [(0, self.out_channels - self.in_channels)]
    return (jnp.pad(x1, pad), jnp.pad(x2, pad), *carried)

  def transpose(self, y):
    y1, y2, *carried = y
    return (y1[..., :self.in_channels], y2[..., :self.in_channels], *carried)
