"""Quantised messages: activations, cotangents and buffers in fewer bytes.

Pure functions only; the engine decides where to call them. A quantised
message is an ordinary JAX pytree: every float leaf of the input becomes a
:class:`Quantized` node whose leaves really are 16-bit or int8 arrays (plus a
float32 scale for int8), so ``jax.device_put``, ``jax.jit`` arguments and
results, ``jax.tree`` utilities and orbax checkpoints all see the small
arrays, and :func:`nbytes` counts what actually travels.

Formats (:data:`FORMATS`) and their round-trip error
``e = dequantize(quantize(x)) - x`` per element (:func:`error_bound` returns
these bounds as arrays):

* ``"none"``: identity. :func:`quantize` returns its input object itself,
  :func:`dequantize` too; ``e = 0``.
* ``"bfloat16"``: cast, round to nearest even. ``|e| <= 2^-8 |x|`` (8 bits of
  precision, same exponent range as float32; below the float32 normal range
  ``2^-126`` the absolute error is at most ``2^-126``). Half the bytes.
* ``"float16"``: cast, round to nearest even. ``|e| <= 2^-11 |x|`` for
  ``2^-14 <= |x| <= 65504``; below, subnormals give ``|e| <= 2^-25``. Finite
  values beyond the float16 range **saturate** to ``+-65504`` (so
  ``|e| = |x| - 65504`` there) instead of becoming ``inf``; ``inf`` and
  ``nan`` pass through. Half the bytes. Activations of a BatchNorm'd RevNet
  are far inside the range; a saturating message means a diverging run.
* ``"int8"``: symmetric linear quantisation, ``values = clip(round(x / s),
  -127, 127)`` as int8 with a float32 scale ``s = max|x| / 127`` per tensor
  (``scale`` shape ``[1]``) or per channel over the last axis (shape ``[C]``,
  ``per_channel=True``); an all-zero tensor (channel) gets ``s = 1``.
  Round to nearest: ``|e| <= s / 2``. Stochastic rounding (``key`` given):
  ``values = floor(x / s + u)``, ``u ~ U[0, 1)`` per element, so
  ``E[dequantize] = x`` (unbiased), ``Var = s^2 f (1 - f)`` with
  ``f = frac(x / s)``, and ``|e| < s``. Both bounds hold up to float32
  rounding of ``x / s`` and ``q * s`` (:func:`error_bound` adds
  ``2^-16 s``). ``-128`` is never used, so the grid is symmetric and
  ``dequantize`` of ``-x`` is ``-dequantize(x)`` (nearest rounding). A
  non-finite value makes its whole tensor (or channel) dequantise to ``nan``.
  A quarter of the bytes plus 4 bytes per scale.

Differences from the authors' PyTorch quantisers
(``async_torch/layers/compression.py`` of ``stephane-rivaud/PETRA``):

* their ``Quantiz8Bits`` stores ``uint8(|x| / max|x| * 255 + 0.5)`` together
  with ``sign(x)`` as a *full float32 tensor*, so the message is larger than
  the float32 original; it only simulates the rounding error. Here the sign
  lives in the int8 value (``[-127, 127]``, step ``max|x| / 127``, i.e. one
  bit less resolution than their magnitude grid, ``|e| <= max|x| / 254``
  instead of ``max|x| / 510``) and the message really is ~4x smaller;
* their int8 scale is always per tensor; ours can be per channel, which
  matters when channels differ in magnitude;
* their ``QuantizQSGD`` (stochastic, 8 levels of ``|x| / max|x|``) returns
  an already dequantised float32 tensor; our stochastic rounding is an
  option of the real int8 format, with an explicit JAX PRNG key;
* their ``Quantiz16Bits`` is a plain ``float16`` cast (overflow becomes
  ``inf``); ours saturates finite overflow and also offers ``bfloat16``.

Only floating leaves are quantised; other leaves (integer labels, ids) pass
through unchanged, like the non-tensor entries in the authors' code.
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

#: Unit roundoff (bound on the relative error per element) of the float formats.
UNIT_ROUNDOFF = {"bfloat16": 2.0 ** -8, "float16": 2.0 ** -11}

_FLOAT_DTYPES = {"bfloat16": jnp.bfloat16, "float16": jnp.float16}
_FLOAT16_MAX = 65504.0
# Absolute error floors below the normal range (half a subnormal step for
# float16; for bfloat16, whatever the backend does with float32 subnormals).
_TINY = {"bfloat16": 2.0 ** -126, "float16": 2.0 ** -25}
_INT8_MAX = 127
_ARITH_SLACK = 2.0 ** -16  # float32 rounding in x / s and q * s, in units of s


class Quantized(flax.struct.PyTreeNode):
  """One quantised array: a pytree node whose leaves are the small arrays.

  Attributes:
    values: the payload, same shape as the original; int8 for ``"int8"``,
      bfloat16 / float16 for those formats.
    scale: float32 ``[1]`` (per tensor) or ``[C]`` (per channel, the
      original's last axis) for ``"int8"``; ``None`` (no leaf) otherwise.
    fmt: the format name (static: part of the treedef, not a leaf).
    dtype: the original dtype's name, e.g. ``"float32"`` (static);
      :func:`dequantize` returns this dtype.
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
  """float32 scale ``max|x| / 127``: ``[C]`` per channel (last axis) or ``[1]``."""
  ax = jnp.abs(x.astype(jnp.float32))
  if per_channel and x.ndim >= 1:
    amax = jnp.max(ax, axis=tuple(range(x.ndim - 1)), initial=0.0)
  else:
    amax = jnp.max(ax, initial=0.0).reshape(1)
  scale = amax / _INT8_MAX
  # All-zero (or flushed-to-zero tiny) tensors: any positive scale is exact.
  # nan / inf scales are kept so that non-finite inputs stay visible.
  return jnp.where(scale == 0, jnp.float32(1.0), scale)


def _for_broadcast(scale: jax.Array, ndim: int) -> jax.Array:
  """The stored ``[1]`` / ``[C]`` scale, shaped to broadcast against an ``ndim`` array."""
  return scale.reshape(()) if ndim == 0 else scale


def _quantize_leaf(x, fmt: str, per_channel: bool, key) -> Quantized:
  dtype = str(jnp.dtype(x.dtype))
  if fmt in _FLOAT_DTYPES:
    x = jnp.asarray(x)
    if fmt == "float16":
      x = jnp.where(jnp.isfinite(x), jnp.clip(x, -_FLOAT16_MAX, _FLOAT16_MAX), x)
    return Quantized(values=x.astype(_FLOAT_DTYPES[fmt]), scale=None, fmt=fmt, dtype=dtype)
  # int8
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
  """Quantises every floating leaf of ``x`` to ``fmt``.

  Args:
    x: a pytree of float arrays (e.g. one activation ``[B, H, W, C]`` float32,
      or a tuple of two streams). Non-floating leaves pass through.
    fmt: one of :data:`FORMATS` (a Python string; static under ``jax.jit``).
    per_channel: ``"int8"`` only: one scale per entry of the last axis
      (``[C]``) instead of one per tensor (``[1]``). Ignored by the other
      formats.
    key: ``"int8"`` only: a JAX PRNG key; given, rounding is stochastic
      (unbiased), split across the leaves so each leaf gets its own noise.
      ``None``: round to nearest. Ignored by ``"none"``; an error for the
      float formats (they round to nearest, deterministically).

  Returns:
    ``x`` itself for ``"none"``; otherwise the same pytree with each floating
    leaf replaced by a :class:`Quantized` node. Jittable (``fmt`` and
    ``per_channel`` static).

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
  """Inverse of :func:`quantize`: every :class:`Quantized` node back to an array.

  Args:
    q: a pytree from :func:`quantize` (any format); leaves that are not
      :class:`Quantized` (``"none"`` messages, labels) pass through.

  Returns:
    The pytree with the original structure; each quantised leaf becomes an
    array of its original shape and dtype (float32 for float32 inputs),
    ``values * scale`` for int8. For ``"none"`` it returns ``q`` itself.
    Jittable.
  """
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
      bound = jnp.maximum(bound, ax - _FLOAT16_MAX)  # saturation
    return bound
  scale = _for_broadcast(_int8_scale(ax, per_channel), ax.ndim)
  return jnp.broadcast_to(scale * ((1.0 if stochastic else 0.5) + _ARITH_SLACK), ax.shape)


def error_bound(x: PyTree, fmt: str, *, per_channel: bool = False,
                stochastic: bool = False) -> PyTree:
  """Per-element bound on ``|dequantize(quantize(x, fmt, ...)) - x|``.

  Args:
    x: the pytree of float arrays that is (or would be) quantised.
    fmt: one of :data:`FORMATS`.
    per_channel: as in :func:`quantize` (int8 only).
    stochastic: int8 only: the bound for stochastic rounding (``< s``)
      rather than round to nearest (``<= s / 2``).

  Returns:
    A pytree like ``x`` (floating leaves only are replaced) of float32 arrays
    of ``x``'s shapes: ``0`` for ``"none"``; ``max(u |x|, tiny)`` for the
    float formats (``u`` from :data:`UNIT_ROUNDOFF`, ``tiny`` the absolute
    floor below the normal range; for float16 also ``|x| - 65504`` where
    saturated); ``s (1/2 + 2^-16)`` (nearest) or ``s (1 + 2^-16)``
    (stochastic) for int8, ``s`` broadcast from its ``[1]`` / ``[C]`` shape;
    the ``2^-16 s`` covers float32 rounding in ``x / s`` and ``q * s``.
    Finite inputs only.
  """
  check_format(fmt)
  return jax.tree.map(
      lambda leaf: _bound_leaf(leaf, fmt, per_channel, stochastic) if _is_float(leaf) else leaf,
      x)


def nbytes(tree: PyTree) -> int:
  """Bytes held by the leaves of ``tree`` (quantised or not), as a Python int.

  Counts ``size * itemsize`` of every array leaf, so a :class:`Quantized`
  node counts its ``values`` and its float32 ``scale``. Works on
  ``jax.Array``, ``np.ndarray``, ``jax.ShapeDtypeStruct`` and tracers (it only
  reads static shapes and dtypes, so it also runs inside ``jax.jit``); Python
  scalars count as their NumPy dtype.
  """
  total = 0
  for leaf in jax.tree.leaves(tree):
    if hasattr(leaf, "shape") and hasattr(leaf, "dtype"):
      total += int(np.prod(leaf.shape, dtype=np.int64)) * np.dtype(leaf.dtype).itemsize
    else:
      total += np.asarray(leaf).nbytes
  return total


def convert(x: PyTree, fmt: str, *, per_channel: bool = False,
            key: Optional[jax.Array] = None) -> PyTree:
  """``x`` (quantised or not) in format ``fmt``.

  ``"none"`` dequantises (full precision; a float ``x`` is returned itself);
  a message already in ``fmt`` is returned itself, so converting twice adds
  no error; otherwise ``quantize(dequantize(x), fmt)``, with stochastic
  rounding when ``key`` is given (int8). Jittable.

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


#: The payloads the engine can quantise (the authors' ``--quantize-forward-com``,
#: ``--quantize-backward-com`` and ``--quantize-buffer``).
KINDS = ("forward", "backward", "buffer")


@dataclasses.dataclass(frozen=True)
class MessageFormats:
  """The format of each payload kind the engine moves or keeps.

  * ``forward``: the activation ``x_{j+1}`` stage ``j`` sends to stage ``j+1``;
    the receiver runs its forward on the dequantised message (so the error
    enters the forward, and a reconstructing stage later rebuilds the
    dequantised input, not the sender's float one).
  * ``backward``: the pair ``(x~_j or None, delta_j)`` sent to stage ``j-1``:
    the input it reconstructs from and the cotangent it takes the vjp of.
  * ``buffer``: the input a non-reversible stage keeps for its backward
    recomputation. ``"none"`` keeps the message as received (the exact input
    of the forward, in the forward message's format).

  These are where the authors' code applies its quantisers
  (``async_torch/layers/compression.py``). Parameters, optimizer states and
  gradient accumulation are never quantised.

  Attributes:
    forward, backward, buffer: each one of :data:`FORMATS`.
    per_channel: int8 scales per channel (last axis) instead of per tensor.
    stochastic: int8 payloads round stochastically (unbiased; the engine
      draws each payload's key from the seed, the micro-batch, the stage and
      the kind, so a resumed run draws the same noise); the float formats
      always round to nearest.

  Raises:
    ValueError: an unknown format.
  """
  forward: str = "none"
  backward: str = "none"
  buffer: str = "none"
  per_channel: bool = False
  stochastic: bool = False

  def __post_init__(self):
    for kind in KINDS:
      check_format(getattr(self, kind))

  @property
  def active(self) -> bool:
    """Whether any payload kind is quantised."""
    return any(getattr(self, kind) != "none" for kind in KINDS)

  def stochastic_for(self, kind: str) -> bool:
    """Whether payloads of ``kind`` round stochastically (int8 only)."""
    return self.stochastic and getattr(self, kind) == "int8"

  def encode(self, kind: str, x: PyTree, key: Optional[jax.Array] = None) -> PyTree:
    """``x`` in the format of payload ``kind`` (:func:`convert`; jittable);
    ``key`` is used only where :meth:`stochastic_for` ``kind``."""
    key = key if self.stochastic_for(kind) else None
    return convert(x, getattr(self, kind), per_channel=self.per_channel, key=key)

  def spec(self, kind: str, spec: PyTree) -> PyTree:
    """The ``jax.ShapeDtypeStruct`` pytree of ``encode(kind, x)`` for ``x`` of
    shapes ``spec`` (what a receiving process allocates)."""
    if spec is None:
      return None
    return jax.eval_shape(functools.partial(self.encode, kind), spec)
