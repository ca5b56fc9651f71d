"""Packed stage states: a pytree of many arrays as one flat buffer per dtype.

On XLA:CPU the host cost of a jitted call grows with the number of array
leaves it returns (about 3-4 µs each), and a stage's
:class:`petra_jax.engine.state.StageState` has tens of leaves (parameters,
BatchNorm statistics, momentum, the ``optax.MultiSteps`` accumulator). Its
hot-path steps therefore take and return it packed:

* :class:`Packer`: the static layout of one pytree (treedef, each leaf's
  shape, dtype and slot in its dtype's buffer);
* :class:`PackedState`: a pytree node holding the buffers (its leaves: one
  1-D array per dtype, e.g. ``float32[P]`` and ``int32[I]``) and its
  :class:`Packer` (static);
* :func:`on_packed`: wraps a step ``(state, *args) -> outputs`` so that,
  given a :class:`PackedState`, it runs on the unpacked pytree (static
  slices inside the jit: the exact arrays of the unpacked state) and returns
  every new state of the unpacked kind packed again (one concatenation per
  dtype); given an unpacked state it is the step itself;
* :func:`pack`, :func:`unpack`: the jitted conversions, off the hot path.

On the CPU packing pays only for small states (:attr:`Packer.pays`): the
concatenation writes every byte of the state once more per step, which for
RevNet18 at width 64 (megabytes per stage) costs more than the dispatch it
saves (a PETRA tick 2130 -> 2018 ms unpacked, docs/benchmarks.md); such
states stay unpacked there. On an accelerator (memory bandwidth in TB/s, a
host that must keep up with sub-millisecond stages) every state is packed.

Packing moves bits only (slices, reshapes, concatenations): a packed step
computes exactly what the unpacked one does.
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
  """The static layout of a packed pytree (hashable: a jit's static data).

  Attributes:
    kind: the type of the packed pytree's root (e.g. ``StageState``): what
      :func:`on_packed` packs again in a step's outputs.
    treedef: the pytree's structure (static fields included).
    shapes: each leaf's shape, in flattening order.
    dtypes: the buffers' dtypes, one buffer each.
    slots: per leaf, ``(buffer index, offset, size)`` in elements.
    sizes: each buffer's length.
  """
  kind: type
  treedef: Any
  shapes: tuple
  dtypes: tuple
  slots: tuple
  sizes: tuple

  # On the CPU packing pays while the copy it adds (every byte once more per
  # step, at ~5-10 GB/s) costs less than the dispatch it saves (~3-4 µs per
  # leaf on XLA:CPU): a mean leaf of at most this many bytes.
  MAX_MEAN_LEAF_BYTES = 16 * 1024

  @property
  def pays(self) -> bool:
    """Whether packing this layout saves time on the CPU: its mean leaf has
    at most :attr:`MAX_MEAN_LEAF_BYTES` bytes."""
    nbytes = sum(n * d.itemsize for n, d in zip(self.sizes, self.dtypes))
    return nbytes <= self.MAX_MEAN_LEAF_BYTES * len(self.slots)

  @classmethod
  def of(cls, tree: PyTree) -> Optional["Packer"]:
    """The layout of ``tree`` (arrays or ``jax.ShapeDtypeStruct``\\ s); None
    where it cannot be packed (a leaf of an extended dtype such as a PRNG
    key, a weakly typed leaf, or no leaf at all)."""
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
    """``tree`` (laid out as this packer says) as one 1-D buffer per dtype.

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
  """A packed pytree: ``buffers`` (one 1-D array per dtype, the leaves) and
  its :class:`Packer` (static)."""
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
  """The one rule of where packing is used: where it was measured to pay
  (docs/benchmarks.md): states on the CPU whose mean leaf has at most
  :attr:`Packer.MAX_MEAN_LEAF_BYTES` bytes. Unmeasured elsewhere, so off."""
  if isinstance(tree, PackedState):
    return True
  packer = Packer.of(tree)
  return packer is not None and packer.pays and _on_cpu(tree)


def pack(tree: PyTree):
  """``tree`` packed (one jitted call, not donating), or ``tree`` itself
  where packing does not pay (:func:`pays`)."""
  if isinstance(tree, PackedState) or not pays(tree):
    return tree
  return _pack(tree)


def _on_cpu(tree: PyTree) -> bool:
  """Whether ``tree``'s arrays live on CPU devices (its first leaf's)."""
  leaf = jax.tree.leaves(tree)[0]
  devices = leaf.devices() if hasattr(leaf, "devices") else set()
  return all(d.platform == "cpu" for d in devices)


def unpack(tree):
  """The pytree a :class:`PackedState` holds (one jitted call, fresh
  arrays); anything else is returned as it is."""
  return _unpack(tree) if isinstance(tree, PackedState) else tree


def on_packed(step: Callable) -> Callable:
  """``step(state, *args)`` that also takes ``state`` packed.

  Given a :class:`PackedState`, the wrapper runs ``step`` on the unpacked
  pytree and packs every object of the same kind in its outputs with the
  same packer (a step's new state); given anything else it is ``step``.
  Meant to be jitted: the unpacking and packing are then inside the call.
  """
  @functools.wraps(step)
  def wrapped(state, *args):
    if not isinstance(state, PackedState):
      return step(state, *args)
    packer = state.packer
    out = step(state.unpacked(), *args)
    is_state = lambda x: isinstance(x, packer.kind)  # noqa: E731
    return jax.tree.map(lambda x: packer.pack(x) if is_state(x) else x, out, is_leaf=is_state)
  return wrapped
