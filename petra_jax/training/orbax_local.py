"""orbax pieces for checkpoints that each process writes alone.

orbax (0.12) assumes that the processes of a ``jax.distributed`` run save one
checkpoint of *global* arrays together: it refuses host-local ``jax.Array``
s, writes numpy arrays from process 0 only (they are taken as replicated),
and names the signals of asynchronous saves after a per-process counter of
operations. A PETRA process holds state no other process has (its own
stages and messages), so :mod:`petra_jax.training.checkpoint` gives every process its
own ``CheckpointManager`` over its own directory, built here with:

* :func:`item_handlers`: the ``arrays`` item's ``PyTreeCheckpointHandler``
  and the ``meta`` item's ``JsonCheckpointHandler`` with this process as
  their primary host, and numpy arrays written by this process
  (:class:`LocalNumpyHandler`);
* :func:`manager_options`: this process as the manager's only process (no
  barrier with the others), directories created synchronously, and
  orbax's operation counter offset by the process index
  (:func:`separate_operation_ids`), so simultaneous saves of different
  processes do not read each other's signals.

With one process all of it is what orbax does anyway.
"""

from __future__ import annotations

import asyncio
import itertools
import zlib
from typing import Optional, Sequence

import jax
import numpy as np
import orbax.checkpoint as ocp
from orbax.checkpoint._src import asyncio_utils
from orbax.checkpoint._src.futures import synchronization
from orbax.checkpoint._src.serialization import ocdbt_utils
from orbax.checkpoint._src.serialization import tensorstore_utils as ts_utils
from orbax.checkpoint._src.serialization import type_handler_registry
from orbax.checkpoint._src.serialization import type_handlers
from orbax.checkpoint._src.serialization import types


class LocalNumpyHandler(type_handlers.NumpyHandler):
  """orbax's numpy handler, writing from this process instead of process 0
  (the arrays are this process's own, not replicated ones)."""

  async def _background_serialize(self, values: Sequence[np.ndarray],
                                  infos: Sequence[types.ParamInfo],
                                  args: Optional[Sequence[types.SaveArgs]] = None):
    writes = []
    for value, info, arg in zip(values, infos, args or [types.SaveArgs()] * len(values)):
      await info.await_path_creation()
      spec = ts_utils.build_array_write_spec(
          info=info, arg=arg, global_shape=value.shape, local_shape=value.shape,
          dtype=value.dtype, use_ocdbt=info.is_ocdbt_checkpoint,
          process_index=ocdbt_utils.get_process_index_for_subdir(
              use_ocdbt=info.is_ocdbt_checkpoint,
              override_ocdbt_process_id=self._override_ocdbt_process_id),
          metadata_key=self._metadata_key)
      writes.append(self._open_and_write(value, spec.json, info.ts_context))
    await asyncio_utils.cancellable(asyncio.gather(*writes),
                                    message="local numpy write cancelled",
                                    process_index=jax.process_index())


def _multiprocessing(path: str) -> ocp.options.MultiprocessingOptions:
  p = jax.process_index()
  return ocp.options.MultiprocessingOptions(
      primary_host=p, active_processes={p},
      barrier_sync_key_prefix=f"petra_p{p}_{zlib.crc32(path.encode())}")


def item_handlers(path: str) -> dict:
  """The ``arrays`` and ``meta`` items' handlers for a manager over ``path``."""
  registry = type_handler_registry.create_type_handler_registry(
      (np.ndarray, LocalNumpyHandler()))
  mp = _multiprocessing(path)
  return {"arrays": ocp.PyTreeCheckpointHandler(multiprocessing_options=mp,
                                                type_handler_registry=registry),
          "meta": ocp.JsonCheckpointHandler(multiprocessing_options=mp)}


def manager_options(path: str, max_to_keep=None) -> ocp.CheckpointManagerOptions:
  """Options of a manager over ``path`` that only this process runs."""
  separate_operation_ids()
  return ocp.CheckpointManagerOptions(
      max_to_keep=max_to_keep, create=False,
      async_options=ocp.AsyncOptions(create_directories_asynchronously=False),
      multiprocessing_options=_multiprocessing(path))


def separate_operation_ids() -> None:
  """Offsets orbax's operation counter by ``10**9`` times the process index
  (once; a no-op on process 0)."""
  p = jax.process_index()
  gen = synchronization.OperationIdGenerator
  if p == 0 or getattr(gen, "_petra_offset", False):
    return
  gen._operation_id_counter = itertools.count(p * 10**9)  # pylint: disable=protected-access
  gen._operation_id = next(gen._operation_id_counter)  # pylint: disable=protected-access
  gen._petra_offset = True  # pylint: disable=protected-access
