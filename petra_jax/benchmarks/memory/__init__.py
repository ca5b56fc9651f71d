"""What each stage stores between a micro-batch's forward and its backward (paper Tables 3, 6).

``python -m petra_jax.benchmarks.memory --model=revnet50 --dataset=imagenet --batch-size=64
[--method=petra] [--device-memory] [--json]``: analytic bytes per stage for each buffer
configuration and schedule (:mod:`petra_jax.benchmarks.memory.model`), checked against a live PETRA run at a small
width; Table 3's model; per-stage device memory (``--device-memory``); quantised formats.
"""

from __future__ import annotations

import functools
import json
import warnings
from typing import Callable, Optional, Sequence

from petra_jax import data as data_lib
from petra_jax import models
from petra_jax.benchmarks import cli
from petra_jax.benchmarks.memory.live import device_memory, measure_live
from petra_jax.benchmarks.memory.model import (
    GB, METHODS, MIB, PAPER_TABLE3, bytes_per_tick, stage_bytes,
    stored_bytes, table3, table3_extended)
from petra_jax.engine.arrays import quantize as quantize_lib


# ``python -m petra_jax.benchmarks.memory.PART`` imports this package, which imports its parts,
# before runpy runs the part (it then prints where its command lives); runpy's warning that the
# part is already imported says nothing to the user.
warnings.filterwarnings("ignore", message=r"'petra_jax\.benchmarks\.memory\.\w+' found in sys\.modules",
                        category=RuntimeWarning)

# Table 6 (CIFAR-10, batch 256): GB per 0-based stage of RevNet18, the legible entries.
PAPER_TABLE6 = {"revnet18": {3: 2.67, 5: 1.13, 6: 0.31, 7: 0.57, 8: 0.25, 9: 0.11}}


def quantization(build: Callable, image_shape, batch_size: int, live: Optional[dict] = None,
                 num_classes: int = 10) -> list[dict]:
  """Per format of ``quantize.FORMATS``: bytes sent per tick, PETRA's stored bytes, their
  float32 / format ratios, and with ``live`` (``{"width", "batch_size", "image_shape"}``) the
  same measured live. ``build``: ``width -> stages`` (``None``: the report's width)."""
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


def report(model: str, dataset: str, batch_size: int, width: int = 64,
           live_width: Optional[int] = 4, live_batch: int = 4,
           rev_stash: str = "x1", live_image_size: Optional[int] = None,
           with_device_memory: bool = False, accumulation_steps: int = 4) -> dict:
  """The CLI's JSON report (keys as built below; ``live`` only with ``live_width``)."""
  d = data_lib.DATASETS[dataset]
  build = functools.partial(cli.build, model, dataset)
  sizes = stage_bytes(build(width), d.image_shape, batch_size)
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
      "table3_extended": _table3_extended(model, dataset, width, batch_size, sizes, rev_stash),
  }
  if with_device_memory:
    out["device_memory"] = device_memory(build(width), d.image_shape, batch_size, d.num_classes)
  live = None
  if live_width:
    live = {"width": live_width, "batch_size": live_batch,
            "image_shape": cli.image_shape(dataset, live_image_size)}
    out["live"] = _live_check(build(live_width), live, d.num_classes)
  out["quantization"] = quantization(lambda w: build(w or width), d.image_shape,
                                     batch_size, live, d.num_classes)
  return out


def _live_check(stages, live: dict, num_classes: int) -> dict:
  """PETRA's measured bytes per stage at the ``live`` size against the analytic ones."""
  shape, batch = live["image_shape"], live["batch_size"]
  measured = measure_live(stages, shape, batch, num_classes)
  analytic = stored_bytes(stage_bytes(stages, shape, batch), "petra")
  err = max(abs(m - a) / max(a, 1) for m, a in zip(measured["petra"], analytic))
  return {"width": live["width"], "batch_size": batch, "image_shape": list(shape),
          "measured_bytes_per_stage": {k: measured[k] for k in ("petra", "delayed")},
          "analytic_bytes_per_stage": analytic, "max_rel_err": err}


def _table3_extended(model: str, dataset: str, width: int, batch_size: int, sizes,
                     rev_stash: str) -> list[dict]:
  """:func:`table3_extended`: quantised buffers, and the ``_inv`` variant if there is one."""
  shape = cli.image_shape(dataset)
  quantized = {fmt: stage_bytes(cli.build(model, dataset, width), shape, batch_size,
                                formats=quantize_lib.MessageFormats(buffer=fmt))
               for fmt in quantize_lib.FORMATS[1:]}
  inv = (stage_bytes(cli.build(f"{model}_inv", dataset, width), shape, batch_size)
         if f"{model}_inv" in models.MODEL_SPECS else None)
  return table3_extended(sizes, quantized, inv, rev_stash)


def _print(r: dict, methods: Sequence[str]) -> None:
  """The report as readable tables: stored MiB of ``methods``, then the rest."""
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
    _print_device_memory(r)
  _print_table3(r)
  _print_quantization(r)


def _print_device_memory(r: dict) -> None:
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


def _print_table3(r: dict) -> None:
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


def _print_quantization(r: dict) -> None:
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
  """``python -m petra_jax.benchmarks.memory``."""
  p = cli.parser("petra_jax.benchmarks.memory", __doc__, model="revnet50", dataset="imagenet",
                 width=64, batch_size=64)
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

