"""Moving activations between stages' devices, within and across processes.

The one place that knows how an array travels from stage ``j``'s device to
stage ``j +- 1``'s. The engine's messenger (:mod:`petra_jax.engine.messages`)
calls :func:`send` when both devices belong to this process and
:func:`transfer` when one of them belongs to another ``jax.distributed``
process; nothing above it knows which route runs.

* **Within a process**: ``jax.device_put`` (asynchronous; a no-op when source
  and destination are the same device).
* **Across processes**: a jitted ``jax.shard_map`` over the mesh
  ``Mesh([src group, dst group], ("pair", "data"))`` (groups in id order; a
  group is one device, or a data-parallel stage's ``D`` devices) whose body is
  ``jax.lax.ppermute(x, "pair", [(0, 1)])`` (or ``[(1, 0)]``): device ``i``
  of one group sends its shard to device ``i`` of the other. Only the two
  processes owning ``src`` and ``dst`` call it, in the same order (every
  process runs the same host loop, so the order is the loop's). The sender's
  shards are its array's; the receiver's are cached buffers of zeros that
  only give the global array its shape;
  ``jax.make_array_from_single_device_arrays`` assembles the two.

Why this route: a collective over a two-device sub-mesh is documented JAX
(``shard_map`` + ``ppermute``) and runs on every backend: NCCL on GPU, ICI/DCN
on TPU and gloo on CPU (``jax_cpu_collectives_implementation="gloo"``, set by
:func:`enable_cpu_collectives` before the backend starts), so CI exercises the
same code as a cluster. The alternatives do not: the cross-process
``jax.device_put`` (documented since jax 0.9.1 for MPMD pipelines) raises
"does not support cross-host device transfers" on CPU unless an experimental
socket transport is configured, whose upstream test is disabled
(jax-ml/jax#26645); ``jax.lax.psend``/``precv`` are GPU-only; and
``multihost_utils.broadcast_one_to_all`` goes through the host. On GPU/TPU the
cross-process ``device_put`` could replace :func:`transfer` here without any
change above this module.

Compiled transfers are cached per ``(treedef, shapes, dtypes, src, dst)``: a
RevNet's stage boundaries all have different shapes, and each is compiled
once.
"""

from __future__ import annotations

import functools
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from petra_jax.engine import placement as placement_lib

PyTree = Any
_AXIS = "pair"


class PeerError(RuntimeError):
  """A cross-process transfer failed: the peer process died or is unreachable."""


def send(x: PyTree, device) -> PyTree:
  """Places the pytree ``x`` on ``device`` (``jax.device_put``, asynchronous).

  ``device``: a ``jax.Device`` or a sharding over this process's devices
  (a stage's :class:`petra_jax.engine.placement.Placement` target). Both
  ``x``'s devices and ``device`` must belong to this process; across
  processes use :func:`transfer`.
  """
  return jax.device_put(x, device)


def send_if_elsewhere(x, device, sharding) -> Any:
  """:func:`send` for one array, skipped when ``x`` is already a committed
  array laid out as ``sharding`` (``device`` as a sharding, built once by
  the caller): a same-device ``jax.device_put`` returns the same buffer, at
  a dispatch's host cost."""
  if isinstance(x, jax.Array) and x.committed and x.sharding == sharding:
    return x
  return send(x, device)


def is_local(device: jax.Device) -> bool:
  """Whether ``device`` belongs to this process (always True single-process)."""
  return device.process_index == jax.process_index()


def enable_cpu_collectives() -> None:
  """Selects gloo for CPU cross-process collectives (a no-op elsewhere).

  Must run before JAX initialises its backend (before the first
  ``jax.devices()`` or computation), e.g. right before
  ``jax.distributed.initialize``. Without it, CPU collectives across
  processes fail.
  """
  jax.config.update("jax_cpu_collectives_implementation", "gloo")


def transfer(x: Optional[PyTree], src, dst, spec: PyTree) -> Optional[PyTree]:
  """Moves the pytree ``x`` from ``src`` to ``dst`` across processes.

  Called by both owning processes, in the same order relative to their other
  transfers; other processes must not call it. Asynchronous like any jitted
  call (the receiver's result is a future).

  Args:
    x: on the process owning ``src``: a pytree of arrays on ``src`` (leaves
      may be None, e.g. ``(None, dx)``); on the process owning ``dst``: None
      (only ``spec`` is used).
    src: the source: a device, or a stage's
      :class:`petra_jax.engine.placement.Placement` (a group of ``D``
      devices, ``x``'s batched leaves sharded over it).
    dst: the destination, owned by another process (for two devices of
      this process use :func:`send`); a group of the same size as ``src``.
    spec: pytree of ``jax.ShapeDtypeStruct`` with ``x``'s structure, shapes
      and dtypes (None leaves as in ``x``).

  Returns:
    On the process owning ``dst``: the pytree on ``dst`` (with ``D > 1``:
    leaves of rank >= 1 sharded over its group along axis 0, scalars
    replicated), shapes and dtypes of ``spec``. On the process owning
    ``src``: ``x`` itself.

  Raises:
    ValueError: if this process owns neither or both ends.
    PeerError: the collective failed, typically because the other process
      died (gloo reports it at once; on GPU/TPU a dead peer is caught by the
      ``jax.distributed`` heartbeat, which terminates this process).
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
  """The global array over the ``(pair, data)`` mesh: the two ends' leaves
  side by side on axis 0 (a scalar as ``[1]``)."""
  return (2 * shape[0],) + shape[1:] if shape else (2,)


def _send_shards(leaves, shapes, src: tuple) -> list:
  """Per leaf, the sender's pieces, one per device of ``src`` in order: its
  shards along axis 0 for a batched leaf, else the whole leaf (a scalar as
  ``[1]``), gathered on the device first if it lies elsewhere."""
  out = []
  for a, (shape, _) in zip(leaves, shapes):
    if _batched(shape, len(src)):
      by_device = {s.device: s.data for s in a.addressable_shards}
      out.append([by_device[d] for d in src])
      continue
    pieces = []
    for d in src:
      local = a if a.sharding == jax.sharding.SingleDeviceSharding(d) else jax.device_put(a, d)
      pieces.append(local.reshape(1) if not shape else local)
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
  """``(jitted ppermute from src to dst, each leaf's input sharding)``.

  The ``(pair, data)`` mesh lists the two groups by first device id whatever
  the direction, so both directions between two groups share one
  communicator (set up at the pair's first transfer); device ``i`` of one
  group sends to device ``i`` of the other.
  """
  del treedef  # part of the cache key: one compilation per boundary
  pair = sorted((src, dst), key=lambda g: g[0].id)
  mesh = Mesh(np.array(pair), (_AXIS, "data"))
  perm = [(0, 1)] if pair[0] == src else [(1, 0)]
  specs = tuple(P((_AXIS, "data")) if _batched(shape, len(src)) else P(_AXIS)
                for shape, _ in shapes)

  def body(*xs):
    return tuple(jax.lax.ppermute(x, _AXIS, perm) for x in xs)

  fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=specs))
  return fn, tuple(NamedSharding(mesh, spec) for spec in specs)


@functools.lru_cache(maxsize=None)
def _receive_buffers(shapes: tuple, dst: tuple) -> list:
  """Per leaf, zeros on each device of ``dst`` standing for the receiver's
  half of the global array (a batched leaf's shard, or the whole leaf).

  Never donated, so one buffer per boundary serves every transfer.
  """
  d = len(dst)
  out = []
  for shape, dtype in shapes:
    piece = ((shape[0] // d,) + shape[1:]) if _batched(shape, d) else (shape or (1,))
    out.append([jax.device_put(np.zeros(piece, dtype), device) for device in dst])
  return out
