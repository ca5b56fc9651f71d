"""The in-flight part of a checkpoint: messages as flat arrays plus JSON.

Each payload of a :class:`PipelineState`'s message boxes (a pytree of
arrays, tuples, dicts, ``None``, ``Quantized``) is stored as its arrays
under ``"00000"``, ... and a JSON entry ``{"slot", "stage", "key", "spec",
"leaves", "shapes"}`` that rebuilds it.
"""

from __future__ import annotations

from typing import Any, Iterator

import jax
import jax.numpy as jnp

from petra_jax.engine.arrays import quantize as quantize_lib
from petra_jax.engine.transport.pipeline_state import PipelineState, message_fields


def _encode(payload, leaves: list):
  """A payload's JSON spec (None, list, ``{"quantized", "values"}``,
  ``{"keys", "values"}`` or ``"array"``); its arrays go to ``leaves``.
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
  """``(field, stage, {micro_batch: payload})`` of every message field
  (labels belong to the last stage).
  """
  last = len(state.train_states) - 1
  for f in message_fields():
    value = getattr(state, f.name)
    if f.metadata["messages"] == "per_stage":
      for j, box in enumerate(value):
        yield f.name, j, box
    else:
      yield f.name, last, value


def _flatten(items, leaves_out: dict, stage: int) -> list[dict]:
  """``[(slot, key, payload)] -> entries``; arrays go to ``leaves_out``."""
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
  """``(arrays, entries)`` of this process's stages' payloads and
  ``extra_arrays`` (int-keyed): ``{"in_flight": {"<j>": {"00000": array}},
  "extra": {...}}`` and the JSON entries under the same keys.
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
  """A ``ShapeDtypeStruct`` on ``device`` (a device or a sharding)."""
  sharding = (jax.sharding.make_single_device_sharding(device) if isinstance(device, jax.Device)
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
  """Puts restored payloads back in ``state``'s boxes (in place); the
  routed fields of other processes' stages get ``None`` keys.
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
