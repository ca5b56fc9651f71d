"""Checkpoints of the whole pipeline (in-flight micro-batches, buffers, partial
accumulations, counters) with orbax ``CheckpointManager``.

Every process writes its part into ``DIR/<step>/`` (process 0) or
``DIR/process_<p>/<step>/``: ``arrays`` (blocks, :mod:`blocks`;
in-flight payloads, :mod:`in_flight`; the caller's arrays) and
``meta`` (JSON: fingerprint, tick, ``drained``, layout, the caller's
``extra``). A step counts once every process that wrote it has committed
its part (an *incomplete* step is deleted on restore); a step that cannot
be read is *corrupt* and moved to ``DIR/corrupt_<step>``. Another stage
grouping restores only from a drained checkpoint.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
from typing import Any, Optional, Sequence

import jax
import numpy as np
import orbax.checkpoint as ocp

from petra_jax import models
from petra_jax.engine.transport.pipeline_state import PipelineState
from petra_jax.training.checkpoint import blocks as blocks_lib
from petra_jax.training.checkpoint import in_flight as state_lib
from petra_jax.training.checkpoint import orbax_local
from petra_jax.training.console import disk_full
from petra_jax.training.checkpoint.blocks import (CheckpointError, merge_blocks, split_stage,
                                                  stage_block_count)


def process_dir(directory: str, process: int) -> str:
  """Where process ``process`` writes: ``directory`` for process 0, else
  ``directory/process_<p>``."""
  return directory if process == 0 else os.path.join(directory, f"process_{process}")


def _manager(path: str) -> ocp.CheckpointManager:
  """An orbax manager over one process's directory, run by this process
  alone (:mod:`petra_jax.training.checkpoint.orbax_local`; the commit across processes is ours)."""
  return ocp.CheckpointManager(path, options=orbax_local.manager_options(path),
                               item_handlers=orbax_local.item_handlers(path))


def _read_meta(manager: ocp.CheckpointManager, step: int) -> dict:
  """The JSON ``meta`` item of checkpoint ``step`` (raises if unreadable)."""
  return manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]


def newest_meta(directory: str) -> Optional[tuple[int, dict]]:
  """``(step, meta)`` of the newest readable checkpoint of process 0 in
  ``directory``; None if there is none."""
  if not os.path.isdir(directory):
    return None
  manager = _manager(os.path.abspath(directory))
  try:
    for step in sorted(manager.all_steps(), reverse=True):
      try:
        return step, _read_meta(manager, step)
      except Exception:  # pylint: disable=broad-except
        continue
    return None
  finally:
    manager.close()


def saved_fingerprint(directory: str) -> Optional[dict]:
  """The fingerprint of the newest readable checkpoint in ``directory`` (None:
  none), e.g. the grouping a ``model.balance_by="time"`` run chose."""
  newest = newest_meta(directory)
  return None if newest is None else newest[1]["fingerprint"]


def _all_processes(ok: bool) -> bool:
  """Whether ``ok`` holds on every process (a collective when several)."""
  if jax.process_count() == 1:
    return ok
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  return bool(np.all(multihost_utils.process_allgather(np.int32(ok))))


# Fingerprint fields a restore may change (resharding), the others must match.
RESHARDABLE = ("num_stages", "stage_sizes")


class Checkpointer:
  """Saves and restores :class:`PipelineState` plus caller metadata.

  Every process builds one and calls every method at the same steps.
  ``keep`` known-good checkpoints are kept (:meth:`prune`); ``fingerprint``
  must match on restore except its :data:`RESHARDABLE` fields.
  """

  def __init__(self, directory: str, keep: int, fingerprint: dict,
               block_counts: Optional[Sequence[int]] = None):
    self.directory = os.path.abspath(directory)
    self.fingerprint = {**fingerprint, **models.source_fingerprint(fingerprint.get("model", ""))}
    self.keep = keep
    self.block_counts = None if block_counts is None else [int(n) for n in block_counts]
    own = process_dir(self.directory, jax.process_index())
    os.makedirs(own, exist_ok=True)
    self.manager = _manager(own)
    self._others: dict[int, ocp.CheckpointManager] = {}
    self._corrupt: set[int] = set()
    self._saving: Optional[int] = None

  def _counts(self, state: PipelineState) -> list[int]:
    if self.block_counts is not None:
      return self.block_counts
    if any(s is None for s in state.train_states):
      raise ValueError("Checkpointer needs block_counts when stages live on other processes.")
    return [stage_block_count(s) for s in state.train_states]

  def _reader(self, process: int) -> ocp.CheckpointManager:
    """The manager of process ``process``'s directory (ours for ourselves)."""
    if process == jax.process_index():
      return self.manager
    if process not in self._others:
      self._others[process] = _manager(process_dir(self.directory, process))
    return self._others[process]

  def prune(self, verified_through: int) -> None:
    """Keeps the newest ``keep`` checkpoints at steps ``<= verified_through``
    and every newer one (this process's part).
    """
    steps = sorted(self.manager.all_steps())
    good = [s for s in steps if s <= verified_through]
    for s in good[:max(len(good) - self.keep, 0)]:
      self.manager.delete(s)

  def discard_from(self, step: int) -> None:
    """Deletes every checkpoint at ``step`` or later (waits for pending saves)."""
    self.manager.wait_until_finished()
    for s in self.manager.all_steps():
      if s >= step:
        self.manager.delete(s)

  def save(self, step: int, state: PipelineState, extra: dict,
           extra_arrays: Optional[dict[int, Any]] = None) -> None:
    """Starts an asynchronous save at ``step`` (arrays copied off the devices
    first); ``extra`` is JSON-able, ``extra_arrays`` int-keyed arrays.

    Raises:
      CheckpointError: the disk is full (also for an earlier save).
    """
    counts = self._counts(state)
    blocks = blocks_lib.stage_blocks(state, counts)
    arrays, entries = state_lib.flatten_in_flight(state, extra_arrays or {})
    arrays["blocks"] = {b: blocks_lib.flat_opt(v) for b, v in blocks.items()}
    meta = {"fingerprint": self.fingerprint, "tick": state.tick,
            "drained": state.in_flight() == 0, "process": jax.process_index(),
            "num_processes": jax.process_count(), "block_counts": counts,
            "blocks": sorted(arrays["blocks"]), "in_flight": entries["in_flight"],
            "opt_paths": {b: blocks_lib.opt_paths(v["opt_state"]) for b, v in blocks.items()},
            "extra_entries": entries["extra"], "extra": extra}
    with self._disk_full_is_one_line(step):
      # As numpy: orbax refuses host-local jax.Arrays in a multi-process run.
      self.manager.save(step, args=ocp.args.Composite(
          arrays=ocp.args.PyTreeSave(jax.device_get(arrays)), meta=ocp.args.JsonSave(meta)))
    self._saving = step

  @contextlib.contextmanager
  def _disk_full_is_one_line(self, step: int):
    """Turns a full disk while writing into one :class:`CheckpointError`
    (the checkpoints already saved stay, older ones are pruned only after)."""
    try:
      yield
    except Exception as e:  # pylint: disable=broad-except
      if not disk_full(e):
        raise
      failed = self._saving if self._saving is not None else step
      kept = sorted(s for s in self.manager.all_steps() if s != failed)
      raise CheckpointError(
          f"disk full while writing checkpoint {self.directory}/{failed}; the checkpoints "
          f"saved before ({kept or 'none'}) are intact: free space on that disk, then re-run "
          "the same command to resume.") from None

  def restore(self, template: PipelineState, devices: list) -> Optional[tuple]:
    """Restores the newest complete, valid checkpoint (every process).

    Args:
      template: a fresh state of this pipeline (None: other processes' stages).
      devices: each stage's device or sharding.

    Returns:
      ``(step, state, extra, extra_arrays)``, or None if there is none.

    Raises:
      CheckpointError: another run's checkpoint, a regrouping of an undrained
        one, or none complete and valid.
    """
    steps = sorted(self._reader(0).all_steps(), reverse=True)
    if not steps:
      self._delete_newer(-1)
      return None
    for step in steps:
      metas = self._complete_metas(step)
      if metas is not None:
        self._check_fingerprint(metas[0]["fingerprint"], step)
        counts = self._counts(template)
        blocks_lib.check_layout(metas[0], counts, self.directory, step)
        blocks_lib.check_optimizer_fit(metas, blocks_lib.stage_blocks(template, counts),
                                       f"{self.directory}/{step}")
      try:
        result = None if metas is None else self._restore_arrays(step, metas, template, devices)
      except CheckpointError:
        raise
      except Exception as e:  # pylint: disable=broad-except
        self._warn_corrupt(step, e)
        result = None
      if _all_processes(result is not None):
        self._delete_newer(step)
        return (step,) + result
    what = "corrupt" if self._corrupt == set(steps) else "corrupt or incomplete"
    raise CheckpointError(
        f"every checkpoint in {self.directory} is {what} (steps {steps}; the log above says "
        "why); move that directory away or pass --restart to start afresh, or use another "
        "--workdir.")

  def _warn_corrupt(self, step: int, e: BaseException) -> None:
    self._corrupt.add(step)
    logging.warning("checkpoint %s/%d is corrupt (%s: %s); trying an older one.",
                    self.directory, step, type(e).__name__, str(e)[:200])

  def _complete_metas(self, step: int) -> Optional[list]:
    """Every writer's meta of ``step``, or None (with a warning) if one is
    missing or unreadable: the step was not committed by every process."""
    metas = []
    try:
      metas.append(_read_meta(self._reader(0), step))
      for q in range(1, metas[0].get("num_processes", 1)):
        reader = self._reader(q)
        if step not in reader.all_steps():
          logging.warning("checkpoint %s/%d is incomplete: process %d did not finish its "
                          "part; trying an older one.", self.directory, step, q)
          return None
        metas.append(_read_meta(reader, step))
    except Exception as e:  # pylint: disable=broad-except
      self._warn_corrupt(step, e)
      return None
    if "blocks" not in metas[0]:
      raise CheckpointError(f"checkpoint {self.directory}/{step} was written by an older "
                            "petra_jax (per-stage layout); use another --workdir.")
    return metas

  def _check_fingerprint(self, saved: dict, step: int):
    diffs = [f"{k}: checkpoint {saved[k]!r} vs config {v!r}"
             for k, v in self.fingerprint.items()
             if k in saved and saved[k] != v and k not in RESHARDABLE]
    if diffs:
      raise CheckpointError(
          f"checkpoint {self.directory}/{step} comes from a different run ("
          + "; ".join(diffs) + "); use another --workdir or the original config.")

  def _delete_newer(self, step: int) -> None:
    """Deletes this process's steps after ``step`` (not committed by every
    process, or unreadable): the resumed run writes them again."""
    moved = False
    for s in self.manager.all_steps():
      if s > step and s in self._corrupt:
        kept = os.path.join(str(self.manager.directory), f"corrupt_{s}")
        shutil.rmtree(kept, ignore_errors=True)
        os.rename(os.path.join(str(self.manager.directory), str(s)), kept)
        logging.warning("moved corrupt checkpoint %s/%d to %s (delete it once looked at)",
                        self.manager.directory, s, kept)
        moved = True
      elif s > step:
        logging.warning("deleting %s/%d: newer than the checkpoint resumed from, incomplete",
                        self.manager.directory, s)
        self.manager.delete(s)
    if moved:
      self.manager.reload()

  def _requests(self, metas, template: PipelineState, devices) -> dict:
    """Per writer process, the abstract arrays this process needs from it."""
    counts = self._counts(template)
    block_owner = {int(b): q for q, m in enumerate(metas) for b in m["blocks"]}
    stage_owner = {int(j): q for q, m in enumerate(metas) for j in m["in_flight"]}
    requests = {q: {"blocks": {}, "in_flight": {}, "extra": {}} for q in range(len(metas))}
    for j, st in enumerate(template.train_states):
      if st is None:
        continue
      abstract = jax.tree.map(lambda x, d=devices[j]: state_lib.abstract(x.shape, x.dtype, d),
                              st)
      first = sum(counts[:j])
      for i, block in enumerate(split_stage(abstract, counts[j])):
        b = first + i
        requests[block_owner[b]]["blocks"][f"{b:03d}"] = blocks_lib.flat_opt(block)
      q = stage_owner.get(j)
      wanted = {} if q is None else state_lib.entries_abstract(metas[q]["in_flight"][str(j)],
                                                               devices[j])
      if wanted:
        requests[q]["in_flight"][str(j)] = wanted
    if jax.process_index() == 0:
      requests[0]["extra"] = state_lib.entries_abstract(metas[0]["extra_entries"], devices[0])
    return {q: {k: v for k, v in r.items() if v} for q, r in requests.items()}

  def _read_arrays(self, step: int, metas, template, devices) -> dict:
    """``{"blocks": ..., "in_flight": ..., "extra": ...}`` merged over the
    writer processes (only what this process needs)."""
    out = {"blocks": {}, "in_flight": {}, "extra": {}}
    for q, request in self._requests(metas, template, devices).items():
      if not any(request.values()):
        continue
      as_numpy = jax.tree.map(lambda x: ocp.RestoreArgs(restore_type=np.ndarray), request)
      restored = self._reader(q).restore(step, args=ocp.args.Composite(
          arrays=ocp.args.PyTreeRestore(item=request, restore_args=as_numpy,
                                        partial_restore=True)))["arrays"]
      for key, value in restored.items():
        out[key].update(jax.tree.map(lambda a, x: jax.device_put(a, x.sharding), value,
                                     request[key]))
    return out

  def _restore_arrays(self, step, metas, template: PipelineState, devices):
    arrays = self._read_arrays(step, metas, template, devices)
    counts = self._counts(template)
    states = []
    for j, st in enumerate(template.train_states):
      first = sum(counts[:j])
      states.append(None if st is None else merge_blocks(
          [blocks_lib.unflat_opt(arrays["blocks"][f"{first + i:03d}"], like)
           for i, like in enumerate(split_stage(st, counts[j]))], st))
    state = PipelineState.empty(states, tick=metas[0]["tick"])
    if not metas[0]["drained"]:
      state_lib.refill(state, metas, arrays["in_flight"])
    extra_arrays = {key: payload for _, key, payload in
                    state_lib.unflatten(metas[0]["extra_entries"], arrays["extra"])} \
        if jax.process_index() == 0 else {}
    return state, metas[0]["extra"], extra_arrays

  def latest_step(self) -> Optional[int]:
    """The newest checkpoint's step (saved or being saved), None if none."""
    return self.manager.latest_step()

  def wait(self):
    """Blocks until pending saves are on disk; CheckpointError if disk full."""
    with self._disk_full_is_one_line(-1):
      self.manager.wait_until_finished()
    self._saving = None

  def close(self):
    self.manager.close()
    for m in self._others.values():
      m.close()
