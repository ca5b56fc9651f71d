"""Checkpoints of the whole pipeline, with orbax ``CheckpointManager``.

A PETRA run has state that plain training does not: micro-batches in flight,
the input buffers of non-reversible stages, partial gradient accumulations
(inside each stage's optax ``MultiSteps`` state) and per-stage counters. A
checkpoint holds all of it, plus whatever the caller adds (the data position,
the losses not yet logged), so a resumed run continues as if it had never
stopped.

Layout. Every process writes the state it holds into its own orbax
directory, ``DIR/<step>/`` for process 0 and ``DIR/process_<p>/<step>/`` for
process ``p`` (one process: only the first; the orbax settings that let a
process save alone are :mod:`~petra_jax.training.orbax_local`'s), each step
with two items:

* ``arrays`` (``ocp.args.PyTreeSave``): ``{"blocks": {"007": block, ...},
  "in_flight": {"<stage>": {"00000": array, ...}}, "extra": {...}}``. State
  is stored **per block** (global block index over the model, not per
  stage; :mod:`~petra_jax.training.checkpoint_blocks`): :func:`split_stage`
  cuts a grouped stage's parameters, statistics and optimizer state into its
  blocks, :func:`merge_blocks` regroups them, so a checkpoint can be
  resumed with another stage grouping, device count or process count.
  In-flight payloads are stored per stage
  (:mod:`~petra_jax.training.checkpoint_state`), ``extra`` (the caller's
  arrays, e.g. unlogged losses) by process 0;
* ``meta`` (JSON): the fingerprint, the tick, ``drained`` (no micro-batch in
  flight), the writer's process and the process count, the blocks per stage,
  the blocks it wrote, where each in-flight array belongs (slot, stage,
  micro-batch, pytree spec, shape, dtype) and the caller's ``extra`` dict.

Commit. orbax writes each process's step into a temporary directory and
renames it when complete. A step counts only once **every** process of the
run that wrote it has renamed its part: a restore reads process 0's meta
(how many processes wrote), checks that each of them has the step, and
otherwise falls back to an older one; all processes read the same files, so
they pick the same step (the directory must be shared by the processes, as
it is on one machine or on a cluster file system). After a restore each
process deletes its newer (incomplete) steps, which the run will write anew.

Resharding. In-flight micro-batches belong to the stage grouping that made
them, so a checkpoint restores with another grouping (``model.num_stages``,
``model.stage_sizes``) only if it was taken on a drained pipeline (the one at
the end of training, or with ``checkpoint_drain``); every block's
parameters, statistics and optimizer state carry over exactly; the counters
a stage shares (``micro_batches``, optax ``count``/``mini_step``) are equal
in every block of a drained pipeline. Another device or process count with
the same grouping needs no drain.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Optional, Sequence

import jax
import numpy as np
import orbax.checkpoint as ocp

from petra_jax import models
from petra_jax.engine.state import PipelineState
from petra_jax.training import checkpoint_blocks as blocks_lib
from petra_jax.training import checkpoint_state as state_lib
from petra_jax.training import orbax_local
# Also imported from here by callers (train.py, tests).
from petra_jax.training.checkpoint_blocks import (  # noqa: F401  pylint: disable=unused-import
    CheckpointError, merge_blocks, split_stage, stage_block_count)


# ----------------------------------------------------------------------------
# Directories and managers.
# ----------------------------------------------------------------------------

def process_dir(directory: str, process: int) -> str:
  """Where process ``process`` writes: ``directory`` for process 0, else
  ``directory/process_<p>``."""
  return directory if process == 0 else os.path.join(directory, f"process_{process}")


def _manager(path: str) -> ocp.CheckpointManager:
  """An orbax manager over one process's directory, run by this process
  alone (:mod:`petra_jax.training.orbax_local`; the commit across processes is ours)."""
  return ocp.CheckpointManager(path, options=orbax_local.manager_options(path),
                               item_handlers=orbax_local.item_handlers(path))


def _read_meta(manager: ocp.CheckpointManager, step: int) -> dict:
  """The JSON ``meta`` item of checkpoint ``step`` (raises if unreadable)."""
  return manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]


def saved_fingerprint(directory: str) -> Optional[dict]:
  """The fingerprint of the newest readable checkpoint in ``directory``.

  Returns None when the directory holds no checkpoint (or does not exist).
  Lets a resumed run rebuild what it decided at its start, e.g. the stage
  grouping chosen from measured times (``model.balance_by="time"``).
  """
  if not os.path.isdir(directory):
    return None
  manager = _manager(os.path.abspath(directory))
  try:
    for step in sorted(manager.all_steps(), reverse=True):
      try:
        return _read_meta(manager, step)["fingerprint"]
      except Exception:  # pylint: disable=broad-except  (unreadable: try an older one)
        continue
    return None
  finally:
    manager.close()


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

  Every process of a multi-process run builds one and calls every method
  at the same steps (see the module docstring for the layout and commit).

  Args:
    directory: where checkpoints go (``WORKDIR/checkpoints``).
    keep: how many of the latest known-good checkpoints to keep
      (:meth:`prune`); newer ones whose losses are still in flight are kept
      too.
    fingerprint: what must match for a checkpoint to be resumed (model,
      method...); JSON-able. Its :data:`RESHARDABLE` fields may differ.
    block_counts: blocks per stage (default: read from the state, which
      needs every stage on this process).
  """

  def __init__(self, directory: str, keep: int, fingerprint: dict,
               block_counts: Optional[Sequence[int]] = None):
    self.directory = os.path.abspath(directory)
    self.fingerprint = {**fingerprint, **models.source_fingerprint(fingerprint.get("model", ""))}
    self.keep = keep
    self.block_counts = None if block_counts is None else [int(n) for n in block_counts]
    own = process_dir(self.directory, jax.process_index())
    os.makedirs(own, exist_ok=True)
    # Rotation is ours (prune): a checkpoint only counts once the losses of
    # every micro-batch before it are known finite.
    self.manager = _manager(own)
    self._others: dict[int, ocp.CheckpointManager] = {}

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
    (known good) and every newer one; deletes the older ones (this
    process's part)."""
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
    """Starts an (asynchronous) save of this process's part at ``step``.

    Args:
      step: optimizer updates so far (the checkpoint's name).
      state: the pipeline state; its arrays are copied off the devices before
        this returns, so the pipeline can run on while the write finishes.
      extra: JSON-able caller state (data position, log offsets...).
      extra_arrays: caller arrays keyed by int (see
        :func:`~petra_jax.training.checkpoint_state.flatten_in_flight`).
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
    # As numpy: orbax refuses host-local jax.Arrays in a multi-process run.
    self.manager.save(step, args=ocp.args.Composite(
        arrays=ocp.args.PyTreeSave(jax.device_get(arrays)), meta=ocp.args.JsonSave(meta)))

  def restore(self, template: PipelineState, devices: list) -> Optional[tuple]:
    """Restores the newest complete, valid checkpoint (every process).

    Args:
      template: a freshly initialised state of this pipeline (gives the
        stage pytree structure, shapes; None for other processes' stages).
      devices: where each stage's state goes: its device, or its sharding
        (``Placement.state_sharding``: a data-parallel stage's replicated
        state).

    Returns:
      ``(step, state, extra, extra_arrays)``, or None if there is no
      checkpoint. ``extra_arrays`` is empty off process 0; ``state.tick`` is
      the saved tick (meaningless with another grouping: the state is
      drained then).

    Raises:
      CheckpointError: the checkpoint comes from a different run (model,
        method...), was taken with micro-batches in flight and another stage
        grouping, or no checkpoint in the directory is complete and valid.
    """
    steps = sorted(self._reader(0).all_steps(), reverse=True)
    if not steps:
      self._delete_newer(-1)  # parts of steps process 0 never completed
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
        logging.warning("checkpoint %s/%d is corrupt or partial (%s: %s); trying an older "
                        "one.", self.directory, step, type(e).__name__, str(e)[:200])
        result = None
      if _all_processes(result is not None):
        self._delete_newer(step)
        return (step,) + result
    raise CheckpointError(
        f"no valid checkpoint in {self.directory} (steps tried: {steps}); delete the "
        "directory to start afresh, or use another --workdir.")

  def _complete_metas(self, step: int) -> Optional[list]:
    """Every writer's meta of ``step``, or None (with a warning) if one is
    missing or unreadable: the step was not committed by every process."""
    metas = []
    try:
      metas.append(_read_meta(self._reader(0), step))
      for q in range(1, metas[0].get("num_processes", 1)):
        reader = self._reader(q)
        if step not in reader.all_steps():
          raise FileNotFoundError(f"process {q} has no step {step}")
        metas.append(_read_meta(reader, step))
    except Exception as e:  # pylint: disable=broad-except
      logging.warning("checkpoint %s/%d is incomplete or unreadable (%s: %s); trying an older "
                      "one.", self.directory, step, type(e).__name__, str(e)[:200])
      return None
    if "blocks" not in metas[0]:
      raise CheckpointError(f"checkpoint {self.directory}/{step} was written by an older "
                            "petra_jax (per-stage layout); use another --workdir.")
    return metas

  def _check_fingerprint(self, saved: dict, step: int):
    # A field the checkpoint lacks (written by an older version) is not checked.
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
    for s in self.manager.all_steps():
      if s > step:
        logging.warning("deleting %s/%d: newer than the checkpoint resumed from, incomplete",
                        self.manager.directory, s)
        self.manager.delete(s)

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
      if wanted:  # (orbax restores no empty subtree)
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
    """Blocks until pending saves are on disk."""
    self.manager.wait_until_finished()

  def close(self):
    self.manager.close()
    for m in self._others.values():
      m.close()
