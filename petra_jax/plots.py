"""Figures of a run: ``python -m petra_jax.plots WORKDIR [--steps=S1,S2] [--smooth=N]``.

Reads ``WORKDIR/metrics.jsonl`` and writes into ``WORKDIR/plots/``: ``training.png`` (losses,
test accuracy, learning rate), ``grad_quality_cos.png`` and ``grad_quality_norm_ratio.png``
(paper Fig. 5), ``grad_quality_by_stage.png`` (Fig. 6), ``reconstruction_error.png`` and, from
``WORKDIR/timeline.json`` (``{"num_stages": J, "events": [[tick, stage, "F"|"B", micro_batch],
...]}``, e.g. an ``engine.observers.TimelineRecorder``'s ``events``), ``timeline.png`` (Fig. 1).
A figure whose metrics the run did not record is skipped with a note.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import sys
from typing import Optional, Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from petra_jax.engine.stages import diagnostics  # noqa: E402
from petra_jax.training import metrics as metrics_lib  # noqa: E402

_KEY = re.compile(rf"^{diagnostics.PREFIX}/(?P<name>\w+)/stage_(?P<stage>\d+)$")
_PAIR_LABELS = {"applied_delayed": "applied vs delayed", "applied_e2e": "applied vs end-to-end",
                "delayed_e2e": "delayed vs end-to-end"}
_STEP_LABEL = "step (optimizer updates)"


class PlotError(ValueError):
  """The run directory has nothing to plot; the message names the fix."""


def load(workdir: str) -> list[dict]:
  """The records of ``WORKDIR/metrics.jsonl``.

  Raises:
    PlotError: if the file does not exist or is empty.
  """
  path = os.path.join(workdir, "metrics.jsonl")
  if not os.path.exists(path):
    raise PlotError(f"no metrics file at {path}; train first with "
                    f"python -m petra_jax.train --config=... --workdir={workdir}")
  records = metrics_lib.read_metrics(workdir)
  if not records:
    raise PlotError(f"{path} is empty; the run logged nothing yet.")
  return records


def series(records: Sequence[dict], key: str) -> tuple[np.ndarray, np.ndarray]:
  """``(steps, values)`` of every record holding ``key``, sorted by step."""
  pts = sorted((r["step"], r[key]) for r in records if key in r)
  if not pts:
    return np.zeros(0), np.zeros(0)
  steps, values = zip(*pts)
  return np.asarray(steps, float), np.asarray(values, float)


def grad_quality(records: Sequence[dict]) -> dict[str, dict[int, tuple]]:
  """``{metric: {stage: (steps, values)}}`` of the ``grad_quality/...`` keys
  (metric names as :data:`petra_jax.engine.stages.diagnostics.METRICS`)."""
  keys = collections.defaultdict(dict)
  for r in records:
    for k in r:
      m = _KEY.match(k)
      if m:
        keys[m["name"]][int(m["stage"])] = k
  return {name: {j: series(records, k) for j, k in sorted(stages.items())}
          for name, stages in keys.items()}


def smooth(values: np.ndarray, window: int) -> np.ndarray:
  """Trailing rolling mean over ``window`` points (paper Fig. 5 uses 10)."""
  if window <= 1 or len(values) == 0:
    return values
  c = np.cumsum(np.insert(values, 0, 0.0))
  n = np.minimum(np.arange(1, len(values) + 1), window)
  return (c[1:] - c[np.arange(1, len(values) + 1) - n]) / n


def _stage_colors(num_stages: int):
  cmap = plt.get_cmap("viridis")
  return [cmap(j / max(1, num_stages - 1)) for j in range(num_stages)]


def plot_training(records: Sequence[dict], path: str) -> Optional[str]:
  """Loss, test accuracy and learning rate against the step; None if none."""
  train_loss, test_loss = series(records, "train_loss"), series(records, "test_loss")
  acc, lr = series(records, "test_accuracy"), series(records, "learning_rate")
  if not any(len(s[0]) for s in (train_loss, test_loss, acc, lr)):
    return None
  fig, axes = plt.subplots(1, 3, figsize=(15, 4))
  ax = axes[0]
  ax.plot(*train_loss, label="train (mean over the logging window)")
  ax.plot(*test_loss, "o-", label="test")
  ax.set(title="Cross-entropy loss", xlabel=_STEP_LABEL, ylabel="loss (nats per image)")
  ax.legend()
  ax = axes[1]
  ax.plot(acc[0], 100 * acc[1], "o-", color="C1", label="test")
  ax.set(title="Test accuracy", xlabel=_STEP_LABEL, ylabel="top-1 accuracy (%)")
  ax.legend()
  ax = axes[2]
  ax.plot(*lr, color="C2", label="learning rate")
  ax.set(title="Learning rate", xlabel=_STEP_LABEL, ylabel="learning rate (per update)")
  ax.legend()
  for ax in axes:
    ax.grid(alpha=0.3)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return path


def plot_grad_quality_over_training(quality: dict, kind: str, path: str,
                                    window: int = 1) -> Optional[str]:
  """Paper Fig. 5: ``kind`` ("cos" or "norm_ratio") per stage over training; None if absent."""
  if f"{kind}_applied_delayed" not in quality:
    return None
  stages = sorted(quality[f"{kind}_applied_delayed"])
  colors = _stage_colors(max(stages) + 1)
  what = "cosine similarity" if kind == "cos" else "norm ratio"
  unit = "cosine (1 = aligned)" if kind == "cos" else "||numerator|| / ||denominator||"
  fig, axes = plt.subplots(1, 2, figsize=(16, 5))
  panels = [(axes[0], [("applied_delayed", "-")], f"{what}: applied vs delayed"),
            (axes[1], [("applied_e2e", "-"), ("delayed_e2e", "--")],
             f"{what} vs end-to-end: PETRA (full), delayed (dashed)")]
  for ax, pairs, title in panels:
    for pair, style in pairs:
      for j in stages:
        steps, values = quality[f"{kind}_{pair}"][j]
        ax.plot(steps, smooth(values, window), style, color=colors[j],
                label=f"stage {j}" if style == "-" else None)
    if kind == "norm_ratio":
      ax.axhline(1.0, color="grey", lw=0.8)
    ax.set(title=title + (f" (rolling mean of {window})" if window > 1 else ""),
           xlabel=_STEP_LABEL, ylabel=unit)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, title="stage", loc="upper left", bbox_to_anchor=(1.0, 1.0))
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return path


def pick_steps(quality: dict, steps: Optional[Sequence[int]] = None, num: int = 4) -> list:
  """The probed steps nearest to ``steps`` (default: ``num`` spread evenly)."""
  probed = quality["cos_applied_delayed"][min(quality["cos_applied_delayed"])][0]
  if len(probed) == 0:
    return []
  if not steps:
    idx = np.unique(np.linspace(0, len(probed) - 1, min(num, len(probed))).round().astype(int))
    return [int(probed[i]) for i in idx]
  return sorted({int(probed[np.argmin(np.abs(probed - s))]) for s in steps})


def plot_grad_quality_by_stage(quality: dict, path: str,
                               steps: Optional[Sequence[int]] = None) -> Optional[str]:
  """Paper Fig. 6: the three cosine similarities against the stage index,
  one panel per chosen step. Returns None if the run recorded none."""
  if "cos_applied_delayed" not in quality:
    return None
  chosen = pick_steps(quality, steps)
  fig, axes = plt.subplots(1, len(chosen), figsize=(4.5 * len(chosen), 4), squeeze=False)
  for ax, step in zip(axes[0], chosen):
    for pair, label in _PAIR_LABELS.items():
      by_stage = quality[f"cos_{pair}"]
      js = sorted(by_stage)
      values = [by_stage[j][1][by_stage[j][0] == step].mean() for j in js]
      ax.plot(js, values, "o-", label=label)
    ax.set(title=f"Cosine similarity at step {step}", xlabel="stage index j",
           ylabel="cosine similarity", ylim=(min(-0.05, ax.get_ylim()[0]), 1.05))
    ax.set_xticks(js)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return path


def plot_reconstruction_error(records: Sequence[dict], path: str) -> Optional[str]:
  """``||x~ - x|| / ||x||`` per reversible stage; None if not recorded."""
  keys = sorted({k for r in records for k in r if k.startswith("reconstruction_error/stage_")},
                key=lambda k: int(k.rsplit("_", 1)[1]))
  if not keys:
    return None
  stages = [int(k.rsplit("_", 1)[1]) for k in keys]
  colors = _stage_colors(max(stages) + 1)
  fig, ax = plt.subplots(figsize=(7, 4.5))
  for k, j in zip(keys, stages):
    ax.semilogy(*series(records, k), "o-", ms=3, color=colors[j], label=f"stage {j}")
  ax.set(title="Input reconstruction error of reversible stages", xlabel=_STEP_LABEL,
         ylabel="||x~ - x|| / ||x|| (relative)")
  ax.grid(alpha=0.3)
  ax.legend(fontsize=7, ncol=2, title="stage")
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return path


def plot_timeline_file(workdir: str, path: str) -> Optional[str]:
  """``WORKDIR/timeline.json`` drawn as paper Fig. 1; None if absent."""
  src = os.path.join(workdir, "timeline.json")
  if not os.path.exists(src):
    return None
  with open(src, encoding="utf-8") as f:
    recorded = json.load(f)
  from petra_jax.benchmarks import timeline  # (imports JAX: only when needed)
  events = [tuple(e) for e in recorded["events"]]
  return timeline.plot_timeline(events, recorded["num_stages"], path)


def make_plots(workdir: str, steps: Optional[Sequence[int]] = None,
               window: int = 1) -> list[str]:
  """Writes every figure the run's metrics allow into ``WORKDIR/plots/``; returns their paths.

  ``steps``: the Fig. 6 panels' steps (nearest probed); ``window``: Fig. 5's rolling mean.

  Raises:
    PlotError: no (or an empty) ``metrics.jsonl``.
  """
  records = load(workdir)
  out = os.path.join(workdir, "plots")
  os.makedirs(out, exist_ok=True)
  quality = grad_quality(records)
  made = [
      plot_training(records, os.path.join(out, "training.png")),
      plot_grad_quality_over_training(quality, "cos", os.path.join(out, "grad_quality_cos.png"),
                                      window),
      plot_grad_quality_over_training(quality, "norm_ratio",
                                      os.path.join(out, "grad_quality_norm_ratio.png"), window),
      plot_grad_quality_by_stage(quality, os.path.join(out, "grad_quality_by_stage.png"), steps),
      plot_reconstruction_error(records, os.path.join(out, "reconstruction_error.png")),
      plot_timeline_file(workdir, os.path.join(out, "timeline.png")),
  ]
  return [p for p in made if p is not None]


def main(argv: Optional[Sequence[str]] = None) -> int:
  """``python -m petra_jax.plots WORKDIR``."""
  p = argparse.ArgumentParser(prog="python -m petra_jax.plots",
                              description=__doc__.splitlines()[0])
  p.add_argument("workdir", help="a training run's --workdir (holds metrics.jsonl)")
  p.add_argument("--steps", default="",
                 help="comma-separated steps for the Fig. 6 panels (default: 4 spread evenly)")
  p.add_argument("--smooth", type=int, default=1,
                 help="rolling-mean window of the Fig. 5 curves (paper: 10; default 1 = raw)")
  args = p.parse_args(argv)
  try:
    steps = [int(s) for s in args.steps.split(",") if s.strip()]
    paths = make_plots(args.workdir, steps, args.smooth)
  except (PlotError, ValueError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 1
  for path in paths:
    print(path)
  if not any("grad_quality" in p for p in paths):
    print("(no grad_quality metrics: train with --config.grad_quality_every=N for Figs. 5-6)")
  return 0


if __name__ == "__main__":
  sys.exit(main())
