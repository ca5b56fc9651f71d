"""What each stage stores between a micro-batch's forward and its backward.

``python -m petra_jax.benchmarks.memory --model=revnet50 --dataset=imagenet
--batch-size=64 [--method=petra] [--device-memory] [--json]`` reports:

* **Analytic bytes per stage** for four buffer configurations (paper Table 3):
  stage ``j`` keeps ``tau_j = 2(J-1-j)`` micro-batches in flight, and for each
  one stores its input if it buffers inputs (always for a non-reversible
  stage) and a copy of its parameters if it stashes weights:

  ================= ============ ============ ==============================
  method            input buffer param buffer
  ================= ============ ============ ==============================
  delayed           yes          yes          PipeDream-like delayed gradients
  dsp               yes          no           Xu et al. / DSP
  approximate_input no           yes
  petra             no           no           only non-reversible stages store
  ================= ============ ============ ==============================

  (the engine's method names, :mod:`petra_jax.engine.methods`), and for the flushed
  schedules ``gpipe`` and ``1f1b`` at ``k`` micro-batches per update. How many
  micro-batches a stage holds comes from the method's schedule table
  (:func:`petra_jax.engine.schedule.peak_held`).

  Shapes come from :func:`jax.eval_shape`, so full-size models cost nothing.
* **Measured bytes per stage** in a live PETRA run at steady state: the sum of
  ``nbytes`` over ``state.buffers[j]`` (by default at a tiny width, to check
  the formula; ``--live-width``/``--live-batch`` for the real size).
* **Device memory per stage** (``--device-memory``, paper Table 6): state +
  PETRA buffers + the working set of the stage's compiled steps
  (:func:`device_memory`).
* **Table 3's model**: model size (parameter bytes) + input buffers (the
  first stage's excluded: it re-reads the dataset) + parameter buffers, in GB,
  with savings against the ``delayed`` row.

A reversible coupling ``(y1, y2) = (x2 + F(x1), x1)`` needs only ``x1`` to
compute its gradients, so a delayed-gradient method can stash one stream of a
reversible stage's input (``--rev-stash=x1``, the default for Table 3) rather
than both (``both``, what the authors' code stores: 1911.3 MiB for RevNet18 on
CIFAR-10, batch 64). The ``stored_bytes_per_stage`` lists always count both
streams, like a live engine would hold.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import sys
from typing import Callable, Optional, Sequence

import petra_jax  # noqa: F401  (applies the XLA-CPU work-around)
import jax
import jax.numpy as jnp
import numpy as np
import optax

from petra_jax.engine import methods as methods_lib
from petra_jax.engine import quantize as quantize_lib
from petra_jax import data as data_lib  # noqa: E402
from petra_jax import models
from petra_jax.engine import schedule
from petra_jax.engine import stage as stage_lib
from petra_jax.engine.pipeline import Pipeline
from petra_jax.engine.stage import Stage

# Table 3's rows, in its order: (input buffer, param buffer) = (Y, Y), (Y, N),
# (N, Y), (N, N).
TABLE3_METHODS = ("delayed", "dsp", "approximate_input", "petra")
# Every method whose stored bytes the report lists.
METHODS = TABLE3_METHODS + ("gpipe", "1f1b")
MIB = 2**20
GB = 1e9
PAPER_TABLE3 = [(44.5, 0.0), (43.6, 2.0), (21.2, 52.3), (20.3, 54.3)]  # GB, saving %
# Table 6 (CIFAR-10, batch 256): GB per (0-based) stage of RevNet18, the
# entries legible in our copy of the paper; its RevNet34 row is too garbled
# by text extraction to align with stages.
PAPER_TABLE6 = {"revnet18": {3: 2.67, 5: 1.13, 6: 0.31, 7: 0.57, 8: 0.25, 9: 0.11}}


def _nbytes(tree) -> int:
  """Bytes of a pytree of arrays or ``ShapeDtypeStruct``s."""
  return int(sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize
                 for x in jax.tree.leaves(tree)))


def _buffered(x, j: int, formats: quantize_lib.MessageFormats):
  """Shapes of what stage ``j`` buffers for input ``x``: the buffer format,
  or (``"none"``) the message as received (images at stage 0)."""
  if formats.buffer != "none":
    return formats.spec("buffer", x)
  return formats.spec("forward", x) if j > 0 else x


def stage_bytes(stages: Sequence[Stage], image_shape: Sequence[int], batch_size: int,
                dtype=jnp.float32,
                formats: Optional[quantize_lib.MessageFormats] = None) -> list[dict]:
  """Per-stage input, message and parameter bytes, from shapes only (no compute).

  Args:
    stages: a model from :func:`petra_jax.models.build_model`.
    image_shape: ``(H, W, C)`` of one input image.
    batch_size: micro-batch size.
    dtype: the images' dtype.
    formats: the quantisation of messages and buffers (default: none).

  Returns:
    One dict per stage: ``name``, ``reversible``, ``delay`` (``tau_j``),
    ``input_bytes`` (its whole input activation, both streams, as buffered
    under ``formats``), ``input_x1_bytes`` (the first stream of a
    two-stream input, else the whole input), ``param_bytes``,
    ``forward_message_bytes`` (its output sent to stage ``j+1``; 0 for the
    last stage) and ``backward_message_bytes`` (``(x~, delta)`` sent to
    stage ``j-1`` under PETRA, ``x~`` only when that stage is reversible;
    0 for stage 0).
  """
  formats = formats or quantize_lib.MessageFormats()
  x = jax.ShapeDtypeStruct((batch_size, *image_shape), dtype)
  rows = []
  for j, (s, (variables, y)) in enumerate(zip(stages, stage_lib.trace(stages, x))):
    buf, back = _buffered(x, j, formats), formats.spec("backward", x)
    rows.append({
        "name": s.name,
        "reversible": s.reversible,
        "delay": schedule.delay(j, len(stages)),
        "input_bytes": _nbytes(buf),
        "input_x1_bytes": _nbytes(buf[0] if isinstance(buf, tuple) else buf),
        "param_bytes": _nbytes(variables["params"]),
        "forward_message_bytes": _nbytes(formats.spec("forward", y)) if j < len(stages) - 1
                                 else 0,
        "backward_message_bytes": (_nbytes(back) * (2 if stages[j - 1].reversible else 1)
                                   if j > 0 else 0),
    })
    x = y
  return rows


def bytes_per_tick(sizes: Sequence[dict]) -> int:
  """Bytes every stage sends in one steady-state PETRA tick: each stage one
  forward message and one backward message (:func:`stage_bytes` rows)."""
  return sum(r["forward_message_bytes"] + r["backward_message_bytes"] for r in sizes)


def stored_bytes(sizes: Sequence[dict], method: str, *, rev_stash: str = "both",
                 first_input: bool = True, accumulation_steps: int = 1) -> list[int]:
  """Peak bytes stage ``j`` holds between forward and backward.

  The method's schedule table gives how many micro-batches each stage holds
  at most (:func:`petra_jax.engine.schedule.peak_held`: ``tau_j`` for the stream
  methods); each one costs the stage's input if it buffers it (always for a
  non-reversible stage) plus its parameters if the method stashes weights.

  Args:
    sizes: :func:`stage_bytes` (or :func:`measure_live`'s ``sizes``).
    method: a name in :data:`METHODS`.
    rev_stash: ``"both"`` streams or only ``"x1"`` of a reversible stage's
      input when the method buffers inputs.
    first_input: count stage 0's input buffer (Table 3 does not).
    accumulation_steps: ``k`` (the round of ``gpipe`` and ``1f1b``).

  Raises:
    ValueError: unknown ``method`` or ``rev_stash``.
  """
  if method not in METHODS:
    raise ValueError(f"Unknown method {method!r}; choose one of {list(METHODS)}.")
  if rev_stash not in ("both", "x1"):
    raise ValueError(f"rev_stash must be 'both' or 'x1', got {rev_stash!r}")
  m = methods_lib.get(method)
  J, k = len(sizes), accumulation_steps
  held = schedule.peak_held(schedule.Schedule(m.schedule, J, k * 2 * J, k))
  out = []
  for j, r in enumerate(sizes):
    entry = 0
    if not r["reversible"] and (j > 0 or first_input):
      entry += r["input_bytes"]
    elif r["reversible"] and m.stashes_inputs:
      entry += r["input_x1_bytes"] if rev_stash == "x1" else r["input_bytes"]
    if m.stashes_weights:
      entry += r["param_bytes"]
    out.append(held[j] * entry)
  return out


def table3(sizes: Sequence[dict], rev_stash: str = "x1") -> list[dict]:
  """Paper Table 3's model: model + input buffers + parameter buffers.

  The model size is the parameter bytes; the first stage's input buffer is
  left out. Savings are against the first row (both buffers).

  Returns:
    Four dicts: ``method``, ``input_buffer``, ``param_buffer``,
    ``memory_gb`` (10^9 bytes) and ``saving_pct``.
  """
  model = sum(r["param_bytes"] for r in sizes)
  rows = []
  for method in TABLE3_METHODS:
    m = methods_lib.get(method)
    total = model + sum(stored_bytes(sizes, method, rev_stash=rev_stash, first_input=False))
    rows.append({"method": method, "input_buffer": m.stashes_inputs,
                 "param_buffer": m.stashes_weights,
                 "memory_gb": total / GB})
  for r in rows:
    r["saving_pct"] = 100.0 * (1.0 - r["memory_gb"] / rows[0]["memory_gb"])
  return rows


def table3_extended(sizes: Sequence[dict], quantized: dict[str, Sequence[dict]],
                    reversible_sizes: Optional[Sequence[dict]] = None,
                    rev_stash: str = "x1") -> list[dict]:
  """Table 3's model with PETRA's rows beyond the paper.

  Args:
    sizes: :func:`stage_bytes` of the model, float buffers.
    quantized: buffer format -> :func:`stage_bytes` with that buffer format.
    reversible_sizes: :func:`stage_bytes` of the model's all-reversible
      (``_inv``) variant, if it has one.
    rev_stash: as :func:`table3`.

  Returns:
    :func:`table3`'s four rows, then ``petra`` with each quantised buffer
    and ``petra`` on the ``_inv`` model (then each quantised buffer), each
    with ``model``, ``buffer_format`` and ``saving_pct`` against the first
    (``delayed``, float) row.
  """
  rows = [dict(r, model="", buffer_format="none") for r in table3(sizes, rev_stash)]
  base = rows[0]["memory_gb"]
  extra = [("", fmt, rows_) for fmt, rows_ in quantized.items()]
  if reversible_sizes is not None:
    extra.insert(0, ("_inv", "none", reversible_sizes))
  for model, fmt, rows_ in extra:
    total = (sum(r["param_bytes"] for r in rows_)
             + sum(stored_bytes(rows_, "petra", rev_stash=rev_stash, first_input=False)))
    rows.append({"method": "petra", "model": model, "buffer_format": fmt,
                 "input_buffer": False, "param_buffer": False, "memory_gb": total / GB,
                 "saving_pct": 100.0 * (1.0 - total / GB / base)})
  return rows


def quantization(build: Callable, image_shape, batch_size: int, live: Optional[dict] = None,
                 num_classes: int = 10) -> list[dict]:
  """Bytes sent per tick and PETRA's stored bytes in every format.

  Args:
    build: ``width -> stages``.
    image_shape, batch_size: as :func:`stage_bytes`, at ``live["width"]``
      when measured live, else at the report's width (``build(None)``).
    live: ``{"width", "batch_size", "image_shape"}`` to also run each format
      live (:func:`measure_live`) at that small size.

  Returns:
    One row per format of :data:`petra_jax.engine.quantize.FORMATS` (forward,
    backward and buffer all in it): ``format``, ``bytes_per_tick``,
    ``petra_stored_bytes`` and the ratios ``tick_ratio`` and
    ``stored_ratio`` (float32 over this format); with ``live``, ``live``:
    the same two measured on the devices and their analytic values there.
  """
  rows = []
  for fmt in quantize_lib.FORMATS:
    formats = quantize_lib.MessageFormats(fmt, fmt, fmt)
    sizes = stage_bytes(build(None), image_shape, batch_size, formats=formats)
    row = {"format": fmt, "bytes_per_tick": bytes_per_tick(sizes),
           "petra_stored_bytes": sum(stored_bytes(sizes, "petra"))}
    if live:
      stages, shape = build(live["width"]), live["image_shape"]
      measured = measure_live(stages, shape, live["batch_size"], num_classes, formats=formats)
      at = stage_bytes(stages, shape, live["batch_size"], formats=formats)
      row["live"] = {"bytes_per_tick": measured["bytes_per_tick"],
                     "analytic_bytes_per_tick": bytes_per_tick(at),
                     "petra_stored_bytes": sum(measured["petra"]),
                     "analytic_petra_stored_bytes": sum(stored_bytes(at, "petra"))}
    rows.append(row)
  for r in rows:
    r["tick_ratio"] = rows[0]["bytes_per_tick"] / r["bytes_per_tick"]
    r["stored_ratio"] = rows[0]["petra_stored_bytes"] / max(r["petra_stored_bytes"], 1)
  return rows


def measure_live(stages: Sequence[Stage], image_shape: Sequence[int], batch_size: int,
                 num_classes: int = 10, seed: int = 0,
                 formats: Optional[quantize_lib.MessageFormats] = None) -> dict:
  """Runs PETRA to steady state and reads what each stage holds.

  Feeds ``2(J-1) + 1`` micro-batches (one per tick) on one device; after the
  last tick every stage has ``tau_j`` micro-batches between its forward and
  its backward.

  Returns:
    ``{"petra": [bytes per stage], "delayed": [...], "sizes": [...],
    "bytes_per_tick": int}``: ``petra`` sums ``nbytes`` over
    ``state.buffers[j]``; ``delayed`` is what stashing every stage's input
    and parameters ``tau_j`` times would hold, with the sizes read from the
    live arrays (``sizes``, as :func:`stage_bytes`); ``bytes_per_tick``
    sums the messages sent on the last tick (each then waits in its
    receiver's inbox), as held on the devices under ``formats``.
  """
  pipe = Pipeline(stages, optax.sgd(1e-3), jax.devices()[:1], formats=formats)
  rng = np.random.default_rng(seed)
  images = jnp.asarray(rng.normal(size=(batch_size, *image_shape)), jnp.float32)
  labels = jnp.asarray(rng.integers(0, num_classes, batch_size), jnp.int32)
  state = pipe.init(seed, images)
  fill = schedule.drain_ticks(pipe.num_stages) + 1  # then every stage holds tau_j
  table = pipe.schedule(fill)
  state, _ = pipe.run(state, (table[t] for t in range(fill)), lambda m: (images, labels))
  jax.block_until_ready(state.train_states)
  petra = state.stored_bytes()
  sizes = []
  for j, s in enumerate(stages):
    x = images if j == 0 else next(iter(state.inbox[j].values()))  # its next input
    sizes.append({"name": s.name, "reversible": s.reversible,
                  "delay": schedule.delay(j, pipe.num_stages),
                  "input_bytes": _nbytes(x),
                  "input_x1_bytes": _nbytes(x[0] if isinstance(x, tuple) else x),
                  "param_bytes": _nbytes(state.train_states[j].params)})
  sent = sum(_nbytes(p) for box in state.inbox[1:] + state.grad_inbox for p in box.values())
  return {"petra": petra, "delayed": stored_bytes(sizes, "delayed"), "sizes": sizes,
          "bytes_per_tick": sent}


def device_memory(stages: Sequence[Stage], image_shape: Sequence[int], batch_size: int,
                  num_classes: int = 10,
                  tx: Optional[optax.GradientTransformation] = None) -> list[dict]:
  """Estimated peak device memory of each stage training with PETRA (Table 6).

  Stage ``j`` on its own device holds its state (parameters, BatchNorm
  statistics, optimizer state), its PETRA buffers (``tau_j`` inputs if it is
  not reversible, none if it is) and, while a step runs, that step's working
  set. The working set comes from XLA's memory analysis of the compiled
  forward and backward steps (``Compiled.memory_analysis()``: arguments other
  than the state + outputs - donated aliases + temporaries), so it is what
  this backend would allocate, without running anything. It counts the
  non-reversible stages' buffered input once more (the one being consumed).

  Args:
    stages: a model from :func:`petra_jax.models.build_model`.
    image_shape: ``(H, W, C)``.
    batch_size: micro-batch size.
    num_classes: classes of the head.
    tx: the optimizer (default SGD with momentum, the paper's: one slot
      per parameter).

  Returns:
    One dict per stage: ``name``, ``state_bytes``, ``buffer_bytes``,
    ``forward_bytes``, ``backward_bytes`` (working sets) and ``total_bytes``
    (state + buffers + the larger working set).

  Raises:
    RuntimeError: the backend gives no memory analysis.
  """
  pipe = Pipeline(stages, tx or optax.sgd(0.1, momentum=0.9), jax.devices()[:1])
  state = pipe.init(0, jnp.zeros((1, *image_shape), jnp.float32))
  specs = pipe.message_specs(jax.ShapeDtypeStruct((batch_size, *image_shape), jnp.float32))
  labels = jax.ShapeDtypeStruct((batch_size,), jnp.int32)
  buffers = stored_bytes(stage_bytes(stages, image_shape, batch_size), "petra")
  rows = []
  for j, s in enumerate(stages):
    st = state.train_states[j]
    state_bytes = _nbytes(st)
    bwd_args = pipe.steps.backward_args(j, x=specs[j], y=specs[j + 1], dy=specs[j + 1], labels=labels)
    working = []
    for fn, args in zip(pipe.steps.jitted_steps(j), ((specs[j],), bwd_args)):
      ma = fn.lower(st, *args).compile().memory_analysis()
      if ma is None:
        raise RuntimeError(f"backend {jax.default_backend()!r} gives no memory analysis.")
      working.append(int(ma.argument_size_in_bytes - state_bytes + ma.output_size_in_bytes
                         - ma.alias_size_in_bytes + ma.temp_size_in_bytes))
    rows.append({"name": s.name, "state_bytes": state_bytes, "buffer_bytes": buffers[j],
                 "forward_bytes": working[0], "backward_bytes": working[1],
                 "total_bytes": state_bytes + buffers[j] + max(working)})
  return rows


def report(model: str, dataset: str, batch_size: int, width: int = 64,
           live_width: Optional[int] = 4, live_batch: int = 4,
           rev_stash: str = "x1", live_image_size: Optional[int] = None,
           with_device_memory: bool = False, accumulation_steps: int = 4) -> dict:
  """The CLI's JSON.

  Returns:
    ``stored_bytes_per_stage`` (method -> bytes per stage, first stage
    included, both streams; ``gpipe``/``1f1b`` at ``accumulation_steps``), ``total_mib`` (method -> MiB), ``table3`` (rows
    of :func:`table3` with ``rev_stash``), ``table3_both_streams``,
    ``delays``, ``stage_names`` and, with ``live_width``, ``live``: the
    measured bytes at ``live_width``/``live_batch`` against the analytic
    ones there (``max_rel_err``), on ``live_image_size`` square images
    (default: the dataset's); with ``with_device_memory``,
    ``device_memory`` (:func:`device_memory` at ``width``/``batch_size``).
  """
  d = data_lib.DATASETS[dataset]
  build = functools.partial(models.build_model, model, num_classes=d.num_classes,
                            imagenet_stem=d.imagenet_stem)
  sizes = stage_bytes(build(width=width), d.image_shape, batch_size)
  stored = {m: stored_bytes(sizes, m, accumulation_steps=accumulation_steps) for m in METHODS}
  out = {
      "model": model, "dataset": dataset, "batch_size": batch_size, "width": width,
      "accumulation_steps": accumulation_steps,
      "stage_names": [r["name"] for r in sizes],
      "delays": [r["delay"] for r in sizes],
      "stored_bytes_per_stage": stored,
      "total_mib": {m: sum(v) / MIB for m, v in stored.items()},
      "table3": table3(sizes, rev_stash),
      "table3_rev_stash": rev_stash,
      "table3_both_streams": table3(sizes, "both"),
      "table3_extended": _table3_extended(model, d, width, batch_size, sizes, rev_stash),
  }
  if with_device_memory:
    out["device_memory"] = device_memory(build(width=width), d.image_shape, batch_size,
                                         d.num_classes)
  if live_width:
    live_stages = build(width=live_width)
    shape = d.image_shape if live_image_size is None else (live_image_size, live_image_size, 3)
    measured = measure_live(live_stages, shape, live_batch, d.num_classes)
    analytic = stored_bytes(stage_bytes(live_stages, shape, live_batch), "petra")
    err = max(abs(m - a) / max(a, 1) for m, a in zip(measured["petra"], analytic))
    out["live"] = {"width": live_width, "batch_size": live_batch, "image_shape": list(shape),
                   "measured_bytes_per_stage": {k: measured[k] for k in ("petra", "delayed")},
                   "analytic_bytes_per_stage": analytic, "max_rel_err": err}
  live = (None if not live_width else
          {"width": live_width, "batch_size": live_batch, "image_shape": shape})
  out["quantization"] = quantization(lambda w: build(width=w or width), d.image_shape,
                                     batch_size, live, d.num_classes)
  return out


def _table3_extended(model: str, d, width: int, batch_size: int, sizes, rev_stash: str):
  """:func:`table3_extended` for ``model`` on data set ``d``
  (:data:`petra_jax.data.DATASETS` entry): quantised buffers, and its
  ``_inv`` variant if there is one."""
  def build(name):
    return models.build_model(name, width=width, num_classes=d.num_classes,
                              imagenet_stem=d.imagenet_stem)
  quantized = {fmt: stage_bytes(build(model), d.image_shape, batch_size,
                                formats=quantize_lib.MessageFormats(buffer=fmt))
               for fmt in quantize_lib.FORMATS[1:]}
  inv = (stage_bytes(build(f"{model}_inv"), d.image_shape, batch_size)
         if f"{model}_inv" in models.MODEL_SPECS else None)
  return table3_extended(sizes, quantized, inv, rev_stash)


def _print(r: dict, methods: Sequence[str]) -> None:
  print(f"{r['model']} on {r['dataset']}, width {r['width']}, batch {r['batch_size']}: "
        "peak MiB held between forward and backward, per stage (stream methods: tau_j "
        f"micro-batches; gpipe, 1f1b: k={r['accumulation_steps']})")
  print(f"{'stage':<15}{'tau':>4}" + "".join(f"{m:>18}" for m in methods))
  for j, name in enumerate(r["stage_names"]):
    print(f"{name:<15}{r['delays'][j]:>4}" +
          "".join(f"{r['stored_bytes_per_stage'][m][j] / MIB:18.1f}" for m in methods))
  print(f"{'total':<19}" + "".join(f"{r['total_mib'][m]:18.1f}" for m in methods))
  if "live" in r:
    lv = r["live"]
    print(f"live PETRA run (width {lv['width']}, batch {lv['batch_size']}, image "
          f"{lv['image_shape']}): measured "
          f"{lv['measured_bytes_per_stage']['petra']} bytes, "
          f"max rel. error vs analytic {lv['max_rel_err']:.2%}")
  if "device_memory" in r:
    paper = PAPER_TABLE6.get(r["model"], {}) if (r["dataset"], r["batch_size"]) == (
        "cifar10", 256) else {}
    print("PETRA device memory per stage (Table 6 model; GB = 1e9 bytes): state + buffers + "
          "the larger working set of its forward / backward step (XLA memory analysis)")
    print(f"{'stage':<15}{'state':>8}{'buffers':>9}{'fwd':>8}{'bwd':>8}{'total':>8}"
          + ("  paper" if paper else ""))
    for j, row in enumerate(r["device_memory"]):
      gb = [row[k] / GB for k in ("state_bytes", "buffer_bytes", "forward_bytes",
                                  "backward_bytes", "total_bytes")]
      print(f"{row['name']:<15}{gb[0]:8.2f}{gb[1]:9.2f}{gb[2]:8.2f}{gb[3]:8.2f}{gb[4]:8.2f}"
            + (f"  {paper[j]:.2f}" if j in paper else ""))
  for key, label in (("table3", f"rev. stash {r['table3_rev_stash']}"),
                     ("table3_both_streams", "rev. stash both streams")):
    print(f"Table 3 model ({label}; first stage's input excluded):")
    paper = (r["model"], r["dataset"], r["batch_size"]) == ("revnet50", "imagenet", 64)
    for row, (gb, pct) in zip(r[key], PAPER_TABLE3):
      print(f"  input {'Y' if row['input_buffer'] else 'N'} params "
            f"{'Y' if row['param_buffer'] else 'N'}: {row['memory_gb']:6.2f} GB, saving "
            f"{row['saving_pct']:5.1f} %" + (f"   (paper: {gb} GB, {pct} %)" if paper else ""))
  print("Table 3 model, beyond the paper (PETRA; saving against the first row):")
  for row in r["table3_extended"][len(PAPER_TABLE3):]:
    print(f"  {r['model'] + row['model']:<14} buffers {row['buffer_format']:<9}"
          f"{row['memory_gb']:6.2f} GB, saving {row['saving_pct']:5.1f} %")
  print("Quantised messages and buffers (forward, backward and buffer in one format):")
  for q in r["quantization"]:
    line = (f"  {q['format']:<9} {q['bytes_per_tick'] / MIB:8.2f} MiB sent per tick "
            f"(/{q['tick_ratio']:.2f}), PETRA stores {q['petra_stored_bytes'] / MIB:8.2f} MiB "
            f"(/{q['stored_ratio']:.2f})")
    if "live" in q:
      lv = q["live"]
      line += (f"; live at width {r['live']['width']}: {lv['bytes_per_tick']} B/tick "
               f"(analytic {lv['analytic_bytes_per_tick']}), {lv['petra_stored_bytes']} B "
               f"stored (analytic {lv['analytic_petra_stored_bytes']})")
    print(line)


def main(argv: Optional[Sequence[str]] = None) -> int:
  """``python -m petra_jax.benchmarks.memory``; see the module docstring."""
  p = argparse.ArgumentParser(prog="python -m petra_jax.benchmarks.memory",
                              description=__doc__.splitlines()[0])
  p.add_argument("--model", default="revnet50", choices=sorted(models.MODEL_SPECS))
  p.add_argument("--dataset", default="imagenet", choices=sorted(data_lib.DATASETS))
  p.add_argument("--batch-size", type=int, default=64)
  p.add_argument("--width", type=int, default=64)
  p.add_argument("--method", default="all", choices=["all", *METHODS],
                 help="methods to print (JSON always has all)")
  p.add_argument("--rev-stash", default="x1", choices=["x1", "both"],
                 help="reversible input stash in the Table 3 model")
  p.add_argument("--live-width", type=int, default=4,
                 help="width of the live PETRA check (0: skip)")
  p.add_argument("--live-batch", type=int, default=4, help="batch of the live check")
  p.add_argument("--live-image-size", type=int, default=None,
                 help="image side of the live check (default: the dataset's)")
  p.add_argument("--device-memory", action="store_true",
                 help="also estimate each stage's peak device memory (Table 6; compiles "
                      "every step at the full size, nothing runs)")
  p.add_argument("--accumulation-steps", type=int, default=4,
                 help="k micro-batches per update of the flushed gpipe / 1f1b schedules")
  p.add_argument("--json", action="store_true", help="print JSON")
  args = p.parse_args(argv)
  r = report(args.model, args.dataset, args.batch_size, args.width, args.live_width,
             args.live_batch, args.rev_stash, args.live_image_size, args.device_memory,
             args.accumulation_steps)
  if args.json:
    print(json.dumps(r))
  else:
    _print(r, list(METHODS) if args.method == "all" else [args.method])
  return 0


if __name__ == "__main__":
  sys.exit(main())
