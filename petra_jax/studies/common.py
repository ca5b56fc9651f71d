"""What every study shares: one run of the RevNet18 recipe, the page it writes, its plots.

A study writes ``OUT/<study>.md`` (table, command, machine, date, wall times) and its plots;
``OUT`` is ``--out`` when given, else the run directory ``runs/studies/<study>`` (never
``docs/`` unless asked). Each run's ``metrics.jsonl`` stays under ``--workdir``.
"""

from __future__ import annotations

import datetime
import os
import platform
from typing import Sequence

from petra_jax import config as config_lib
from petra_jax.engine import methods as methods_lib
from petra_jax.training import metrics as metrics_lib
from petra_jax import train
import jax
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


recipe = config_lib.recipe  # the studies' --recipe=FILE[:VARIANT]


def row_config(args, fields: dict, seed: int):
  """``args.recipe`` with a study row's ``fields`` (``config.override``), ``seed``, and the
  study's length (``args.epochs``, 0: the recipe's; ``args.steps_per_epoch``) and data."""
  config = recipe(args.recipe)
  config_lib.override(config, fields)
  config.seed = seed
  if args.epochs:
    config.num_epochs = args.epochs
  if args.steps_per_epoch:
    config.steps_per_epoch = args.steps_per_epoch
  if args.data_dir:
    config.data_dir = args.data_dir
  return config

def train_row(args, config, row: str, seed: int) -> tuple:
  """Trains (or resumes, or reads back) one study row with ``config`` in
  ``args.workdir/<row>_s<seed>``: ``(name, records)``, the records of its ``metrics.jsonl``."""
  name = f"{row}_s{seed}"
  workdir = os.path.join(args.workdir, name)
  train.train_and_evaluate(config, workdir)
  return name, metrics_lib.read_metrics(workdir)


def mean(values) -> float:
  """The mean of ``values``; NaN for none."""
  values = list(values)
  return sum(values) / len(values) if values else float("nan")


STAGE_SPLITS = {10: (), 5: (1, 2, 2, 2, 3), 4: (1, 2, 2, 5)}  # RevNet18's 10 blocks


def output_dir(study: str, out: str = "") -> str:
  """Where ``study`` writes its page: ``out`` if given, else ``runs/studies/<study>``."""
  return out or os.path.join("runs", "studies", study)


def study_config(args, method: str, k: int) -> config_lib.ml_collections.ConfigDict:
  """The CPU recipe (``configs/cifar10_cpu.py``'s optimizer) at the study's size."""
  c = config_lib.get_config()
  c.method = method
  c.data_dir = args.data_dir
  c.model.width = args.width
  c.batch_size = args.batch_size
  c.accumulation_steps = k
  c.num_epochs = args.epochs
  c.steps_per_epoch = args.steps_per_epoch
  c.num_devices = 1
  c.eval_every = 1
  c.log_every = args.log_every
  c.seed = args.seed
  c.reconstruction_error_every = getattr(args, "reconstruction_error_every", 0)
  c.optim.learning_rate = args.learning_rate
  c.optim.schedule = "cosine"
  c.optim.warmup_epochs = args.warmup_epochs
  return c


def run(args, name: str, method: str, k: int, **overrides) -> dict:
  """Trains one row (``overrides``: dotted config fields); returns its final metrics and curve.

  Raises:
    validation.ConfigError, data.DataError: as :func:`train.train_and_evaluate`.
  """
  workdir = os.path.join(args.workdir, name)
  if os.path.exists(os.path.join(workdir, "metrics.jsonl")):
    os.remove(os.path.join(workdir, "metrics.jsonl"))  # a study run starts afresh
  config = study_config(args, method, k)
  if method in methods_lib.DELAYED and getattr(args, "compensation", "none") != "none":
    config.compensation.name = args.compensation
  config_lib.override(config, overrides)
  result = train.train_and_evaluate(config, workdir)
  records = metrics_lib.read_metrics(workdir)
  losses = [r["train_loss"] for r in records if "train_loss" in r]
  print(f"{name}: test_accuracy {result['test_accuracy']:.4f} ({result['wall_time']:.0f} s)",
        flush=True)
  return dict(result, name=name, method=method, k=k, records=records,
              final_train_loss=losses[-1] if losses else float("nan"))


def machine() -> str:
  d = jax.devices()[0]
  return (f"{platform.machine()} {os.cpu_count()}-core {d.platform.upper()} "
          f"({d.device_kind}), jax {jax.__version__}, {platform.python_version()}")


def plot_curves(rows: Sequence[dict], path: str, title: str):
  fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(11, 4))
  for r in rows:
    tr = [(x["step"], x["train_loss"]) for x in r["records"] if "train_loss" in x]
    te = [(x["step"], 100 * x["test_accuracy"]) for x in r["records"] if "test_accuracy" in x]
    if tr:
      ax_loss.plot(*zip(*tr), label=r["name"])
    if te:
      ax_acc.plot(*zip(*te), marker="o", label=r["name"])
  ax_loss.set(title="training loss", xlabel="optimizer updates", ylabel="cross-entropy (nats)")
  ax_acc.set(title="test accuracy", xlabel="optimizer updates", ylabel="accuracy (%)")
  for ax in (ax_loss, ax_acc):
    ax.grid(alpha=0.3)
    ax.legend()
  fig.suptitle(title)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def setting(args, seeds) -> str:
  """The RevNet18 studies' recipe in one sentence."""
  return (f"Model: RevNet18 width {args.width}, batch {args.batch_size} images per update, "
          f"{args.epochs} epoch(s), SGD-Nesterov lr {args.learning_rate} with "
          f"{args.warmup_epochs} warm-up epoch(s) then cosine, wd 5e-4, "
          f"seed(s) {', '.join(map(str, seeds))}.")


def write_page(args, study: str, header: str, table: list[str], rows, notes: str):
  """Writes ``OUT/<study>.md`` and ``OUT/<study>.png``."""
  os.makedirs(args.out, exist_ok=True)
  png = os.path.join(args.out, f"{study}.png")
  plot_curves(rows, png, header)
  seeds = sorted({r.get("seed", args.seed) for r in rows}) if rows else [args.seed]
  recipe = "" if args.study in ("transformers", "depth") else setting(args, seeds)
  lines = [f"# {header}", "", "Command:", "", "```",
           "python -m petra_jax.studies " + " ".join(args.argv), "```", "",
           f"Machine: {machine()}. Date: {datetime.date.today().isoformat()}. {recipe}", "",
           *table, "", notes, "", f"![{study}]({study}.png)", ""]
  path = os.path.join(args.out, f"{study}.md")
  with open(path, "w", encoding="utf-8") as f:
    f.write("\n".join(lines))
  print(f"wrote {path} and {png}")


def at_wall_time(records: Sequence[dict], seconds: float) -> float:
  """Test accuracy of the last evaluation at or before ``seconds`` (NaN if none)."""
  done = [r["test_accuracy"] for r in records
          if "test_accuracy" in r and r["wall_time"] <= seconds + 1e-9]
  return done[-1] if done else float("nan")


def mean_reconstruction_error(records: Sequence[dict]) -> float:
  """Mean of every ``reconstruction_error/stage_j`` logged (NaN if none)."""
  errs = [v for r in records for key, v in r.items() if key.startswith("reconstruction_error/")]
  return sum(errs) / len(errs) if errs else float("nan")


def plot_accuracy(rows: Sequence[dict], path: str, title: str):
  """Test accuracy against epochs and against seconds, one line per row."""
  fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
  for r in rows:
    ev = [x for x in r["records"] if "test_accuracy" in x]
    style = dict(marker="o", label=r["name"], linestyle="--" if r["method"] == "backprop" else "-")
    axes[0].plot([x["epoch"] for x in ev], [100 * x["test_accuracy"] for x in ev], **style)
    axes[1].plot([x["wall_time"] for x in ev], [100 * x["test_accuracy"] for x in ev], **style)
  axes[0].set(xlabel="epochs", ylabel="test accuracy (%)", title="at equal epochs")
  axes[1].set(xlabel="wall time (s, all stages on one device)", ylabel="test accuracy (%)",
              title="at equal wall time")
  for ax in axes:
    ax.grid(alpha=0.3)
  axes[1].legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7)
  fig.suptitle(title)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


