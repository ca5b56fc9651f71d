"""The ``local`` study: forward gradients and DGL beside PETRA and backprop.

``python -m petra_jax.studies local [--stages=4,10] [--seeds=0] [--width=8] [--epochs=1]
[--rows=backprop,fg_local_activity,...]``: RevNet18 on CIFAR-10, one row per :data:`ROWS` entry,
stage count and seed; test accuracy, backprop's at the same wall time, and bytes sent backward
per tick and stored (:func:`transfer_bytes`).
"""

from __future__ import annotations

import os
from typing import Sequence

import jax
import jax.numpy as jnp

from petra_jax import models
from petra_jax.engine.stages import partition
from petra_jax.engine import methods as methods_lib
from petra_jax.engine import schedules as schedule_lib
from petra_jax.engine.arrays.quantize import nbytes
from petra_jax.engine.stages.stage import trace
from petra_jax.studies.common import STAGE_SPLITS, at_wall_time, plot_accuracy, run, write_page

# (row, method, forward_gradient.guess, forward_gradient.perturb); backprop first: the
# wall-time reference.
ROWS = (("backprop", "backprop", "local", "activity"),
        ("fg_local_activity", "forward_gradient", "local", "activity"),
        ("fg_random_activity", "forward_gradient", "random", "activity"),
        ("local", "local", "local", "activity"),
        ("petra", "petra", "local", "activity"),
        ("fg_local_weights", "forward_gradient", "local", "weights"),
        ("fg_random_weights", "forward_gradient", "random", "weights"))


def selected_rows(names=None) -> tuple:
  """The rows of :data:`ROWS` named in ``names`` (all if empty), in order; ValueError if unknown."""
  if not names:
    return ROWS
  known = [r[0] for r in ROWS]
  unknown = [n for n in names if n not in known]
  if unknown:
    raise ValueError(f"unknown local-study rows {unknown}; choose from {known} (--rows=a,b).")
  return tuple(r for r in ROWS if r[0] in names)


def transfer_bytes(method: str, perturb: str = "activity", *, width: int = 64, micro: int = 64,
                   stage_sizes: Sequence[int] = (), num_classes: int = 10,
                   image_shape=(32, 32, 3), head: str = "mlp", hidden: int = 128) -> dict:
  """RevNet18's steady-state bytes, from shapes: ``{"backward_per_tick", "backward_max_link",
  "stored"}`` (``stored``: ``tau_j`` micro-batches of what each stage keeps, summed)."""
  stages = models.build_model("revnet18", width=width, num_classes=num_classes)
  if stage_sizes:
    stages = partition.group_stages(stages, list(stage_sizes))
  m = methods_lib.get(method)
  J = len(stages)
  x = jax.ShapeDtypeStruct((micro,) + tuple(image_shape), jnp.float32)
  shapes = trace(stages, x)
  inputs = [x] + [out for _, out in shapes[:-1]]
  if m.updates == "local" or not m.pipelined:
    return {"backward_per_tick": 0, "backward_max_link": 0, "stored": 0}
  sent, stored = [], 0
  for j, s in enumerate(stages):
    tau = schedule_lib.delay(j, J)
    kept_input = methods_lib.keeps(m, s.reversible, perturb).input
    if method == "forward_gradient":
      sent.append(4 * j * micro)
      guess = shapes[j][0]["params"] if perturb == "weights" else shapes[j][1]
      keep = nbytes(guess) + (nbytes(inputs[j]) if kept_input else 0)
    else:
      rebuilt = j > 0 and m.reconstructs_stage(stages[j - 1].reversible)
      sent.append(0 if j == 0 else nbytes(inputs[j]) * (2 if rebuilt else 1))
      keep = nbytes(inputs[j]) if kept_input else 0
    stored += 0 if j == J - 1 else tau * keep
  return {"backward_per_tick": sum(sent), "backward_max_link": max(sent), "stored": stored}


def local_study(args):
  """Runs the rows per stage count and seed; writes ``OUT/local.md`` and its plots."""
  rows = []
  k = args.ks[0] if getattr(args, "ks", None) else 1
  suffix = f"_k{k}" if k > 1 else ""
  for J in args.stages:
    for seed in args.seeds:
      args.seed = seed
      base = None
      for name, method, guess, perturb in selected_rows(getattr(args, "rows", None)):
        options = {"model.stage_sizes": STAGE_SPLITS[J]}
        if method == "forward_gradient":
          options.update({"forward_gradient.guess": guess, "forward_gradient.perturb": perturb})
        r = run(args, f"{name}_J{J}_s{seed}{suffix}", method, k, **options)
        base = r if method == "backprop" else base
        same_time = float("nan") if base is None else at_wall_time(base["records"], r["wall_time"])
        r = dict(r, name=f"{name}_J{J}_s{seed}{suffix}", stages=J, seed=seed, perturb=perturb,
                 backprop_same_time=same_time,
                 **transfer_bytes(method, perturb, width=args.width,
                                  micro=args.batch_size // k, stage_sizes=STAGE_SPLITS[J]))
        rows.append(r)
  table = ["| run | J | seed | test acc. (%) | backprop at the same wall time (%) | wall (s) | "
           "backward bytes / tick | stored bytes |", "|---|---|---|---|---|---|---|---|"]
  for r in rows:
    table.append(f"| `{r['name']}` | {r['stages']} | {r['seed']} | "
                 f"{100 * r['test_accuracy']:.1f} | {100 * r['backprop_same_time']:.1f} | "
                 f"{r['wall_time']:.0f} | {r['backward_per_tick']:,} | {r['stored']:,} |")
  write_page(args, "local", "Local learning: forward gradients, DGL, PETRA and backprop", table,
        rows, f"Seeds {list(args.seeds)}; bytes at this study's width and micro-batch "
        f"({args.width}, {args.batch_size}). Wall times share one CPU device "
        "(all stages on it) and a loaded machine: indicative only.")
  plot_accuracy(rows, os.path.join(args.out, "local_accuracy.png"),
                "Local learning: test accuracy")
  return rows

