"""orbax settings for checkpoints that each process writes alone.

orbax (0.12) saves the *global* arrays of all processes together; a PETRA
process holds state no other has, so each gets its own ``CheckpointManager``:
every host primary, this one the only active (no barriers), numpy arrays
written by this process (:class:`LocalNumpyHandler`), directories created
synchronously (no shared signal counters). Every orbax name is resolved at
import (:func:`_public`).
"""

from __future__ import annotations

import asyncio
import copy
import zlib
from typing import Optional, Sequence

import jax
import numpy as np
import orbax.checkpoint as ocp
import tensorstore as ts

TESTED_ORBAX = "0.12.8"


def _public(path: str):
  """The orbax attribute ``path``; ImportError naming the tested version."""
  obj = ocp
  for name in path.split("."):
    if not hasattr(obj, name):
      raise ImportError(
          f"orbax-checkpoint {getattr(ocp, '__version__', '?')} has no public "
          f"orbax.checkpoint.{path}, which petra_jax/training/orbax_local.py needs (tested "
          f"with orbax-checkpoint {TESTED_ORBAX}); install that version "
          f"(pip install orbax-checkpoint=={TESTED_ORBAX}) or port orbax_local.py.")
    obj = getattr(obj, name)
  return obj


_NumpyHandler = _public("type_handlers.NumpyHandler")
_SaveArgs = _public("type_handlers.SaveArgs")
_check_input_arguments = _public("type_handlers.check_input_arguments")
_create_registry = _public("type_handlers.create_type_handler_registry")
_write_tspec = _public("type_handlers.get_json_tspec_write")
_CommitFuture = _public("future.CommitFutureAwaitingContractedSignals")
_orbax_process_index = _public("multihost.process_index")


class LocalNumpyHandler(_NumpyHandler):
  """orbax's numpy handler writing from this process, not process 0;
  files and reading are ``NumpyHandler``'s.
  """

  async def serialize(self, values: Sequence[np.ndarray], infos: Sequence,
                      args: Optional[Sequence] = None) -> list:
    """One commit future writing copies of ``values``; ValueError for
    mismatched lengths or an empty array.
    """
    args = args or [_SaveArgs()] * len(values)
    _check_input_arguments(values, infos, args)
    for value, info in zip(values, infos):
      if value.size == 0:
        raise ValueError(f"Cannot save arrays with zero size: ParamInfo: [name={info.name},"
                         f"value_typestr={info.value_typestr}]")
    values = [copy.deepcopy(v) for v in values]
    return [_CommitFuture(self._write_all(values, infos, args), name="petra_local_numpy")]

  async def _write_all(self, values, infos, args) -> None:
    """Writes each array with tensorstore, as ``NumpyHandler`` does on process 0."""
    writes = []
    for value, info, arg in zip(values, infos, args):
      await info.await_path_creation()
      ocdbt = info.is_ocdbt_checkpoint
      spec = _write_tspec(info, use_ocdbt=ocdbt, global_shape=value.shape,
                          local_shape=value.shape, dtype=value.dtype,
                          process_index=_orbax_process_index() if ocdbt else None, arg=arg)
      writes.append(_write(value, spec, info.ts_context))
    # Every write ends before an error is raised (a full disk fails some).
    errors = [e for e in await asyncio.gather(*writes, return_exceptions=True)
              if isinstance(e, BaseException)]
    if errors:
      raise errors[0]


async def _write(value: np.ndarray, spec: dict, context) -> None:
  """Writes ``value`` to the tensorstore of JSON spec ``spec``.

  The dtype is passed beside the spec: some orbax releases leave it out of a zarr spec's
  metadata, which tensorstore then refuses ("dtype" must be specified).
  """
  store = await ts.open(ts.Spec(spec), create=True, open=True, context=context,
                        dtype=value.dtype)
  await store.write(value, can_reference_source_data_indefinitely=True)


def multiprocessing_options(path: str) -> ocp.options.MultiprocessingOptions:
  """Options for a manager run by this process alone."""
  p = jax.process_index()
  return ocp.options.MultiprocessingOptions(
      primary_host=None, active_processes={p},
      barrier_sync_key_prefix=f"petra_p{p}_{zlib.crc32(path.encode())}")


def item_handlers(path: str) -> dict:
  """The ``arrays`` and ``meta`` items' handlers of a manager over ``path``."""
  registry = _create_registry((np.ndarray, LocalNumpyHandler()))
  mp = multiprocessing_options(path)
  return {"arrays": ocp.PyTreeCheckpointHandler(multiprocessing_options=mp,
                                                type_handler_registry=registry),
          "meta": ocp.JsonCheckpointHandler(multiprocessing_options=mp)}


def manager_options(path: str, max_to_keep=None) -> ocp.CheckpointManagerOptions:
  """Options of a manager over ``path`` that only this process runs (no
  rotation by default: the caller prunes)."""
  return ocp.CheckpointManagerOptions(
      max_to_keep=max_to_keep, create=False,
      async_options=ocp.AsyncOptions(create_directories_asynchronously=False),
      multiprocessing_options=multiprocessing_options(path))
