"""The ``language_model`` study: PETRA and ``delayed`` on ``revgpt_nano`` against
``revprop`` on the same model and backprop on the twin ``gpt_nano``, at equal tokens.

``python -m petra_jax.studies language_model [--rows=revprop,petra_j4_k4,...] [--seeds=0,1]
[--epochs=N] [--recipe=configs/shakespeare_cpu.py]``: each row is the recipe with the
fields of :data:`ROWS` changed (the stage split J, the micro-batches k, the method, the
compensation); the update's batch and every row's tokens stay the recipe's. A run finished in
``WORKDIR/<row>_s<seed>`` is read back, an interrupted one resumes. Writes
``OUT/language_model_study.md``: validation nats per character per seed and mean, the gap
to ``revprop`` (same seed), and ``OUT/language_model_study.png``: the validation curves.
"""

from __future__ import annotations

import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from petra_jax.studies import common  # noqa: E402

# revgpt_nano's 10 blocks (stem, 4 x (attn, mlp), head) in J stages.
SPLITS = {2: (5, 5), 4: (3, 2, 2, 3), 8: (2, 1, 1, 1, 1, 1, 1, 2)}


# compensation suffix -> the recipe's fields it sets (none, the shipped look-ahead, and the
# look-ahead whose b1 follows each stage's own delay: optim/momentum.py:own_delay_momentum).
COMPENSATIONS = {
    "": {"compensation.name": "none"},
    "_lookahead": {"compensation.name": "adam_lookahead", "compensation.lookahead_rule": "run_max"},
    "_lookahead_own": {"compensation.name": "adam_lookahead",
                       "compensation.lookahead_rule": "own_delay"},
}


def _row(method: str, j: int, k: int, compensation: str = "") -> dict:
  return {"method": method, "model.stage_sizes": SPLITS[j], "accumulation_steps": k,
          **COMPENSATIONS[compensation]}


# row -> the recipe's fields it changes (revprop first: the reference of the gaps). k counts
# the micro-batches of the recipe's 32-sequence update: stage 0 is 2 (J - 1) / k updates stale.
ROWS = {
    "revprop": _row("revprop", 4, 4),
    "backprop_gpt": {"method": "backprop", "model.name": "gpt_nano", "model.stage_sizes": (),
                     "accumulation_steps": 1, "compensation.name": "none"},
    **{f"{m}_j{j}_k{k}{c}": _row(m, j, k, c)
       for m in ("petra", "delayed") for j in (2, 4, 8) for k in (1, 4, 8, 16)
       for c in COMPENSATIONS},
}


def row_config(args, row: str, seed: int):
  """The recipe with ``ROWS[row]``, ``seed`` and the study's length and data."""
  if row not in ROWS:
    raise ValueError(f"unknown language-model-study row {row!r}; choose from {list(ROWS)} "
                     "(--rows=a,b).")
  return common.row_config(args, ROWS[row], seed)


def run_row(args, row: str, seed: int) -> dict:
  """Trains (or resumes, or reads back) one row and seed; returns its last validation."""
  name, records = common.train_row(args, row_config(args, row, seed), row, seed)
  evals = [r for r in records if "val_loss" in r]
  print(f"{name}: val_loss {evals[-1]['val_loss']:.4f}", flush=True)
  return dict(name=name, row=row, seed=seed, records=records, val_loss=evals[-1]["val_loss"],
              wall_time=evals[-1]["wall_time"])



def stale_updates(row: str) -> tuple:
  """``(J, k, D_0)`` of a row: its stages, micro-batches per update, and how many updates
  stage 0's gradient is late, ``D_0 = 2 (J - 1) / k`` (0 for the synchronous rows)."""
  fields = ROWS[row]
  j, k = max(len(fields["model.stage_sizes"]), 1), fields["accumulation_steps"]
  synchronous = fields["method"] in ("revprop", "backprop")
  return j, k, 0.0 if synchronous else 2 * (j - 1) / k


def table(results: list[dict]) -> list[str]:
  """Markdown rows: J, k, D_0; validation nats/char per seed and mean; gap to revprop
  (mean over the seeds revprop ran)."""
  base = {r["seed"]: r for r in results if r["row"] == "revprop"}
  lines = ["| row | J | k | D_0 | seeds | val. nats/char per seed | mean | gap to revprop (nats) "
           "| wall (s) |", "|---|---|---|---|---|---|---|---|---|"]
  for row in dict.fromkeys(r["row"] for r in results):
    runs = [r for r in results if r["row"] == row]
    paired = [r for r in runs if r["seed"] in base]
    gap = common.mean(r["val_loss"] - base[r["seed"]]["val_loss"] for r in paired)
    seeds = ", ".join(str(r["seed"]) for r in runs)
    losses = ", ".join(f"{r['val_loss']:.3f}" for r in runs)
    walls = ", ".join(f"{r['wall_time']:.0f}" for r in runs)
    j, k, d0 = stale_updates(row)
    lines.append(f"| `{row}` | {j} | {k} | {d0:g} | {seeds} | {losses} | "
                 f"{common.mean(r['val_loss'] for r in runs):.3f} | {gap:+.3f} | {walls} |")
  return lines


def plot(results: list[dict], path: str) -> None:
  """Validation nats per character against updates: one panel per stage count J, each with
  its rows and the synchronous references (``revprop``, ``backprop_gpt``) for comparison."""
  splits = sorted({stale_updates(r["row"])[0] for r in results if stale_updates(r["row"])[2]})
  splits = splits or [0]
  fig, axes = plt.subplots(1, len(splits), figsize=(5 * len(splits), 4.5), squeeze=False,
                           sharey=True)
  for ax, j in zip(axes[0], splits):
    for r in results:
      rj, _, d0 = stale_updates(r["row"])
      if d0 and rj != j:
        continue
      ev = [x for x in r["records"] if "val_loss" in x]
      ax.plot([x["step"] for x in ev], [x["val_loss"] for x in ev], label=r["name"],
              linestyle="--" if not d0 else "-")
    ax.set(xlabel="optimizer updates", title=f"J = {j}" if j else "synchronous")
    ax.legend(fontsize=6)
  axes[0][0].set_ylabel("validation loss (nats/char)")
  fig.suptitle("tiny_shakespeare, revgpt_nano: validation loss at equal tokens")
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def language_model_study(args) -> list[dict]:
  """Runs every selected row and seed; writes ``OUT/language_model_study.md`` and its plot.

  ``args``: ``rows`` (names, empty: all), ``seeds``, ``epochs`` / ``steps_per_epoch``
  (0: the recipe's), ``recipe``, ``data_dir``, ``workdir``, ``out``, ``argv`` (the command).
  """
  rows = args.rows or list(ROWS)
  unknown = [r for r in rows if r not in ROWS]
  if unknown:
    raise ValueError(f"unknown language-model-study rows {unknown}; choose from {list(ROWS)}.")
  results = [run_row(args, row, seed) for row in rows for seed in args.seeds]
  os.makedirs(args.out, exist_ok=True)
  plot(results, os.path.join(args.out, "language_model_study.png"))
  lines = ["# PETRA on a reversible decoder: tiny_shakespeare at equal tokens", "", "```",
           "python -m petra_jax.studies " + " ".join(args.argv), "```", "", *table(results), "",
           f"Recipe {args.recipe}; rows as in petra_jax/studies/language_model.py:ROWS.", "",
           "![validation curves](language_model_study.png)", ""]
  path = os.path.join(args.out, "language_model_study.md")
  with open(path, "w", encoding="utf-8") as f:
    f.write("\n".join(lines))
  print(f"wrote {path}")
  return results
