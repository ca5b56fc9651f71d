"""Moving activations between stages' devices, within and across processes.

The one place that knows how an array travels from stage ``j``'s device to
stage ``j +- 1``'s. The engine's messenger (:mod:`petra_jax.engine.messages`)
calls :func:`send` when both devices belong to this process and
:func:`transfer` when one of them belongs to another ``jax.distributed``
process; nothing above it knows which route runs.

* **Within a process**: ``jax.device_put`` (asynchronous; a no-op when source
  and destination are the same device).
* **Across processes**: a jitted ``jax.shard_map`` over the two-device mesh
  ``Mesh([src, dst], ("pair",))`` (devices in id order) whose body is
  ``jax.lax.ppermute(x, "pair", [(0, 1)])`` (or ``[(1, 0)]``). Only the two processes owning
  ``src`` and ``dst`` call it, in the same order (every process runs the same
  host loop, so the order is the loop's). The sender's shard is its array;
  the receiver's is a cached buffer of zeros that only gives the global array
  its shape; ``jax.make_array_from_single_device_arrays`` assembles the two.

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

PyTree = Any
_AXIS = "pair"


class PeerError(RuntimeError):
  """A cross-process transfer failed: the peer process died or is unreachable."""


def send(x: PyTree, device: jax.Device) -> PyTree:
  """Places the pytree ``x`` on ``device`` (``jax.device_put``, asynchronous).

  Both ``x``'s devices and ``device`` must belong to this process; across
  processes use :func:`transfer`.
  """
  return jax.device_put(x, device)


def send_if_elsewhere(x, device: jax.Device, sharding) -> Any:
  """:func:`send` for one array, skipped when ``x`` is already a committed
  array on ``device`` (``sharding``: ``SingleDeviceSharding(device)``, built
  once by the caller): a same-device ``jax.device_put`` returns the same
  buffer, at a dispatch's host cost."""
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


def transfer(x: Optional[PyTree], src: jax.Device, dst: jax.Device,
             spec: PyTree) -> Optional[PyTree]:
  """Moves the pytree ``x`` from ``src`` to ``dst`` across processes.

  Called by both owning processes, in the same order relative to their other
  transfers; other processes must not call it. Asynchronous like any jitted
  call (the receiver's result is a future).

  Args:
    x: on the process owning ``src``: a pytree of arrays on ``src`` (leaves
      may be None, e.g. ``(None, dx)``); on the process owning ``dst``: None
      (only ``spec`` is used).
    src: the source device.
    dst: the destination device, owned by another process (for two devices of
      this process use :func:`send`).
    spec: pytree of ``jax.ShapeDtypeStruct`` with ``x``'s structure, shapes
      and dtypes (None leaves as in ``x``).

  Returns:
    On the process owning ``dst``: the pytree on ``dst``, shapes and dtypes
    of ``spec``. On the process owning ``src``: ``x`` itself.

  Raises:
    ValueError: if this process owns neither or both devices.
    PeerError: the collective failed, typically because the other process
      died (gloo reports it at once; on GPU/TPU a dead peer is caught by the
      ``jax.distributed`` heartbeat, which terminates this process).
  """
  here = jax.process_index()
  if (src.process_index == here) == (dst.process_index == here):
    raise ValueError(
        f"transfer() is for two devices of different processes, one of them this one "
        f"({here}); got src={src} (process {src.process_index}) and dst={dst} "
        f"(process {dst.process_index}). Use send() within a process.")
  sending = src.process_index == here
  leaves, treedef = jax.tree.flatten(spec)
  shapes = tuple((tuple(s.shape), jnp.dtype(s.dtype)) for s in leaves)
  fn, sharding = _compiled(treedef, shapes, src, dst)
  if sending:
    shards = [a.reshape(1) if not shape else a
              for a, (shape, _) in zip(jax.tree.leaves(x), shapes)]
  else:
    shards = _receive_buffers(shapes, dst)
  inputs = [
      jax.make_array_from_single_device_arrays(_global_shape(shape), sharding, [shard])
      for (shape, _), shard in zip(shapes, shards)]
  try:
    outputs = fn(*inputs)
  except Exception as e:  # pylint: disable=broad-except  (jaxlib's runtime errors)
    peer = dst.process_index if sending else src.process_index
    raise PeerError(
        f"the transfer {'to' if sending else 'from'} process {peer} ({src} -> {dst}) failed; "
        f"process {peer} has probably died (see its log). Cause: "
        f"{str(e).splitlines()[0]}") from e
  if sending:
    return x
  received = [out.addressable_shards[0].data for out in outputs]
  received = [r.reshape(shape) if not shape else r for r, (shape, _) in zip(received, shapes)]
  return jax.tree.unflatten(treedef, received)


def _global_shape(shape: tuple) -> tuple:
  """The 2-device global array: the two shards side by side on axis 0."""
  return (2 * shape[0],) + shape[1:] if shape else (2,)


@functools.lru_cache(maxsize=None)
def _compiled(treedef, shapes: tuple, src: jax.Device, dst: jax.Device):
  """``(jitted ppermute from src to dst, its input sharding)``.

  The mesh lists the pair by device id whatever the direction, so both
  directions between two devices share one communicator (set up at the
  pair's first transfer).
  """
  del treedef, shapes  # part of the cache key: one compilation per boundary
  pair = sorted((src, dst), key=lambda d: d.id)
  mesh = Mesh(np.array(pair), (_AXIS,))
  sharding = NamedSharding(mesh, P(_AXIS))
  perm = [(0, 1)] if pair[0] == src else [(1, 0)]

  def body(*xs):
    return tuple(jax.lax.ppermute(x, _AXIS, perm) for x in xs)

  fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(_AXIS), out_specs=P(_AXIS)))
  return fn, sharding


@functools.lru_cache(maxsize=None)
def _receive_buffers(shapes: tuple, dst: jax.Device) -> list:
  """Zeros on ``dst`` standing for the receiver's half of the global arrays.

  Never donated, so one buffer per boundary serves every transfer.
  """
  return [jax.device_put(np.zeros(shape or (1,), dtype), dst) for shape, dtype in shapes]
