"""Invertible downsampling: i-RevNet's space-to-depth ``psi`` as stage reshuffles.

i-RevNet (Jacobsen, Smeulders and Oyallon, "i-RevNet: Deep Invertible
Networks", ICLR 2018, Sec. 3.1) replaces strided, information-losing
downsampling with ``psi``: every ``2 x 2`` spatial block becomes 4 channels,
``[B, H, W, C] -> [B, H/2, W/2, 4C]``, a permutation of the entries. Channel
growth without a resolution change uses an injective zero-padding (its
injective i-RevNet).

Here they are the ``pre`` of a reversible :class:`~petra_jax.engine.stage.Stage`
(a :class:`~petra_jax.engine.stage.Reshuffle`: ``apply`` is ``P``, ``transpose`` is
``P^T``, both its exact inverse on its image and its vjp), followed by the
stage's additive coupling. Activations are ``(x1, x2, *carried)``: the two
streams, then arrays set aside by earlier downsamplings, which every later
coupling passes through unchanged and the head pools
(:class:`petra_jax.models.layers.Head`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


def space_to_depth(x_BxHxWxC: jax.Array) -> jax.Array:
  """``psi``: each ``2 x 2`` spatial block stacked along channels.

  ``out[b, i, j, (2 * di + dj) * C + c] = x[b, 2 i + di, 2 j + dj, c]`` (the
  order of ``tf.nn.space_to_depth`` and of i-RevNet's ``psi``).

  Args:
    x_BxHxWxC: ``[B, H, W, C]`` with ``H`` and ``W`` even.

  Returns:
    ``[B, H/2, W/2, 4C]``, a permutation of the entries of ``x``.

  Raises:
    ValueError: odd ``H`` or ``W``.
  """
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
  """Halve the resolution, keep the stream width ``out_channels``: a permutation.

  On streams of ``in_channels`` each, with ``k = out_channels / 4``::

    x_i = [a_i | b_i]              a_i: first k channels, b_i: the other C - k
    P (x1, x2, *carried) = (psi(a1), psi(a2), *carried, [b1 | b2])

  The streams leave at ``[B, H/2, W/2, out_channels]``; ``[b1 | b2]``
  (``[B, H, W, 2 (in_channels - k)]``) is set aside at full resolution and
  appended to the carried arrays (nothing is appended when ``k =
  in_channels``, i.e. a 4x channel growth). ``P`` permutes the entries, so
  ``P^T = P^{-1}``: :meth:`transpose` rebuilds the input bit for bit.

  Attributes:
    in_channels: stream width ``C`` of the input.
    out_channels: stream width of the output, a multiple of 4 with
      ``out_channels / 4 <= in_channels`` (RevNets double it: ``k = C / 2``).
  """
  in_channels: int
  out_channels: int

  @property
  def keep(self) -> int:
    """Channels per stream that go through ``psi`` and stay on the streams."""
    return self.out_channels // 4

  def _check(self, x1):
    if self.out_channels % 4 or not 1 <= self.keep <= self.in_channels:
      raise ValueError(
          f"invertible downsampling from {self.in_channels} to {self.out_channels} channels per "
          "stream needs out_channels = 4k with 1 <= k <= in_channels; use an even model width.")
    if x1.shape[-1] != self.in_channels:
      raise ValueError(f"expected streams of {self.in_channels} channels, got {x1.shape[-1]}.")

  def apply(self, x):
    """``P x``: ``(x1, x2, *carried) -> (psi(a1), psi(a2), *carried, [b1 | b2])``."""
    x1, x2, *carried = x
    self._check(x1)
    k = self.keep
    out = (space_to_depth(x1[..., :k]), space_to_depth(x2[..., :k]), *carried)
    if k == self.in_channels:
      return out
    return (*out, jnp.concatenate([x1[..., k:], x2[..., k:]], axis=-1))

  def transpose(self, y):
    """``P^T y = P^{-1} y``: the streams back at full resolution and width."""
    u1, u2, *carried = y
    a1, a2 = depth_to_space(u1), depth_to_space(u2)
    if self.keep == self.in_channels:
      return (a1, a2, *carried)
    *carried, b = carried
    b1, b2 = jnp.split(b, 2, axis=-1)
    return (jnp.concatenate([a1, b1], axis=-1), jnp.concatenate([a2, b2], axis=-1), *carried)


@dataclasses.dataclass(frozen=True)
class InjectivePad:
  """Widen both streams with zero channels: ``[x_i | 0]``, an injection.

  i-RevNet's injective padding, for a channel growth at constant resolution
  (RevNet50's first group). ``P^T`` drops the padding: the exact inverse on
  ``P``'s image and ``P``'s vjp. The activation grows (``out / in`` times), so
  a model using it is invertible but not bijective.

  Attributes:
    in_channels: stream width of the input.
    out_channels: stream width of the output, ``>= in_channels``.
  """
  in_channels: int
  out_channels: int

  def apply(self, x):
    """``P x``: ``(x1, x2, *carried) -> ([x1 | 0], [x2 | 0], *carried)``."""
    x1, x2, *carried = x
    if x1.shape[-1] != self.in_channels or self.out_channels < self.in_channels:
      raise ValueError(f"cannot pad streams of {x1.shape[-1]} channels from {self.in_channels} "
                       f"to {self.out_channels}.")
    pad = [(0, 0)] * (x1.ndim - 1) + [(0, self.out_channels - self.in_channels)]
    return (jnp.pad(x1, pad), jnp.pad(x2, pad), *carried)

  def transpose(self, y):
    """``P^T y``: the first ``in_channels`` channels of each stream."""
    y1, y2, *carried = y
    return (y1[..., :self.in_channels], y2[..., :self.in_channels], *carried)
