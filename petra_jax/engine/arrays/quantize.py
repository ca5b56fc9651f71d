"""Quantised messages (pure functions): activations, cotangents and buffers in fewer bytes.

Each float leaf becomes a :class:`Quantized` node whose leaves are the small
arrays. Formats and round-trip error ``e`` per element (:func:`error_bound`):
``"none"`` (``e = 0``); ``"bfloat16"`` (``|e| <= 2^-8 |x|``); ``"float16"``
(``|e| <= 2^-11 |x|``, finite overflow saturates to ``+-65504``); ``"int8"``
(``clip(round(x / s), -127, 127)``, float32 scale ``s = max|x| / 127`` per tensor
``[1]`` or per channel ``[C]``; ``|e| <= s / 2``, stochastic ``|e| < s`` unbiased).
Non-float leaves pass through.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Optional

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

PyTree = Any

FORMATS = ("none", "bfloat16", "float16", "int8")

UNIT_ROUNDOFF = {"bfloat16": 2.0 ** -8, "float16": 2.0 ** -11}

_FLOAT_DTYPES = {"bfloat16": jnp.bfloat16, "float16": jnp.float16}
_FLOAT16_MAX = 65504.0
_TINY = {"bfloat16": 2.0 ** -126, "float16": 2.0 ** -25}
_INT8_MAX = 127
_ARITH_SLACK = 2.0 ** -16


class Quantized(flax.struct.PyTreeNode):
  """One quantised array; ``values`` int8/bfloat16/float16 of the original shape.

  ``scale``: float32 ``[1]`` or ``[C]`` for ``"int8"``, else None. ``fmt`` and
  ``dtype`` (the original's name, returned by :func:`dequantize`) are static.
  """

  values: jax.Array
  scale: Optional[jax.Array]
  fmt: str = flax.struct.field(pytree_node=False)
  dtype: str = flax.struct.field(pytree_node=False)

  @property
  def shape(self) -> tuple[int, ...]:
    """Shape of the original (and dequantised) array."""
    return tuple(self.values.shape)


def check_format(fmt: str) -> str:
  """Returns ``fmt`` if it is one of :data:`FORMATS`, else raises ValueError."""
  if not isinstance(fmt, str) or fmt not in FORMATS:
    raise ValueError(
        f"unknown quantisation format {fmt!r}; choose one of {', '.join(FORMATS)}")
  return fmt


def _is_float(leaf) -> bool:
  dtype = getattr(leaf, "dtype", None)
  return dtype is not None and jnp.issubdtype(dtype, jnp.floating)


def _is_quantized(node) -> bool:
  return isinstance(node, Quantized)


def _int8_scale(x: jax.Array, per_channel: bool) -> jax.Array:
  ax = jnp.abs(x.astype(jnp.float32))
  if per_channel and x.ndim >= 1:
    amax = jnp.max(ax, axis=tuple(range(x.ndim - 1)), initial=0.0)
  else:
    amax = jnp.max(ax, initial=0.0).reshape(1)
  scale = amax / _INT8_MAX
  return jnp.where(scale == 0, jnp.float32(1.0), scale)


def _for_broadcast(scale: jax.Array, ndim: int) -> jax.Array:
  return scale.reshape(()) if ndim == 0 else scale


def _quantize_leaf(x, fmt: str, per_channel: bool, key) -> Quantized:
  dtype = str(jnp.dtype(x.dtype))
  if fmt in _FLOAT_DTYPES:
    x = jnp.asarray(x)
    if fmt == "float16":
      x = jnp.where(jnp.isfinite(x), jnp.clip(x, -_FLOAT16_MAX, _FLOAT16_MAX), x)
    return Quantized(values=x.astype(_FLOAT_DTYPES[fmt]), scale=None, fmt=fmt, dtype=dtype)
  x = jnp.asarray(x, jnp.float32)
  scale = _int8_scale(x, per_channel)
  r = x / _for_broadcast(scale, x.ndim)
  if key is None:
    r = jnp.round(r)
  else:
    r = jnp.floor(r + jax.random.uniform(key, x.shape, jnp.float32))
  values = jnp.clip(r, -_INT8_MAX, _INT8_MAX).astype(jnp.int8)
  return Quantized(values=values, scale=scale, fmt=fmt, dtype=dtype)


def quantize(x: PyTree, fmt: str, *, per_channel: bool = False,
             key: Optional[jax.Array] = None) -> PyTree:
  """Quantises every floating leaf of ``x`` (e.g. ``float32[B, H, W, C]``) to ``fmt``.

  ``per_channel``: int8 scales ``[C]`` over the last axis. ``key``: int8
  stochastic rounding. Returns ``x`` itself for ``"none"``. Jittable.

  Raises:
    ValueError: unknown ``fmt``, a ``key`` for a float format, or ``x``
      already quantised.
  """
  check_format(fmt)
  if fmt == "none":
    return x
  if key is not None and fmt != "int8":
    raise ValueError(f"stochastic rounding (key=...) is only implemented for 'int8', "
                     f"not {fmt!r}")
  leaves, treedef = jax.tree.flatten(x, is_leaf=_is_quantized)
  if any(_is_quantized(leaf) for leaf in leaves):
    raise ValueError("quantize: the input is already quantised; dequantize it first")
  floats = [i for i, leaf in enumerate(leaves) if _is_float(leaf)]
  keys = [None] * len(leaves)
  if key is not None and floats:
    split = jax.random.split(key, len(floats))
    for n, i in enumerate(floats):
      keys[i] = split[n]
  out = list(leaves)
  for i in floats:
    out[i] = _quantize_leaf(leaves[i], fmt, per_channel, keys[i])
  return jax.tree.unflatten(treedef, out)


def _dequantize_leaf(q: Quantized) -> jax.Array:
  if q.fmt == "int8":
    scale = _for_broadcast(q.scale, q.values.ndim)
    return (q.values.astype(jnp.float32) * scale).astype(q.dtype)
  return q.values.astype(q.dtype)


def dequantize(q: PyTree) -> PyTree:
  """Inverse of :func:`quantize`: each :class:`Quantized` node back to its shape and dtype."""
  leaves = jax.tree.leaves(q, is_leaf=_is_quantized)
  if not any(_is_quantized(leaf) for leaf in leaves):
    return q
  return jax.tree.map(lambda n: _dequantize_leaf(n) if _is_quantized(n) else n, q,
                      is_leaf=_is_quantized)


def _bound_leaf(x, fmt: str, per_channel: bool, stochastic: bool) -> jax.Array:
  ax = jnp.abs(jnp.asarray(x, jnp.float32))
  if fmt == "none":
    return jnp.zeros_like(ax)
  if fmt in _FLOAT_DTYPES:
    bound = jnp.maximum(UNIT_ROUNDOFF[fmt] * ax, _TINY[fmt])
    if fmt == "float16":
      bound = jnp.maximum(bound, ax - _FLOAT16_MAX)
    return bound
  scale = _for_broadcast(_int8_scale(ax, per_channel), ax.ndim)
  return jnp.broadcast_to(scale * ((1.0 if stochastic else 0.5) + _ARITH_SLACK), ax.shape)


def error_bound(x: PyTree, fmt: str, *, per_channel: bool = False,
                stochastic: bool = False) -> PyTree:
  """Per-element float32 bound on ``|dequantize(quantize(x, fmt)) - x|`` (finite ``x``).

  ``max(u |x|, tiny)`` for float formats (float16 also ``|x| - 65504``);
  ``s (1/2 + 2^-16)`` (nearest) or ``s (1 + 2^-16)`` (stochastic) for int8.
  """
  check_format(fmt)
  return jax.tree.map(
      lambda leaf: _bound_leaf(leaf, fmt, per_channel, stochastic) if _is_float(leaf) else leaf,
      x)


def nbytes(tree: PyTree) -> int:
  """Bytes of the array leaves of ``tree`` (``size * itemsize``); works under ``jax.jit``."""
  total = 0
  for leaf in jax.tree.leaves(tree):
    if hasattr(leaf, "shape") and hasattr(leaf, "dtype"):
      total += int(np.prod(leaf.shape, dtype=np.int64)) * np.dtype(leaf.dtype).itemsize
    else:
      total += np.asarray(leaf).nbytes
  return total


def convert(x: PyTree, fmt: str, *, per_channel: bool = False,
            key: Optional[jax.Array] = None) -> PyTree:
  """``x`` (quantised or not) in format ``fmt``; a message already in ``fmt`` is returned as is.

  Raises:
    ValueError: unknown ``fmt``.
  """
  check_format(fmt)
  if fmt == "none":
    return dequantize(x)
  leaves = jax.tree.leaves(x, is_leaf=_is_quantized)
  if leaves and all(not _is_float(l) or (_is_quantized(l) and l.fmt == fmt) for l in leaves):
    return x
  return quantize(dequantize(x), fmt, per_channel=per_channel, key=key)


PAYLOADS = ("forward", "backward", "buffer")  # what MessageFormats formats


@dataclasses.dataclass(frozen=True)
class MessageFormats:
  """The format of each payload the engine moves or keeps.

  ``forward``: activation ``x_{j+1}`` to stage ``j+1``; ``backward``:
  ``(x~_j or None, delta_j)`` to stage ``j-1``; ``buffer``: a non-reversible
  stage's stored input. Parameters and optimizer state are never quantised.

  Raises:
    ValueError: an unknown format.
  """
  forward: str = "none"
  backward: str = "none"
  buffer: str = "none"
  per_channel: bool = False
  stochastic: bool = False

  def __post_init__(self):
    for kind in PAYLOADS:
      check_format(getattr(self, kind))

  @property
  def quantized(self) -> tuple:
    """The payload kinds (of :data:`PAYLOADS`) that are quantised."""
    return tuple(kind for kind in PAYLOADS if getattr(self, kind) != "none")

  @property
  def active(self) -> bool:
    """Whether any payload kind is quantised."""
    return bool(self.quantized)

  def stochastic_for(self, kind: str) -> bool:
    """Whether payloads of ``kind`` round stochastically (int8 only)."""
    return self.stochastic and getattr(self, kind) == "int8"

  def encode(self, kind: str, x: PyTree, key: Optional[jax.Array] = None) -> PyTree:
    """``x`` in the format of payload ``kind``; ``key`` used only for stochastic int8."""
    key = key if self.stochastic_for(kind) else None
    return convert(x, getattr(self, kind), per_channel=self.per_channel, key=key)

  def spec(self, kind: str, spec: PyTree) -> PyTree:
    """``jax.ShapeDtypeStruct`` pytree of ``encode(kind, x)`` for ``x`` of shapes ``spec``."""
    if spec is None:
      return None
    return jax.eval_shape(functools.partial(self.encode, kind), spec)
