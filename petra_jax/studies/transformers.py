"""The ``transformers`` study: PETRA on the RevViT recipe with delay-robust optimizers.

``python -m petra_jax.studies transformers [--rows=backprop,petra_lookahead,...] [--seeds=0,1]
[--epochs=6] [--recipe=configs/cifar10_vit_cpu.py]``: each row is the recipe with the fields of
:data:`ROWS` changed; ``backprop`` rows train the non-reversible twin ``vit_tiny``. A run
finished in ``WORKDIR/<row>_s<seed>`` is read back, an interrupted one resumes. Writes
``OUT/transformers_study.md``: test accuracy per seed and mean at equal epochs, the gap to
backprop (AdamW), and backprop's accuracy at the row's wall time (same seed).
"""

from __future__ import annotations

import os

from petra_jax.studies import common
from petra_jax.studies.common import at_wall_time, plot_accuracy, recipe, write_page  # noqa: F401

_K2 = {"accumulation_steps": 2}
_BACKPROP = dict(_K2, **{"method": "backprop", "model.name": "vit_tiny", "model.stage_sizes": ()})
_EIGHT = dict(_K2, **{"model.stage_sizes": (2, 1, 1, 1, 1, 1, 1, 2)})  # delays 14, ..., 0 ticks
# row -> the recipe's fields it changes (backprop first: the reference of the gaps).
ROWS = {
    "backprop": dict(_BACKPROP, **{"compensation.name": "none"}),
    "backprop_muon": dict(_BACKPROP, **{"compensation.name": "none", "optim.name": "muon"}),
    "petra": dict(_K2, **{"compensation.name": "none"}),
    "petra_lookahead": dict(_K2, **{"compensation.name": "adam_lookahead"}),
    "petra_lookahead_k8": {"compensation.name": "adam_lookahead", "accumulation_steps": 8},
    "petra_prediction_lookahead": dict(_K2, **{
        "compensation.name": "adam_prediction+adam_lookahead"}),
    "petra_muon_error_feedback": dict(_K2, **{"optim.name": "muon",
                                              "compensation.name": "error_feedback"}),
    "petra_8stages": dict(_EIGHT, **{"compensation.name": "none"}),
    "petra_8stages_lookahead": dict(_EIGHT, **{"compensation.name": "adam_lookahead"}),
}


def row_config(args, row: str, seed: int):
  """The recipe with ``ROWS[row]``, ``seed`` and the study's length and data."""
  if row not in ROWS:
    raise ValueError(f"unknown transformers-study row {row!r}; choose from {list(ROWS)} "
                     "(--rows=a,b).")
  return common.row_config(args, ROWS[row], seed)


def run_row(args, row: str, seed: int) -> dict:
  """Trains (or resumes, or reads back) one row and seed; returns its result and records."""
  name, records = common.train_row(args, row_config(args, row, seed), row, seed)
  evals = [r for r in records if "test_accuracy" in r]
  print(f"{name}: test_accuracy {evals[-1]['test_accuracy']:.4f}", flush=True)
  return dict(name=name, row=row, seed=seed, records=records,
              method=ROWS[row].get("method", "petra"),
              test_accuracy=evals[-1]["test_accuracy"], wall_time=evals[-1]["wall_time"])



def table(results: list[dict]) -> list[str]:
  """Markdown rows: accuracy per seed and mean, gap to backprop, backprop at the same time."""
  base = {r["seed"]: r for r in results if r["row"] == "backprop"}
  lines = ["| row | seeds | test acc. per seed (%) | mean (%) | gap to backprop AdamW, same "
           "epochs (points) | backprop AdamW at the same wall time (%) | wall (s) |",
           "|---|---|---|---|---|---|---|"]
  for row in dict.fromkeys(r["row"] for r in results):
    runs = [r for r in results if r["row"] == row]
    mean = common.mean(100 * r["test_accuracy"] for r in runs)
    paired = [r for r in runs if r["seed"] in base]
    gap = common.mean(100 * base[r["seed"]]["test_accuracy"] for r in paired) - common.mean(
        100 * r["test_accuracy"] for r in paired)
    same_time = common.mean(100 * at_wall_time(base[r["seed"]]["records"], r["wall_time"])
                      for r in paired)
    per_seed = ", ".join(f"{100 * r['test_accuracy']:.1f}" for r in runs)
    walls = ", ".join(f"{r['wall_time']:.0f}" for r in runs)
    lines.append(f"| `{row}` | {', '.join(str(r['seed']) for r in runs)} | {per_seed} | "
                 f"{mean:.1f} | {gap:+.1f} | {same_time:.1f} | {walls} |")
  return lines


def transformers_study(args) -> list[dict]:
  """Runs every selected row and seed; writes ``OUT/transformers_study.md`` and its plot."""
  rows = args.rows or list(ROWS)
  unknown = [r for r in rows if r not in ROWS]
  if unknown:
    raise ValueError(f"unknown transformers-study rows {unknown}; choose from {list(ROWS)}.")
  results = [run_row(args, row, seed) for row in rows for seed in args.seeds]
  write_page(args, "transformers_study", "PETRA on the RevViT recipe: delay-robust optimizers",
             table(results), results,
             f"Recipe {args.recipe}, {args.epochs} epoch(s), rows changed as in "
             "petra_jax/studies/transformers.py:ROWS. Wall times are those of the runs as "
             "scheduled: compare them only between runs that shared the machine alike.")
  plot_accuracy(results, os.path.join(args.out, "transformers_study_accuracy.png"),
                "RevViT recipe: test accuracy")
  return results
