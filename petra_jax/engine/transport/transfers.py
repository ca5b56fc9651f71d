"""Moving activations between stages' devices, within and across processes.

Within a process: ``jax.device_put``. Across processes: a jitted
``jax.shard_map`` over ``Mesh([src group, dst group], ("pair", "data"))``
running ``jax.lax.ppermute`` (NCCL, ICI/DCN, or gloo on CPU), called by both
owning processes in the same order; compiled once per
``(treedef, shapes, dtypes, src, dst)``.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from petra_jax import _xla_flags
from petra_jax.engine.transport import placement as placement_lib

PyTree = Any
_AXIS = "pair"


class PeerError(RuntimeError):
  """A cross-process transfer failed: the peer process died or is unreachable."""


def send(x: PyTree, device) -> PyTree:
  """Places ``x`` on ``device`` (a device or sharding of this process), asynchronously."""
  return jax.device_put(x, device)


def send_if_elsewhere(x, device, sharding) -> Any:
  """:func:`send`, skipped when ``x`` is a committed array already laid out as ``sharding``."""
  if isinstance(x, jax.Array) and x.committed and x.sharding == sharding:
    return x
  return send(x, device)


def is_local(device: jax.Device) -> bool:
  """Whether ``device`` belongs to this process (always True single-process)."""
  return device.process_index == jax.process_index()


def enable_cpu_collectives() -> None:
  """Selects gloo for CPU cross-process collectives; must run before the backend starts."""
  jax.config.update("jax_cpu_collectives_implementation", "gloo")


# jaxlib releases [first, past) whose CPU collectives hang in a program loaded from the
# persistent compilation cache in a run of several processes (docs/multihost.md, "JAX versions").
CACHED_COLLECTIVES_HANG = ((0, 12), (1, 0))


def skip_cache_if_it_hangs() -> bool:
  """Turns JAX's persistent compilation cache off where its programs' collectives hang.

  That is a run of several processes on the CPU with a jaxlib in
  :data:`CACHED_COLLECTIVES_HANG`. Call it after ``jax.distributed.initialize``
  and before anything compiles (JAX decides once per process whether to use the
  cache). Returns whether it turned the cache off.
  """
  if not (jax.process_count() > 1 and jax.default_backend() == "cpu"
          and _xla_flags.jaxlib_in(CACHED_COLLECTIVES_HANG)):
    return False
  jax.config.update("jax_enable_compilation_cache", False)
  return True


def transfer(x: Optional[PyTree], src, dst, spec: PyTree) -> Optional[PyTree]:
  """Moves the pytree ``x`` from ``src`` to ``dst`` across processes (asynchronous).

  Called by both owning processes, in the same order; ``x`` is None on the
  receiver, ``spec`` a ``jax.ShapeDtypeStruct`` pytree. With ``D > 1`` devices,
  leaves of rank >= 1 are sharded along axis 0.

  Returns:
    On ``dst``'s process the pytree on ``dst``; on ``src``'s, ``x`` itself.

  Raises:
    ValueError: if this process owns neither or both ends.
    PeerError: the collective failed (the other process probably died).
  """
  src, dst = _group(src), _group(dst)
  here = jax.process_index()
  if (src[0].process_index == here) == (dst[0].process_index == here):
    raise ValueError(
        f"transfer() is for two devices of different processes, one of them this one "
        f"({here}); got src={src} (process {src[0].process_index}) and dst={dst} "
        f"(process {dst[0].process_index}). Use send() within a process.")
  sending = src[0].process_index == here
  leaves, treedef = jax.tree.flatten(spec)
  shapes = tuple((tuple(s.shape), jnp.dtype(s.dtype)) for s in leaves)
  fn, shardings = _compiled(treedef, shapes, src, dst)
  shards = (_send_shards(jax.tree.leaves(x), shapes, src) if sending
            else _receive_buffers(shapes, dst))
  inputs = [jax.make_array_from_single_device_arrays(_global_shape(shape), sh, parts)
            for (shape, _), sh, parts in zip(shapes, shardings, shards)]
  try:
    outputs = fn(*inputs)
  except Exception as e:  # pylint: disable=broad-except  (jaxlib's runtime errors)
    peer = dst[0].process_index if sending else src[0].process_index
    raise PeerError(
        f"the transfer {'to' if sending else 'from'} process {peer} ({src} -> {dst}) failed; "
        f"process {peer} has probably died (see its log). Cause: "
        f"{str(e).splitlines()[0]}") from e
  if sending:
    return x
  return jax.tree.unflatten(treedef, [_received(out, shape, dst)
                                      for out, (shape, _) in zip(outputs, shapes)])


def _group(where) -> tuple:
  """The devices of ``where`` (a ``jax.Device`` or a ``Placement``)."""
  return (where,) if isinstance(where, jax.Device) else tuple(where.devices)


def _batched(shape: tuple, d: int) -> bool:
  """Whether a leaf of ``shape`` is split over a group of ``d`` devices."""
  return d > 1 and bool(shape)


def _global_shape(shape: tuple) -> tuple:
  """Both ends' leaves side by side on axis 0 (a scalar as ``[1]``)."""
  return (2 * shape[0],) + shape[1:] if shape else (2,)


def _send_shards(leaves, shapes, src: tuple) -> list:
  """Per leaf, the sender's piece for each device of ``src`` (a shard, or the whole leaf)."""
  out = []
  for a, (shape, _) in zip(leaves, shapes):
    if _batched(shape, len(src)):
      by_device = {s.device: s.data for s in a.addressable_shards}
      out.append([by_device[d] for d in src])
      continue
    pieces = []
    for d in src:
      on_d = a if a.sharding == jax.sharding.make_single_device_sharding(d) else jax.device_put(a, d)
      pieces.append(on_d.reshape(1) if not shape else on_d)
    out.append(pieces)
  return out


def _received(out: jax.Array, shape: tuple, dst: tuple):
  """The receiver's half of ``out``: one array on ``dst`` (its group)."""
  mine = {s.device: s.data for s in out.addressable_shards}
  if len(dst) == 1:
    r = mine[dst[0]]
    return r.reshape(shape) if not shape else r
  if not shape:
    return jax.make_array_from_single_device_arrays(
        (), _place(dst).replicated, [mine[d].reshape(()) for d in dst])
  return jax.make_array_from_single_device_arrays(shape, _place(dst).batch,
                                                  [mine[d] for d in dst])


_place = functools.lru_cache(maxsize=None)(placement_lib.place)


@functools.lru_cache(maxsize=None)
def _compiled(treedef, shapes: tuple, src: tuple, dst: tuple):
  """``(compiled ppermute src -> dst, input shardings)``; groups ordered by device id."""
  lowered, shardings = _lowered(treedef, shapes, src, dst)
  return lowered.compile(), shardings


def _lowered(treedef, shapes: tuple, src: tuple, dst: tuple):
  """``(jax.stages.Lowered, input shardings)`` of the ppermute ``src -> dst``.

  Lowered ahead of the first call, without the caller's traceback in its
  locations: the two processes call a transfer from different lines (the
  sender's and the receiver's branch), and jaxlib 0.12's CPU collectives never
  complete between two programs that differ only in their locations
  (docs/multihost.md, "JAX versions").
  """
  del treedef  # part of the cache key: one compilation per boundary
  pair = sorted((src, dst), key=lambda g: g[0].id)
  mesh = Mesh(np.array(pair), (_AXIS, "data"))
  perm = [(0, 1)] if pair[0] == src else [(1, 0)]
  specs = tuple(P((_AXIS, "data")) if _batched(shape, len(src)) else P(_AXIS)
                for shape, _ in shapes)
  shardings = tuple(NamedSharding(mesh, spec) for spec in specs)

  def body(*xs):
    return tuple(jax.lax.ppermute(x, _AXIS, perm) for x in xs)

  fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=specs))
  args = [jax.ShapeDtypeStruct(_global_shape(shape), dtype, sharding=sh)
          for (shape, dtype), sh in zip(shapes, shardings)]
  with _jax_options(jax_include_full_tracebacks_in_locations=False):
    return fn.lower(*args), shardings


@contextlib.contextmanager
def _jax_options(**options):
  """Sets JAX configuration options for the block, then restores their values."""
  before = {name: getattr(jax.config, name) for name in options}
  try:
    for name, value in options.items():
      jax.config.update(name, value)
    yield
  finally:
    for name, value in before.items():
      jax.config.update(name, value)


@functools.lru_cache(maxsize=None)
def _receive_buffers(shapes: tuple, dst: tuple) -> list:
  """Per leaf, zeros on each device of ``dst`` (the receiver's half; never donated)."""
  d = len(dst)
  out = []
  for shape, dtype in shapes:
    piece = ((shape[0] // d,) + shape[1:]) if _batched(shape, d) else (shape or (1,))
    out.append([jax.device_put(np.zeros(piece, dtype), device) for device in dst])
  return out
