"""The in-flight part of a checkpoint: messages as flat arrays plus JSON.

A :class:`PipelineState` holds, besides the stages' train states, boxes of
messages ``{micro_batch: payload}`` (activations on their way forward,
gradients on their way back, input buffers, weight stashes, labels...). A
payload is a pytree of arrays, tuples, dicts, ``None`` and
:class:`~petra_jax.engine.quantize.Quantized` messages. A checkpoint stores
each payload as

* its arrays, flat, under ``"00000"``, ``"00001"``, ... (orbax's ``arrays``
  item, one dict per stage), and
* an *entry* in the JSON ``meta`` item: ``{"slot": field name, "stage": j,
  "key": micro-batch, "spec": pytree spec, "leaves": the array ids,
  "shapes": [[shape, dtype], ...]}``, which is all a restore needs to ask
  orbax for the arrays and to rebuild the payload.

:func:`flatten_in_flight` makes both for the stages this process holds,
:func:`refill` puts restored payloads back into a state's boxes.
"""

from __future__ import annotations

from typing import Any, Iterator

import jax
import jax.numpy as jnp

from petra_jax.engine import quantize as quantize_lib
from petra_jax.engine.pipeline_state import PipelineState, message_fields


def _encode(payload, leaves: list):
  """A payload's JSON spec; appends its arrays to ``leaves`` in spec order.

  Args:
    payload: a pytree of arrays, tuples / lists, dicts, ``None`` and
      ``Quantized`` messages.
    leaves: the list the arrays are appended to.

  Returns:
    ``None`` for ``None``, a list for a tuple, ``{"quantized": [fmt, dtype],
    "values": [...]}`` for a ``Quantized``, ``{"keys", "values"}`` for a
    dict, ``"array"`` for an array.
  """
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


def _decode(spec, leaves: Iterator):
  """The inverse of :func:`_encode`: the payload of ``spec``, taking its
  arrays from the iterator ``leaves`` (lists come back as tuples)."""
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


def boxes(state: PipelineState):
  """``(field, stage, {micro_batch: payload})`` of every message field, read
  from :class:`PipelineState`'s field metadata (no hand-written list); a
  field that is not per stage (the labels) belongs to the last stage."""
  last = len(state.train_states) - 1
  for f in message_fields():
    value = getattr(state, f.name)
    if f.metadata["messages"] == "per_stage":
      for j, box in enumerate(value):
        yield f.name, j, box
    else:
      yield f.name, last, value


def _flatten(items, leaves_out: dict, stage: int) -> list[dict]:
  """``[(slot, key, payload)] -> entries``; the payload arrays go to
  ``leaves_out`` under ``"00000"``, ``"00001"``, ... (numbering on from the
  ids already there)."""
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
  for name, j, box in boxes(state):
    if state.train_states[j] is not None:
      per_stage.setdefault(j, []).extend((name, m, p) for m, p in box.items())
  arrays, entries = {"in_flight": {}, "extra": {}}, {"in_flight": {}, "extra": []}
  for j, items in per_stage.items():
    arrays["in_flight"][str(j)] = {}
    entries["in_flight"][str(j)] = _flatten(items, arrays["in_flight"][str(j)], j)
  entries["extra"] = _flatten([("extra", k, v) for k, v in extra_arrays.items()],
                              arrays["extra"], -1)
  return arrays, entries


def abstract(shape, dtype, device) -> jax.ShapeDtypeStruct:
  """An array of ``shape`` and ``dtype`` (a name, e.g. ``"float32"``) on
  ``device`` (a ``jax.Device``, or a sharding: a data-parallel stage's
  replicated state), as orbax's restore asks for it."""
  sharding = (jax.sharding.SingleDeviceSharding(device) if isinstance(device, jax.Device)
              else device)
  return jax.ShapeDtypeStruct(tuple(shape), jnp.dtype(dtype), sharding=sharding)


def entries_abstract(entries: list, device) -> dict:
  """``{"00000": ShapeDtypeStruct}`` of the arrays ``entries`` name."""
  return {i: abstract(shape, dtype, device)
          for e in entries for i, (shape, dtype) in zip(e["leaves"], e["shapes"])}


def unflatten(entries: list, arrays: dict) -> list[tuple]:
  """``[(slot, key, payload)]`` back from :func:`_flatten`'s output."""
  return [(e["slot"], e["key"], _decode(e["spec"], iter(arrays[i] for i in e["leaves"])))
          for e in entries]


def refill(state: PipelineState, metas: list[dict], in_flight: dict) -> None:
  """Puts the in-flight payloads back in ``state``'s boxes (in place).

  On a stage's process its payloads go back; elsewhere the keys of the
  routed fields get ``None`` (as a running multi-process pipeline keeps
  them).

  Args:
    state: a drained state (:meth:`PipelineState.empty`) of the restored
      stages (``None`` train states: another process's).
    metas: every writer process's ``meta`` item (their ``"in_flight"``
      entries).
    in_flight: ``{"<j>": {"00000": array}}``, the restored arrays of this
      process's stages.
  """
  by_slot = {(name, j): box for name, j, box in boxes(state)}
  routed = {f.name for f in message_fields() if f.metadata["routed"]}
  for meta in metas:
    for j, entries in meta["in_flight"].items():
      j = int(j)
      if state.train_states[j] is not None:
        for slot, key, payload in unflatten(entries, in_flight.get(str(j), {})):
          by_slot[(slot, j)][key] = payload
      else:
        for e in entries:
          if e["slot"] in routed:
            by_slot[(e["slot"], j)][e["key"]] = None
