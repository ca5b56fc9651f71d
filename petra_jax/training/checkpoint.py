"""Checkpoints of the whole pipeline, with orbax ``CheckpointManager``.

A PETRA run has state that plain training does not: micro-batches in flight,
the input buffers of non-reversible stages, partial gradient accumulations
(inside each stage's optax ``MultiSteps`` state) and per-stage counters. A
checkpoint holds all of it, plus whatever the caller adds (the data position,
the losses not yet logged), so a resumed run continues as if it had never
stopped.

Layout. Every process writes the state it holds into its own orbax
directory, ``DIR/<step>/`` for process 0 and ``DIR/process_<p>/<step>/`` for
process ``p`` (one process: only the first), each step with two items:

* ``arrays`` (``ocp.args.PyTreeSave``): ``{"blocks": {"007": block, ...},
  "in_flight": {"<stage>": {"00000": array, ...}}, "extra": {...}}``. State
  is stored **per block** (global block index over the model, not per
  stage): :func:`split_stage` cuts a grouped stage's parameters, statistics
  and optimizer state into its blocks, :func:`merge_blocks` regroups them, so
  a checkpoint can be resumed with another stage grouping, device count or
  process count. In-flight payloads are stored per stage, ``extra`` (the
  caller's arrays, e.g. unlogged losses) by process 0;
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
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from petra_jax.training import orbax_local
from petra_jax.engine import quantize as quantize_lib
from petra_jax.engine.state import PipelineState, message_fields



class CheckpointError(RuntimeError):
  """A checkpoint that cannot be used; the message says why and the fix."""


def _encode(payload, leaves: list):
  """Pytree of arrays / tuples / dicts / None -> JSON spec; appends the
  arrays to ``leaves``."""
  if payload is None:
    return None
  if isinstance(payload, quantize_lib.Quantized):  # a quantised message or buffer
    return {"quantized": [payload.fmt, payload.dtype],
            "values": [_encode(payload.values, leaves), _encode(payload.scale, leaves)]}
  if isinstance(payload, (tuple, list)):
    return [_encode(p, leaves) for p in payload]
  if isinstance(payload, dict):  # e.g. stashed parameters
    return {"keys": list(payload), "values": [_encode(v, leaves) for v in payload.values()]}
  leaves.append(payload)
  return "array"


def _decode(spec, leaves):
  if spec is None:
    return None
  if isinstance(spec, list):
    return tuple(_decode(s, leaves) for s in spec)
  if isinstance(spec, dict) and "quantized" in spec:
    values, scale = (_decode(v, leaves) for v in spec["values"])
    fmt, dtype = spec["quantized"]
    return quantize_lib.Quantized(values=values, scale=scale, fmt=fmt, dtype=dtype)
  if isinstance(spec, dict):
    return {k: _decode(v, leaves) for k, v in zip(spec["keys"], spec["values"])}
  return next(leaves)


def _boxes(state: PipelineState):
  """``(field, stage, {micro_batch: payload})`` of every message field, read
  from :class:`PipelineState`'s field metadata (no hand-written list)."""
  last = len(state.train_states) - 1
  for f in message_fields():
    value = getattr(state, f.name)
    if f.metadata["messages"] == "per_stage":
      for j, box in enumerate(value):
        yield f.name, j, box
    else:
      yield f.name, last, value


# ----------------------------------------------------------------------------
# Per-block state: a stage's StageState <-> one tree per block.
# ----------------------------------------------------------------------------

def stage_block_count(train_state) -> int:
  """Blocks in a stage, read from its parameters: a group
  (:func:`petra_jax.engine.stage.group`) keeps them under ``"block_0"``, ... ."""
  params = train_state.params
  n = len(params) if isinstance(params, dict) else 0
  names = [f"block_{i}" for i in range(n)]
  return n if n > 1 and sorted(params) == sorted(names) else 1


def _group_test(n: int):
  names = {f"block_{i}" for i in range(n)}
  return lambda x: isinstance(x, dict) and len(x) == n and set(x) == names


def _as_tree(train_state) -> dict:
  return {"micro_batches": train_state.micro_batches, "params": train_state.params,
          "batch_stats": train_state.batch_stats, "opt_state": train_state.opt_state}


def split_stage(train_state, num_blocks: int) -> list[dict]:
  """One tree per block of a stage's state.

  Every subtree keyed ``{"block_0", ..., "block_<n-1>"}`` (the parameters,
  the statistics and every optax state that mirrors the parameters: momentum,
  ``MultiSteps`` accumulators, masked states...) is cut into its blocks; the
  other leaves (counters such as ``micro_batches``, optax ``count``,
  ``mini_step``) are shared by the stage and copied into every block.

  Args:
    train_state: a :class:`StageState` (arrays or ``jax.ShapeDtypeStruct``).
    num_blocks: the stage's block count.

  Returns:
    ``num_blocks`` dicts ``{"micro_batches", "params", "batch_stats",
    "opt_state"}``.
  """
  tree = _as_tree(train_state)
  if num_blocks == 1:
    return [tree]
  is_group = _group_test(num_blocks)
  leaves, treedef = jax.tree.flatten(tree, is_leaf=is_group)
  return [treedef.unflatten([x[f"block_{i}"] if is_group(x) else x for x in leaves])
          for i in range(num_blocks)]


def merge_blocks(blocks: Sequence[dict], template):
  """The inverse of :func:`split_stage`: a stage's state from its blocks'.

  Args:
    blocks: per block, a tree from :func:`split_stage` (possibly taken with
      another grouping).
    template: a freshly initialised :class:`StageState` of the stage (gives
      its structure and its static optimizer).

  Returns:
    The :class:`StageState`.

  Raises:
    CheckpointError: a shared counter differs between the blocks (they come
      from stages that had not run the same number of backward passes: the
      checkpoint was not drained), or the trees do not fit the template.
  """
  if len(blocks) == 1:
    return template.replace(**blocks[0])
  is_group = _group_test(len(blocks))
  leaves, treedef = jax.tree.flatten(_as_tree(template), is_leaf=is_group)
  try:
    pieces = [treedef.flatten_up_to(b) for b in blocks]
  except (ValueError, TypeError) as e:
    raise CheckpointError(f"saved block states do not fit this stage's optimizer state: "
                          f"{str(e).splitlines()[0]}") from None
  merged = []
  for pos, leaf in enumerate(leaves):
    if is_group(leaf):
      merged.append({f"block_{i}": p[pos] for i, p in enumerate(pieces)})
      continue
    values = [np.asarray(p[pos]) for p in pieces]
    if any(not np.array_equal(values[0], v) for v in values[1:]):
      raise CheckpointError(
          f"the blocks regrouped into one stage disagree on a shared counter ({values}): "
          "the checkpoint was not taken on a drained pipeline.")
    merged.append(pieces[0][pos])
  return template.replace(**treedef.unflatten(merged))


def _opt_paths(opt_state) -> list[str]:
  """Each optimizer-state leaf's path without tuple positions (``["mini_step",
  "inner_opt_state/trace/conv/kernel", ...]``): the same for two chains that
  differ only by stateless transformations, such as a delay compensation's
  at delay 0 and at delay 6."""
  return ["/".join(str(getattr(k, "name", getattr(k, "key", k))) for k in path
                   if not isinstance(k, jax.tree_util.SequenceKey))
          for path, _ in jax.tree_util.tree_flatten_with_path(opt_state)[0]]


def _flat_opt(block: dict) -> dict:
  """A block tree with its optimizer state as its leaves, ``{"00000": leaf}``
  (how a checkpoint stores it: it then fits any chain with the same
  :func:`_opt_paths`)."""
  leaves = jax.tree.leaves(block["opt_state"])
  return dict(block, opt_state={f"{i:05d}": x for i, x in enumerate(leaves)})


def _unflat_opt(block: dict, like: dict) -> dict:
  """The inverse of :func:`_flat_opt`, into ``like``'s optimizer structure."""
  leaves = [block["opt_state"][k] for k in sorted(block["opt_state"])]
  return dict(block, opt_state=jax.tree.structure(like["opt_state"]).unflatten(leaves))


# ----------------------------------------------------------------------------
# In-flight messages: per stage, only the payloads this process holds.
# ----------------------------------------------------------------------------

def _flatten(items, leaves_out: dict, stage: int):
  """``[(slot, key, payload)] -> entries``; the payload arrays go to
  ``leaves_out`` under ``"00000"``, ``"00001"``, ..."""
  entries = []
  for slot, key, payload in items:
    leaves = []
    spec = _encode(payload, leaves)
    ids = [f"{len(leaves_out) + i:05d}" for i in range(len(leaves))]
    leaves_out.update(zip(ids, leaves))
    entries.append({"slot": slot, "stage": stage, "key": int(key), "spec": spec, "leaves": ids,
                    "shapes": [[list(x.shape), str(x.dtype)] for x in leaves]})
  return entries


def flatten_in_flight(state: PipelineState, extra_arrays: dict[int, Any]):
  """The in-flight payloads of this process's stages (and ``extra_arrays``).

  Args:
    state: the pipeline state (``None`` train states: another process's
      stages, skipped).
    extra_arrays: caller's arrays to save alongside, keyed by an int id
      (e.g. losses not yet logged, by micro-batch).

  Returns:
    ``(arrays, entries)``: ``arrays = {"in_flight": {"<j>": {"00000":
    array}}, "extra": {...}}`` and ``entries``, JSON-able, the same keys with
    lists saying where each payload goes back.
  """
  per_stage = {}
  for name, j, box in _boxes(state):
    if state.train_states[j] is not None:
      per_stage.setdefault(j, []).extend((name, m, p) for m, p in box.items())
  arrays, entries = {"in_flight": {}, "extra": {}}, {"in_flight": {}, "extra": []}
  for j, items in per_stage.items():
    arrays["in_flight"][str(j)] = {}
    entries["in_flight"][str(j)] = _flatten(items, arrays["in_flight"][str(j)], j)
  entries["extra"] = _flatten([("extra", k, v) for k, v in extra_arrays.items()],
                              arrays["extra"], -1)
  return arrays, entries


def _abstract(shape, dtype, device):
  return jax.ShapeDtypeStruct(tuple(shape), jnp.dtype(dtype),
                              sharding=jax.sharding.SingleDeviceSharding(device))


def _entries_abstract(entries: list, device) -> dict:
  """``{"00000": ShapeDtypeStruct}`` of the arrays ``entries`` name."""
  return {i: _abstract(shape, dtype, device)
          for e in entries for i, (shape, dtype) in zip(e["leaves"], e["shapes"])}


def _unflatten(entries: list, arrays: dict):
  """``[(slot, key, payload)]`` back from :func:`_flatten`'s output."""
  return [(e["slot"], e["key"], _decode(e["spec"], iter(arrays[i] for i in e["leaves"])))
          for e in entries]


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
    self.fingerprint = fingerprint
    self.keep = keep
    self.block_counts = None if block_counts is None else [int(n) for n in block_counts]
    own = process_dir(self.directory, jax.process_index())
    os.makedirs(own, exist_ok=True)
    # Rotation is ours (prune): a checkpoint only counts once the losses of
    # every micro-batch before it are known finite.
    self.manager = _manager(own)
    self._others: dict[int, ocp.CheckpointManager] = {}

  @staticmethod
  def _blocks(state: PipelineState, counts) -> dict:
    """``{"007": block tree}`` of this process's stages (:func:`split_stage`)."""
    out = {}
    for j, st in enumerate(state.train_states):
      if st is not None:
        first = sum(counts[:j])
        for i, block in enumerate(split_stage(st, counts[j])):
          out[f"{first + i:03d}"] = block
    return out

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
      extra_arrays: caller arrays keyed by int (see :func:`flatten_in_flight`).
    """
    counts = self._counts(state)
    blocks = self._blocks(state, counts)
    arrays, entries = flatten_in_flight(state, extra_arrays or {})
    arrays["blocks"] = {b: _flat_opt(v) for b, v in blocks.items()}
    meta = {"fingerprint": self.fingerprint, "tick": state.tick,
            "drained": state.in_flight() == 0, "process": jax.process_index(),
            "num_processes": jax.process_count(), "block_counts": counts,
            "blocks": sorted(arrays["blocks"]), "in_flight": entries["in_flight"],
            "opt_paths": {b: _opt_paths(v["opt_state"]) for b, v in blocks.items()},
            "extra_entries": entries["extra"], "extra": extra}
    # As numpy: orbax refuses host-local jax.Arrays in a multi-process run.
    self.manager.save(step, args=ocp.args.Composite(
        arrays=ocp.args.PyTreeSave(jax.device_get(arrays)), meta=ocp.args.JsonSave(meta)))

  def restore(self, template: PipelineState, devices: list) -> Optional[tuple]:
    """Restores the newest complete, valid checkpoint (every process).

    Args:
      template: a freshly initialised state of this pipeline (gives the
        stage pytree structure, shapes; None for other processes' stages).
      devices: the device of each stage (``Pipeline.devices``).

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
        self._check_layout(metas[0], template, step)
        self._check_optimizer_fit(metas, template, step)
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

  def _check_layout(self, meta: dict, template: PipelineState, step: int):
    """Another grouping needs a drained checkpoint over the same blocks."""
    saved, counts = meta["block_counts"], self._counts(template)
    if saved == counts:
      return
    if sum(saved) != sum(counts):
      raise CheckpointError(f"checkpoint {self.directory}/{step} has {sum(saved)} blocks, this "
                            f"model {sum(counts)}; use another --workdir.")
    if not meta["drained"]:
      raise CheckpointError(
          f"checkpoint {self.directory}/{step} holds micro-batches in flight in its "
          f"{len(saved)} stages of {saved} blocks; resume it with "
          f"--config.model.stage_sizes=\"{tuple(saved)}\", or reshard a drained checkpoint "
          "(the last one of a run, or one taken with --config.checkpoint_drain=True).")
    logging.info("resharding checkpoint %d: stages of %s blocks -> %s", step, saved, counts)

  def _check_optimizer_fit(self, metas, template: PipelineState, step: int):
    """Each block's saved optimizer state must fit its stage's optimizer now
    (the same leaf paths; a compensation's hyper-parameters may change with
    the stage's delay, its state may not)."""
    saved = {b: paths for m in metas for b, paths in m["opt_paths"].items()}
    for b, block in self._blocks(template, self._counts(template)).items():
      now = _opt_paths(block["opt_state"])
      if saved[b] != now:
        missing = sorted(set(saved[b]) ^ set(now))[:3]
        raise CheckpointError(
            f"checkpoint {self.directory}/{step}: block {int(b)}'s optimizer state "
            f"({len(saved[b])} arrays) does not fit its stage's optimizer now ({len(now)}; "
            f"differ: {missing}); resume with the checkpoint's stage grouping "
            f"(model.stage_sizes={tuple(metas[0]['block_counts'])}).")

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
      abstract = jax.tree.map(lambda x, d=devices[j]: _abstract(x.shape, x.dtype, d), st)
      first = sum(counts[:j])
      for i, block in enumerate(split_stage(abstract, counts[j])):
        requests[block_owner[first + i]]["blocks"][f"{first + i:03d}"] = _flat_opt(block)
      q = stage_owner.get(j)
      wanted = {} if q is None else _entries_abstract(metas[q]["in_flight"][str(j)], devices[j])
      if wanted:  # (orbax restores no empty subtree)
        requests[q]["in_flight"][str(j)] = wanted
    if jax.process_index() == 0:
      requests[0]["extra"] = _entries_abstract(metas[0]["extra_entries"], devices[0])
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
          [_unflat_opt(arrays["blocks"][f"{first + i:03d}"], like)
           for i, like in enumerate(split_stage(st, counts[j]))], st))
    state = PipelineState.empty(states, tick=metas[0]["tick"])
    if not metas[0]["drained"]:
      self._refill(state, metas, arrays["in_flight"])
    extra_arrays = {key: payload for _, key, payload in
                    _unflatten(metas[0]["extra_entries"], arrays["extra"])} \
        if jax.process_index() == 0 else {}
    return state, metas[0]["extra"], extra_arrays

  def _refill(self, state: PipelineState, metas, in_flight: dict) -> None:
    """Puts the in-flight payloads back in ``state``'s boxes: on a stage's
    process its payloads, elsewhere the keys of the routed fields with None
    (as a running multi-process pipeline keeps them)."""
    boxes = {(name, j): box for name, j, box in _boxes(state)}
    routed = {f.name for f in message_fields() if f.metadata["routed"]}
    for meta in metas:
      for j, entries in meta["in_flight"].items():
        j = int(j)
        if state.train_states[j] is not None:
          for slot, key, payload in _unflatten(entries, in_flight.get(str(j), {})):
            boxes[(slot, j)][key] = payload
        else:
          for e in entries:
            if e["slot"] in routed:
              boxes[(e["slot"], j)][e["key"]] = None

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
