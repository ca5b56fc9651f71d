"""Checkpoints of the whole pipeline, with orbax ``CheckpointManager``.

A PETRA run has state that plain training does not: micro-batches in flight,
the input buffers of non-reversible stages, partial gradient accumulations
(inside each stage's optax ``MultiSteps`` state) and per-stage counters. A
checkpoint holds all of it, plus whatever the caller adds (the data position,
the losses not yet logged), so a resumed run continues as if it had never
stopped.

Layout of one checkpoint (``WORKDIR/checkpoints/<step>/``):

* ``arrays``: ``{"stages": [StageState, ...], "in_flight": {"00000": array, ...}}``
  saved with ``ocp.args.StandardSave``;
* ``meta``: JSON with the tick counters, where each in-flight array belongs
  (slot, stage, micro-batch, pytree spec, shape, dtype), the caller's
  ``extra`` dict and a ``fingerprint`` of the run (model, method, stages...).

orbax writes each checkpoint into a temporary directory and renames it when
complete, so a checkpoint being written when the process dies is never listed;
a corrupt or partial one is skipped with a warning (:meth:`Checkpointer.restore`).
"""

from __future__ import annotations

import logging
import os
from typing import Any, Optional

import jax
import numpy as np
import orbax.checkpoint as ocp

from petra_jax.pipeline import PipelineState, message_fields



class CheckpointError(RuntimeError):
  """A checkpoint that cannot be used; the message says why and the fix."""


def _encode(payload, leaves: list):
  """Pytree of arrays / tuples / dicts / None -> JSON spec; appends the
  arrays to ``leaves``."""
  if payload is None:
    return None
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


def flatten_in_flight(state: PipelineState, extra_arrays: dict[int, Any]):
  """Lists every in-flight array of ``state`` (and ``extra_arrays``).

  Args:
    state: the pipeline state.
    extra_arrays: caller's arrays to save alongside, keyed by an int id
      (e.g. losses not yet logged, by micro-batch); saved on the last stage.

  Returns:
    ``(arrays, entries)``: ``arrays`` a dict ``"00000" -> jax.Array`` and
    ``entries`` a JSON-able list saying where each payload goes back.
  """
  leaves, entries = [], []

  def add(slot, stage, key, payload):
    start = len(leaves)
    spec = _encode(payload, leaves)
    entries.append({"slot": slot, "stage": stage, "key": key, "spec": spec,
                    "leaves": list(range(start, len(leaves)))})

  for name, j, box in _boxes(state):
    for m, payload in box.items():
      add(name, j, m, payload)
  for key, value in extra_arrays.items():
    add("extra", len(state.train_states) - 1, int(key), value)
  arrays = {f"{i:05d}": leaf for i, leaf in enumerate(leaves)}
  for e in entries:
    e["shapes"] = [[list(leaves[i].shape), str(leaves[i].dtype)] for i in e["leaves"]]
  return arrays, entries


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
  manager = ocp.CheckpointManager(os.path.abspath(directory), item_names=("arrays", "meta"))
  try:
    for step in sorted(manager.all_steps(), reverse=True):
      try:
        return _read_meta(manager, step)["fingerprint"]
      except Exception:  # pylint: disable=broad-except  (unreadable: try an older one)
        continue
    return None
  finally:
    manager.close()


class Checkpointer:
  """Saves and restores :class:`PipelineState` plus caller metadata.

  Args:
    directory: where checkpoints go (``WORKDIR/checkpoints``).
    keep: how many of the latest known-good checkpoints to keep
      (:meth:`prune`); newer ones whose losses are still in flight are kept
      too.
    fingerprint: what must match for a checkpoint to be resumed (model,
      method, stage count...); JSON-able.
  """

  def __init__(self, directory: str, keep: int, fingerprint: dict):
    self.directory = os.path.abspath(directory)
    self.fingerprint = fingerprint
    self.keep = keep
    # Rotation is ours (prune): a checkpoint only counts once the losses of
    # every micro-batch before it are known finite.
    self.manager = ocp.CheckpointManager(
        self.directory, options=ocp.CheckpointManagerOptions(max_to_keep=None, create=True),
        item_names=("arrays", "meta"))

  def prune(self, verified_through: int) -> None:
    """Keeps the newest ``keep`` checkpoints at steps ``<= verified_through``
    (known good) and every newer one; deletes the older ones."""
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
    """Starts an (asynchronous) save of ``state`` at ``step``.

    Args:
      step: optimizer updates so far (the checkpoint's name).
      state: the pipeline state; its arrays are copied off the devices before
        this returns, so the pipeline can run on while the write finishes.
      extra: JSON-able caller state (data position, log offsets...).
      extra_arrays: caller arrays keyed by int (see :func:`flatten_in_flight`).
    """
    arrays, entries = flatten_in_flight(state, extra_arrays or {})
    meta = {"fingerprint": self.fingerprint, "tick": state.tick, "in_flight": entries,
            "extra": extra}
    self.manager.save(step, args=ocp.args.Composite(
        arrays=ocp.args.StandardSave({"stages": state.train_states, "in_flight": arrays}),
        meta=ocp.args.JsonSave(meta)))

  def restore(self, template: PipelineState, devices: list) -> Optional[tuple]:
    """Restores the latest valid checkpoint.

    Args:
      template: a freshly initialised state of the same pipeline (gives the
        stage pytree structure, shapes and devices).
      devices: the device of each stage (``Pipeline.devices``).

    Returns:
      ``(step, state, extra, extra_arrays)``, or None if there is no
      checkpoint.

    Raises:
      CheckpointError: the checkpoint comes from a different run (model,
        method, stage count...), or no checkpoint in the directory is valid.
    """
    steps = sorted(self.manager.all_steps(), reverse=True)
    if not steps:
      return None
    for step in steps:
      try:
        meta = _read_meta(self.manager, step)
      except Exception as e:  # pylint: disable=broad-except
        logging.warning("checkpoint %s/%d is unreadable (%s); trying an older one.",
                        self.directory, step, type(e).__name__)
        continue
      self._check_fingerprint(meta["fingerprint"], step)
      try:
        return (step,) + self._restore_arrays(step, meta, template, devices)
      except Exception as e:  # pylint: disable=broad-except
        logging.warning("checkpoint %s/%d is corrupt or partial (%s: %s); trying an older "
                        "one.", self.directory, step, type(e).__name__, str(e)[:200])
    raise CheckpointError(
        f"no valid checkpoint in {self.directory} (steps tried: {steps}); delete the "
        "directory to start afresh, or use another --workdir.")

  def _check_fingerprint(self, saved: dict, step: int):
    # A field the checkpoint lacks (written by an older version) is not checked.
    diffs = [f"{k}: checkpoint {saved[k]!r} vs config {v!r}"
             for k, v in self.fingerprint.items() if k in saved and saved[k] != v]
    if diffs:
      raise CheckpointError(
          f"checkpoint {self.directory}/{step} comes from a different run ("
          + "; ".join(diffs) + "); use another --workdir or the original config.")

  def _restore_arrays(self, step, meta, template: PipelineState, devices):
    def abstract(x, device):
      return jax.ShapeDtypeStruct(x.shape, x.dtype,
                                  sharding=jax.sharding.SingleDeviceSharding(device))

    stages = [jax.tree.map(lambda x, d=d: abstract(x, d), s)
              for s, d in zip(template.train_states, devices)]
    in_flight = {}
    for e in meta["in_flight"]:
      for i, (shape, dtype) in zip(e["leaves"], e["shapes"]):
        in_flight[f"{i:05d}"] = abstract(np.empty(shape, dtype), devices[e["stage"]])
    restored = self.manager.restore(step, args=ocp.args.Composite(
        arrays=ocp.args.StandardRestore({"stages": stages, "in_flight": in_flight})))
    arrays = restored["arrays"]
    state = PipelineState.empty(list(arrays["stages"]), tick=meta["tick"])
    boxes = {(name, j): box for name, j, box in _boxes(state)}
    extra_arrays = {}
    for e in meta["in_flight"]:
      payload = _decode(e["spec"], iter(arrays["in_flight"][f"{i:05d}"] for i in e["leaves"]))
      if e["slot"] == "extra":
        extra_arrays[e["key"]] = payload
      else:
        boxes[(e["slot"], e["stage"])][e["key"]] = payload
    return state, meta["extra"], extra_arrays

  def latest_step(self) -> Optional[int]:
    """The newest checkpoint's step (saved or being saved), None if none."""
    return self.manager.latest_step()

  def wait(self):
    """Blocks until pending saves are on disk."""
    self.manager.wait_until_finished()

  def close(self):
    self.manager.close()
