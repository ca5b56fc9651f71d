"""Packed stage states: a pytree of many arrays as one flat buffer per dtype.

A jitted call's host cost grows with its leaf count, so hot-path steps take
and return states packed (:func:`on_packed`: static slices in, one
concatenation per dtype out). On the CPU only small states are packed
(:attr:`Packer.pays`). Packing moves bits only.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np

PyTree = Any


@dataclasses.dataclass(frozen=True)
class Packer:
  """The static layout of a packed pytree (hashable).

  Attributes:
    kind: the root's type, packed again in a step's outputs.
    slots: per leaf, ``(buffer index, offset, size)`` in elements.
    sizes: each buffer's length.
  """
  kind: type
  treedef: Any
  shapes: tuple
  dtypes: tuple
  slots: tuple
  sizes: tuple

  MAX_MEAN_LEAF_BYTES = 16 * 1024

  @property
  def pays(self) -> bool:
    """Whether packing pays on the CPU: mean leaf at most :attr:`MAX_MEAN_LEAF_BYTES`."""
    nbytes = sum(n * d.itemsize for n, d in zip(self.sizes, self.dtypes))
    return nbytes <= self.MAX_MEAN_LEAF_BYTES * len(self.slots)

  @classmethod
  def of(cls, tree: PyTree) -> Optional["Packer"]:
    """The layout of ``tree``; None if unpackable (extended or weak dtype, no leaf)."""
    leaves, treedef = jax.tree.flatten(tree)
    if not leaves or not all(_packable(x) for x in leaves):
      return None
    dtypes = tuple(dict.fromkeys(np.dtype(x.dtype) for x in leaves))
    sizes, slots = [0] * len(dtypes), []
    for x in leaves:
      g, n = dtypes.index(np.dtype(x.dtype)), int(np.prod(x.shape, dtype=np.int64))
      slots.append((g, sizes[g], n))
      sizes[g] += n
    return cls(type(tree), treedef, tuple(tuple(x.shape) for x in leaves), dtypes,
               tuple(slots), tuple(sizes))

  def pack(self, tree: PyTree) -> "PackedState":
    """``tree`` as one 1-D buffer per dtype.

    Raises:
      ValueError: ``tree``'s structure, shapes or dtypes differ from the layout.
    """
    if Packer.of(tree) != self:
      raise ValueError(f"a state laid out as {Packer.of(tree)} does not fit the packer {self}.")
    groups = [[] for _ in self.dtypes]
    for x, (g, _, _) in zip(jax.tree.leaves(tree), self.slots):
      groups[g].append(jnp.ravel(x))
    return PackedState(tuple(_concat(g) for g in groups), self)

  def unpack(self, buffers: tuple) -> PyTree:
    """The pytree ``buffers`` hold: each leaf a static slice, reshaped."""
    leaves = [jax.lax.slice(buffers[g], (o,), (o + n,)).reshape(shape)
              for (g, o, n), shape in zip(self.slots, self.shapes)]
    return jax.tree.unflatten(self.treedef, leaves)


def _packable(x) -> bool:
  dtype = getattr(x, "dtype", None)
  return (dtype is not None and not jax.dtypes.issubdtype(dtype, jax.dtypes.extended)
          and not getattr(x, "weak_type", False))


def _concat(parts: list) -> jax.Array:
  return parts[0] if len(parts) == 1 else jnp.concatenate(parts)


@jax.tree_util.register_pytree_node_class
class PackedState:
  """A packed pytree: ``buffers`` (one 1-D array per dtype) and its :class:`Packer`."""
  __slots__ = ("buffers", "packer")

  def __init__(self, buffers: tuple, packer: Packer):
    self.buffers, self.packer = tuple(buffers), packer

  def tree_flatten(self):
    return self.buffers, self.packer

  @classmethod
  def tree_unflatten(cls, packer, buffers):
    return cls(buffers, packer)

  def unpacked(self) -> PyTree:
    """The pytree (inside a jit: traced slices; outside: see :func:`unpack`)."""
    return self.packer.unpack(self.buffers)

  def __repr__(self):
    sizes = ", ".join(f"{d.name}[{n}]" for d, n in zip(self.packer.dtypes, self.packer.sizes))
    return f"PackedState({self.packer.kind.__name__}: {sizes})"


@jax.jit
def _pack(tree: PyTree) -> PackedState:
  return Packer.of(tree).pack(tree)


@jax.jit
def _unpack(packed: PackedState) -> PyTree:
  return packed.unpacked()


def pays(tree: PyTree) -> bool:
  """Where packing is used: where it was measured to pay (docs/benchmarks.md),
  on the CPU with a mean leaf of at most ``MAX_MEAN_LEAF_BYTES``."""
  if isinstance(tree, PackedState):
    return True
  packer = Packer.of(tree)
  return packer is not None and packer.pays and _on_cpu(tree)


def pack(tree: PyTree):
  """``tree`` packed (not donating), or ``tree`` where it does not pay."""
  if isinstance(tree, PackedState) or not pays(tree):
    return tree
  return _pack(tree)


def _on_cpu(tree: PyTree) -> bool:
  """Whether ``tree``'s arrays live on CPU devices (its first leaf's)."""
  leaf = jax.tree.leaves(tree)[0]
  devices = leaf.devices() if hasattr(leaf, "devices") else set()
  return all(d.platform == "cpu" for d in devices)


def unpack(tree):
  """The pytree a :class:`PackedState` holds (fresh arrays); anything else as is."""
  return _unpack(tree) if isinstance(tree, PackedState) else tree


def on_packed(step: Callable) -> Callable:
  """``step(state, *args)`` that also takes ``state`` packed (and packs new states out)."""
  @functools.wraps(step)
  def wrapped(state, *args):
    if not isinstance(state, PackedState):
      return step(state, *args)
    packer = state.packer
    out = step(state.unpacked(), *args)
    is_state = lambda x: isinstance(x, packer.kind)  # noqa: E731
    return jax.tree.map(lambda x: packer.pack(x) if is_state(x) else x, out, is_leaf=is_state)
  return wrapped


@dataclasses.dataclass(frozen=True)
class Padded:
  """One of several pytrees in their common flat layout (hashable): one 1-D buffer per dtype
  of ``dtypes`` (every tree's), each ``sizes[g]`` elements long (the largest tree's, at least
  1); this tree's leaves first, in order, then zeros. Build them with :func:`padded`.

  Attributes:
    treedef: this tree's structure; ``shapes``, ``slots`` per leaf (``(buffer, offset,
      size)`` as :class:`Packer`'s, ``buffer`` an index of ``dtypes``).
  """
  treedef: Any
  shapes: tuple
  slots: tuple
  dtypes: tuple
  sizes: tuple

  def pack(self, tree: PyTree) -> tuple:
    """``tree`` (this layout's structure) as ``len(dtypes)`` buffers ``dtype[size]``."""
    groups = [[] for _ in self.dtypes]
    for x, (g, _, _) in zip(jax.tree.leaves(tree), self.slots):
      groups[g].append(jnp.ravel(x).astype(self.dtypes[g]))
    out = []
    for parts, dtype, size in zip(groups, self.dtypes, self.sizes):
      used = sum(p.size for p in parts)
      out.append(_concat(parts + [jnp.zeros((size - used,), dtype)] if used < size else parts))
    return tuple(out)

  def unpack(self, buffers: tuple) -> PyTree:
    """The tree ``buffers`` (:meth:`pack`'s) hold: each leaf a static slice, reshaped."""
    leaves = [jax.lax.slice(buffers[g], (o,), (o + n,)).reshape(shape)
              for (g, o, n), shape in zip(self.slots, self.shapes)]
    return jax.tree.unflatten(self.treedef, leaves)


def padded(trees: list) -> list[Padded]:
  """Each of ``trees`` (arrays or ``jax.ShapeDtypeStruct`` s) in one layout common to all:
  one buffer per dtype, each as long as the largest tree's leaves of that dtype.

  Raises:
    ValueError: a leaf of an extended dtype (a PRNG key), which has no flat bits here.
  """
  flat = [jax.tree.flatten(t) for t in trees]
  for leaves, _ in flat:
    for x in leaves:
      if jax.dtypes.issubdtype(x.dtype, jax.dtypes.extended):
        raise ValueError(f"a leaf of dtype {x.dtype} (a PRNG key) cannot be packed flat.")
  dtypes = tuple(sorted({np.dtype(x.dtype) for leaves, _ in flat for x in leaves},
                        key=lambda d: d.str))
  layouts, sizes = [], [1] * len(dtypes)
  for leaves, treedef in flat:
    used, slots = [0] * len(dtypes), []
    for x in leaves:
      g, n = dtypes.index(np.dtype(x.dtype)), int(np.prod(x.shape, dtype=np.int64))
      slots.append((g, used[g], n))
      used[g] += n
    sizes = [max(a, b) for a, b in zip(sizes, used)]
    layouts.append((treedef, tuple(tuple(x.shape) for x in leaves), tuple(slots)))
  return [Padded(t, s, slots, dtypes, tuple(sizes)) for t, s, slots in layouts]
