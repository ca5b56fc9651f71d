"""The ``depth`` study: PETRA and ``delayed`` on the RevViT recipe in J = 2 to 16 stages.

``python -m petra_jax.studies depth [--rows=...] [--seeds=0,1,2] [--epochs=6]
[--recipe=configs/cifar10_vit_cpu.py] [--finished-only] [--stage-iters=7]``: each row of
:data:`ROWS` is the recipe with a few fields changed: a pipeline row
``<method>_J<J>_k<k>_<optimizer>`` (``method`` in ``petra``, ``delayed``; the stage split
:data:`SPLITS`, the optimizer :data:`OPTIMIZERS`), the same with the suffix ``_balanced`` (the
split balanced on the blocks' measured costs: :func:`petra_jax.studies.depth_time.balanced_config`)
or a synchronous reference (:data:`REFERENCES`: ``revprop`` on the same reversible network, and
the ``vit_tiny`` twin). Every row evaluates :data:`EVALS_PER_EPOCH` times an epoch. A run
finished in ``WORKDIR/<row>_s<seed>`` is read back, an interrupted one resumes. Writes
``OUT/depth.md``: test accuracy per seed and mean, the gap to the best reference of the same
depth, the reconstruction error the observers logged, the ``delayed``-versus-``petra`` split
of the gap, the simulated time of PETRA, GPipe and 1F1B to fixed accuracies over named links
(:mod:`petra_jax.studies.depth_time`) and each one's per-device peak memory; and
``OUT/depth_accuracy.png``, accuracy against stage 0's delay in updates ``D_0 = 2 (J - 1) / k``.
"""

from __future__ import annotations

import os
from typing import Optional, Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from petra_jax.studies.common import mean_reconstruction_error, write_page  # noqa: E402
from petra_jax.studies import common  # noqa: E402
from petra_jax.studies import depth_time  # noqa: E402
from petra_jax.training import metrics as metrics_lib  # noqa: E402

# Stage split of the RevViT's blocks (tokenizer, 2 per transformer layer, head) per J: 10
# blocks at depth 4, 18 at depth 8 (J = 16: one block per stage but the two ends).
SPLITS = {2: (5, 5), 4: (3, 2, 2, 3), 8: (2, 1, 1, 1, 1, 1, 1, 2), 16: (2,) + (1,) * 14 + (2,)}
DEPTHS = {2: 4, 4: 4, 8: 4, 16: 8}
KS = (2, 4, 8)
EVALS_PER_EPOCH = 4  # test evaluations an epoch: the time to accuracy's resolution, 1/4 epoch
BALANCED = "_balanced"  # a pipeline row's suffix: its split balanced on measured costs
# The synchronous references' learning rates, chosen on the unreported seed 100 (docs/depth.md);
# the Muon rows use the reference's, the AdamW rows the recipe's (tuned for PETRA, 1e-3).
REFERENCE_ADAMW_LR = 4e-3
REFERENCE_MUON_LR = 0.02
_MUON = {"optim.name": "muon", "optim.muon_learning_rate": REFERENCE_MUON_LR}
# optimizer -> the recipe's fields it sets.
OPTIMIZERS = {
    "adamw": {"optim.name": "adam", "compensation.name": "none"},
    "lookahead": {"optim.name": "adam", "compensation.name": "adam_lookahead"},
    "lookahead_own": {"optim.name": "adam", "compensation.name": "adam_lookahead",
                      "compensation.lookahead_rule": "own_delay"},
    "nadamw_ajanthan": {"optim.name": "nadamw", "optim.adam_b1": 0.99, "optim.clip_norm": 10.0,
                        "compensation.name": "none"},
    "adamw_lr_scale": {"optim.name": "adam", "compensation.name": "lr_scale"},
    "muon": dict(_MUON, **{"compensation.name": "none"}),
    "muon_error_feedback": dict(_MUON, **{"compensation.name": "error_feedback"}),
    "muon_prediction": dict(_MUON, **{"compensation.name": "update_prediction"}),
    # Weight prediction with PipeMare's T1 on top: stage j's rate x max(D_j, 1)^-p, p = 1, 1/2.
    "muon_prediction_lr_scale": dict(_MUON, **{"compensation.name": "lr_scale+update_prediction"}),
    "muon_prediction_lr_sqrt": dict(_MUON, **{"compensation.name": "lr_scale+update_prediction",
                                              "compensation.lr_power": 0.5}),
    # The prediction's reach (w + s D_j u_t), Muon's momentum, and both Muon corrections.
    "muon_prediction_scale0.5": dict(_MUON, **{"compensation.name": "update_prediction",
                                               "compensation.prediction_scale": 0.5}),
    "muon_prediction_scale1.5": dict(_MUON, **{"compensation.name": "update_prediction",
                                               "compensation.prediction_scale": 1.5}),
    "muon_prediction_b0.98": dict(_MUON, **{"compensation.name": "update_prediction",
                                            "optim.muon_momentum": 0.98}),
    "muon_prediction_error_feedback": dict(_MUON, **{
        "compensation.name": "error_feedback+update_prediction"}),
    # Less momentum under delay (asynchrony acts as momentum: Mitliagkas et al., 2016), a lower
    # rate, and PipeMare's annealed rate (T1 with q_t = 1 - min(t / K, 1), K = 1 epoch).
    "muon_prediction_b0.9": dict(_MUON, **{"compensation.name": "update_prediction",
                                           "optim.muon_momentum": 0.9}),
    "muon_prediction_b0.8": dict(_MUON, **{"compensation.name": "update_prediction",
                                           "optim.muon_momentum": 0.8}),
    "muon_prediction_lr0.01": dict(_MUON, **{"compensation.name": "update_prediction",
                                             "optim.muon_learning_rate": 0.01}),
    "muon_prediction_pipemare": dict(_MUON, **{"compensation.name": "pipemare+update_prediction",
                                               "compensation.pipemare_warmup_epochs": 1.0}),
    # PSGD Kron (Kronecker-factored, Shampoo-style; psgdax) at the recipe's rate, plain and with
    # weight prediction.
    "kron": {"optim.name": "kron", "compensation.name": "none"},
    "kron_prediction": {"optim.name": "kron", "compensation.name": "update_prediction"},
    "kron_prediction_lr3e-3": {"optim.name": "kron", "optim.learning_rate": 3e-3,
                               "compensation.name": "update_prediction"},
}


def _reference(name: str, depth: int, optimizer: dict) -> dict:
  model = ({"model.name": "vit_tiny", "model.stage_sizes": ()} if name.startswith("vit_tiny")
           else {"model.stage_sizes": SPLITS[4] if depth == 4 else SPLITS[16]})
  method = "backprop" if name.startswith("vit_tiny") else "revprop"
  return dict(model, method=method, **{"model.depth": depth, **optimizer})


REFERENCES = {}
for _depth, _suffix in ((4, ""), (8, "_depth8")):
  REFERENCES[f"revprop_adamw{_suffix}"] = _reference("revprop", _depth, {
      "optim.name": "adam", "optim.learning_rate": REFERENCE_ADAMW_LR,
      "compensation.name": "none"})
  REFERENCES[f"revprop_muon{_suffix}"] = _reference("revprop", _depth, {
      "optim.name": "muon", "optim.muon_learning_rate": REFERENCE_MUON_LR,
      "compensation.name": "none"})
for _lr, _suffix in ((1e-3, ""), (3e-3, "_lr3e-3")):
  REFERENCES[f"revprop_kron{_suffix}"] = _reference("revprop", 4, {
      "optim.name": "kron", "optim.learning_rate": _lr, "compensation.name": "none"})
REFERENCES["vit_tiny_adamw"] = _reference("vit_tiny", 4, {
    "optim.name": "adam", "optim.learning_rate": REFERENCE_ADAMW_LR, "compensation.name": "none"})

# The references' own knobs, probed on the tuning seed (100) as hard as PETRA's rows were
# (issue 48: PETRA in 8 stages at k = 4 got 18 optimizer variants): each reference's rate,
# momentum or beta1 (and AdamW's beta2), warm-up and weight decay, one knob at a time around
# the reference. A row is ``<reference>_<probe>``.
_SHARED_PROBES = {"warmup0": {"optim.warmup_epochs": 0.0}, "warmup1": {"optim.warmup_epochs": 1.0},
                  "wd0.01": {"optim.weight_decay": 0.01}, "wd0.1": {"optim.weight_decay": 0.1}}
REFERENCE_PROBES = {
    "muon": {**{f"lr{x:g}": {"optim.muon_learning_rate": x} for x in (0.01, 0.03, 0.04, 0.06)},
             **{f"b{x:g}": {"optim.muon_momentum": x} for x in (0.8, 0.9, 0.98)},
             "lr0.04_b0.9": {"optim.muon_learning_rate": 0.04, "optim.muon_momentum": 0.9},
             "adam_lr3e-3": {"optim.learning_rate": 3e-3}, **_SHARED_PROBES},
    "adamw": {**{f"lr{x:g}": {"optim.learning_rate": x} for x in (1e-3, 2e-3, 6e-3, 8e-3)},
              **{f"b{x:g}": {"optim.adam_b1": x} for x in (0.8, 0.95)},
              "b2_0.99": {"optim.adam_b2": 0.99}, "b2_0.98": {"optim.adam_b2": 0.98},
              "eps1e-6": {"optim.adam_eps": 1e-6}, **_SHARED_PROBES},
}
PROBED_REFERENCES = {}  # the rows of REFERENCE_PROBES: references too, run on seed 100 only
for _name in REFERENCES:
  _optimizer = _name.split("_")[1] if _name.startswith("revprop_") else ""
  for _probe, _fields in REFERENCE_PROBES.get(_optimizer, {}).items():
    PROBED_REFERENCES[f"{_name}_{_probe}"] = dict(REFERENCES[_name], **_fields)


def pipeline_row(method: str, J: int, k: int, optimizer: str) -> dict:
  """The recipe's fields of ``<method>_J<J>_k<k>_<optimizer>``."""
  return {"method": method, "model.depth": DEPTHS[J], "model.stage_sizes": SPLITS[J],
          "accumulation_steps": k, **OPTIMIZERS[optimizer]}


ROWS = {**REFERENCES, **PROBED_REFERENCES}
for _J in SPLITS:
  for _k in KS:
    for _method in ("petra", "delayed"):
      for _opt in OPTIMIZERS:
        ROWS[f"{_method}_J{_J}_k{_k}_{_opt}"] = pipeline_row(_method, _J, _k, _opt)


def base_row(row: str) -> str:
  """The row of :data:`ROWS` that ``row`` is (a pipeline row without :data:`BALANCED`); ""
  for a balanced name of no pipeline row."""
  base = row[:-len(BALANCED)] if row.endswith(BALANCED) else row
  return base if base == row or (base in ROWS and base.startswith(("petra_", "delayed_"))) else ""


def describe(row: str) -> dict:
  """``{"J", "k", "method", "optimizer", "depth", "reference"}`` of a row of :data:`ROWS`
  (a balanced row: its base row's)."""
  row = base_row(row)
  fields = ROWS[row]
  if row in REFERENCES or row in PROBED_REFERENCES:
    return {"J": 1, "k": fields.get("accumulation_steps", 0), "method": fields["method"],
            "optimizer": row.split("_")[1], "depth": fields["model.depth"], "reference": True}
  method, j, k, optimizer = row.split("_", 3)
  return {"J": int(j[1:]), "k": int(k[1:]), "method": method, "optimizer": optimizer,
          "depth": fields["model.depth"], "reference": False}


def stage0_delay(J: int, k: int) -> float:
  """Stage 0's delay in updates, ``D_0 = tau_0 / k = 2 (J - 1) / k``."""
  return 2.0 * (J - 1) / k if k else 0.0


def row_config(args, row: str, seed: int):
  """The recipe with ``ROWS[row]``, ``seed``, the study's length and data, and
  :data:`EVALS_PER_EPOCH`; a balanced row's split from its blocks' costs (measured once, kept in
  the workdir). Raises ValueError: an unknown row (the message names them)."""
  base = base_row(row)
  if base not in ROWS:
    raise ValueError(f"unknown depth-study row {row!r}; rows are REFERENCES "
                     f"{list(REFERENCES)}, <reference>_<probe of REFERENCE_PROBES> or <petra|delayed>_J<{'|'.join(map(str, SPLITS))}>"
                     f"_k<{'|'.join(map(str, KS))}>_<{'|'.join(OPTIMIZERS)}>[{BALANCED}] "
                     f"({BALANCED}: the split balanced on the blocks' measured costs) "
                     "(--rows=a,b).")
  config = common.row_config(args, ROWS[base], seed)
  config.evals_per_epoch = EVALS_PER_EPOCH
  return depth_time.balanced_config(args, config, base) if base != row else config


def finished(args, row: str, seed: int) -> bool:
  """Whether ``WORKDIR/<row>_s<seed>`` holds an evaluation at ``--epochs`` (or later)."""
  path = os.path.join(args.workdir, f"{row}_s{seed}", "metrics.jsonl")
  if not os.path.exists(path):
    return False
  epochs = row_config(args, row, seed).num_epochs
  records = metrics_lib.read_metrics(os.path.dirname(path))
  return any("test_accuracy" in r and r.get("epoch", 0) >= epochs - 1e-6 for r in records)


def run_row(args, row: str, seed: int) -> dict:
  """Trains (or resumes, or reads back) one row and seed; returns its result and records."""
  name, records = common.train_row(args, row_config(args, row, seed), row, seed)
  evals = [r for r in records if "test_accuracy" in r]
  losses = [r["train_loss"] for r in records if "train_loss" in r]
  print(f"{name}: test_accuracy {evals[-1]['test_accuracy']:.4f}", flush=True)
  return dict(describe(row), name=name, row=row, seed=seed, records=records,
              test_accuracy=evals[-1]["test_accuracy"], wall_time=evals[-1]["wall_time"],
              final_train_loss=losses[-1] if losses else float("nan"))



def _by_row(results: Sequence[dict]) -> dict:
  out = {}
  for r in results:
    out.setdefault(r["row"], []).append(r)
  return out


def best_reference(results: Sequence[dict], depth: int) -> Optional[str]:
  """The reference row of ``depth`` (reversible network) with the best mean accuracy."""
  means = {row: common.mean(r["test_accuracy"] for r in runs) for row, runs in _by_row(results).items()
           if runs[0]["reference"] and runs[0]["depth"] == depth and runs[0]["method"] == "revprop"}
  return max(means, key=means.get) if means else None


def _gap(results, runs) -> float:
  """Best reference's mean minus the row's mean over the seeds both have (points)."""
  ref = best_reference(results, runs[0]["depth"])
  if ref is None:
    return float("nan")
  base = {r["seed"]: r for r in results if r["row"] == ref}
  paired = [r for r in runs if r["seed"] in base]
  return 100 * (common.mean(base[r["seed"]]["test_accuracy"] for r in paired)
                - common.mean(r["test_accuracy"] for r in paired))


def table(results: Sequence[dict]) -> list[str]:
  """Markdown rows: J, k, D_0, accuracy per seed and mean, gap, reconstruction error."""
  lines = ["| row | J | k | D_0 (updates) | seeds | test acc. per seed (%) | mean (%) | gap to "
           "best reference, same seeds (points) | final train loss (mean) | mean rel. "
           "reconstruction error |", "|---|---|---|---|---|---|---|---|---|---|"]
  for row, runs in _by_row(results).items():
    d = runs[0]
    seeds = ", ".join(str(r["seed"]) for r in runs)
    per_seed = ", ".join(f"{100 * r['test_accuracy']:.1f}" for r in runs)
    gap = "-" if d["reference"] else f"{_gap(results, runs):+.1f}"
    lines.append(
        f"| `{row}` | {d['J']} | {d['k'] or '-'} | {stage0_delay(d['J'], d['k']):.2f} | "
        f"{seeds} | {per_seed} | {common.mean(100 * r['test_accuracy'] for r in runs):.1f} | {gap} | "
        f"{common.mean(r['final_train_loss'] for r in runs):.3f} | "
        f"{common.mean(mean_reconstruction_error(r['records']) for r in runs):.2e} |")
  return lines


def staleness_table(results: Sequence[dict]) -> list[str]:
  """Per (J, k, optimizer) with both methods: the gap of ``delayed`` (staleness alone) and
  ``petra`` minus ``delayed`` (the reconstruction's share), over the seeds both ran."""
  rows = _by_row(results)
  lines = ["| J | k | optimizer | seeds | gap of `delayed` (staleness, points) | gap of `petra` "
           "(points) | reconstruction's share: petra - delayed (points) | petra's mean rel. "
           "reconstruction error |", "|---|---|---|---|---|---|---|---|"]
  for row, runs in rows.items():
    twin = rows.get("delayed_" + row[len("petra_"):]) if row.startswith("petra_") else None
    seeds = sorted({r["seed"] for r in runs} & {r["seed"] for r in twin or ()})
    if not seeds:
      continue
    runs = [r for r in runs if r["seed"] in seeds]
    twin = [r for r in twin if r["seed"] in seeds]
    d = runs[0]
    g_petra, g_delayed = _gap(results, runs), _gap(results, twin)
    lines.append(f"| {d['J']} | {d['k']} | {d['optimizer']} | {', '.join(map(str, seeds))} "
                 f"| {g_delayed:+.1f} | {g_petra:+.1f} "
                 f"| {g_petra - g_delayed:+.1f} | "
                 f"{common.mean(mean_reconstruction_error(r['records']) for r in runs):.2e} |")
  return lines


def plot_accuracy_vs_delay(results: Sequence[dict], path: str):
  """Mean test accuracy against ``D_0``, one line per (method, optimizer); references flat."""
  fig, ax = plt.subplots(figsize=(8, 4.5))
  lines = {}
  for row, runs in _by_row(results).items():
    d = runs[0]
    acc = common.mean(100 * r["test_accuracy"] for r in runs)
    if d["reference"]:
      ax.axhline(acc, linestyle="--", color="gray", linewidth=0.8)
      ax.annotate(row, (0, acc), fontsize=7, color="gray")
    else:
      lines.setdefault(f"{d['method']} {d['optimizer']}", []).append(
          (stage0_delay(d["J"], d["k"]), acc))
  for label, points in sorted(lines.items()):
    ax.plot(*zip(*sorted(points)), marker="o", label=label,
            linestyle="-" if label.startswith("petra") else ":")
  ax.set(xlabel="stage 0's delay D_0 = 2 (J - 1) / k (updates)", ylabel="test accuracy (%)",
         title="RevViT, CIFAR-10: accuracy against the delay")
  ax.grid(alpha=0.3)
  if lines:
    ax.legend(fontsize=7, loc="lower left")
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def depth_study(args) -> list[dict]:
  """Runs every selected row and seed; writes ``OUT/depth.md`` and ``OUT/depth_accuracy.png``."""
  rows = args.rows or list(REFERENCES)
  unknown = [r for r in rows if base_row(r) not in ROWS]
  if unknown:
    row_config(args, unknown[0], 0)  # raises the error naming the rows
  pairs = [(row, seed) for row in rows for seed in args.seeds]
  if getattr(args, "finished_only", False):
    pairs = [(row, seed) for row, seed in pairs if finished(args, row, seed)]
    if not pairs:
      raise ValueError(f"no finished run of these rows and seeds under {args.workdir}; "
                       "drop --finished-only to train them.")
  results = [run_row(args, row, seed) for row, seed in pairs]
  os.makedirs(args.out, exist_ok=True)
  references = {d: best_reference(results, d) for d in {r["depth"] for r in results}}
  sim = depth_time.simulation_section(args, results, references,
                                      lambda row: row_config(args, row, 0))
  sim += ["", *memory_lines(args, results)]
  notes = "\n".join([
      f"Recipe {args.recipe}, {args.epochs} epoch(s); rows as in "
      "petra_jax/studies/depth.py:ROWS. Gap: the best `revprop` reference of the same depth "
      "minus the row, over the seeds both ran (positive: the row is worse).", "",
      "## Staleness or reconstruction", "", *staleness_table(results), "", *sim, "",
      "![accuracy against the delay](depth_accuracy.png)"])
  write_page(args, "depth", "PETRA at depth: RevViT in 2 to 16 stages", table(results), results,
             notes)
  plot_accuracy_vs_delay(results, os.path.join(args.out, "depth_accuracy.png"))
  return results


# -- what it buys on J devices (the simulated time: petra_jax.studies.depth_time) ------------


def peak_bytes_per_device(config, micro_batch: int, k: int) -> dict:
  """Per method (``petra``, ``gpipe``, ``1f1b``): the largest ``params_j + stored_j`` over the
  stages (bytes; :mod:`petra_jax.benchmarks.memory.model`, shapes only). Stage 0's images are
  not counted for any method (re-read from the dataset, as paper Table 3)."""
  from petra_jax import models  # pylint: disable=g-import-not-at-top
  from petra_jax.benchmarks.memory import model as memory_model  # pylint: disable=g-import-not-at-top
  from petra_jax.engine.stages import partition  # pylint: disable=g-import-not-at-top
  m = config.model
  stages = partition.group_stages(
      models.build_model(m.name, width=m.width, depth=m.depth or None, num_classes=10,
                         patch_size=m.patch_size or None, tokenizer=m.tokenizer),
      list(m.stage_sizes))
  sizes = memory_model.stage_bytes(stages, (32, 32, 3), micro_batch)
  return {method: max(r["param_bytes"] + s for r, s in zip(
      sizes, memory_model.stored_bytes(sizes, method, first_input=False, accumulation_steps=k)))
          for method in ("petra", "gpipe", "1f1b")}


def memory_lines(args, results: Sequence[dict]) -> list[str]:
  """Per (row's split, k) of a PETRA row with J >= 8: the peak bytes per device of PETRA, GPipe
  and 1F1B (:func:`peak_bytes_per_device`; shapes only, nothing measured)."""
  rows = sorted({r["row"] for r in results
                 if not r["reference"] and r["method"] == "petra" and r["J"] >= 8})
  lines = []
  for row in rows:
    config = row_config(args, row, 0)
    k = config.accumulation_steps
    peak = peak_bytes_per_device(config, config.batch_size // k, k)
    lines.append(f"- `{row}` (split {tuple(config.model.stage_sizes)}, k = {k}): peak MiB per "
                 f"device PETRA {peak['petra'] / 2**20:.1f}, GPipe {peak['gpipe'] / 2**20:.1f}, "
                 f"1F1B {peak['1f1b'] / 2**20:.1f}.")
  return ["## Peak memory per device", "", "`petra_jax.benchmarks.memory.model`: parameters + "
          "what a stage holds between forward and backward, optimizer state excluded.", "",
          *lines] if lines else []
