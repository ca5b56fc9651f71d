"""Small-scale reproductions of paper Table 4 and Fig. 4 on the real CIFAR-10.

Commands::

  python -m petra_jax.studies table4 [--width=8] [--epochs=1] [--out=docs]
  python -m petra_jax.studies ksweep [--ks=1,2,4,8] [--width=8] [--epochs=1] [--out=docs]
  python -m petra_jax.studies compensation [--stages=10,4] [--compensations=none,spike,...]
  python -m petra_jax.studies local [--stages=4,10] [--seeds=0] (petra_jax.study_local)
  python -m petra_jax.studies transformers [--rows=...] [--seeds=0,1] (petra_jax.study_transformers)

``table4`` trains Table 4's five rows (backprop, ``delayed``, ``dsp``, ``approximate_input``,
``petra``) with k = 1; ``ksweep`` trains ``petra`` with k in ``--ks`` against ``backprop``
(Fig. 4), the update's batch ``--batch-size`` split into k micro-batches. Each study writes
``OUT/<study>.md`` (table, command, machine, date, wall times) and ``OUT/<study>.png``, and
keeps each run's ``metrics.jsonl`` under ``--workdir``. The paper's Table 4 is CIFAR-100 at
width 64 for 300 epochs: compare the ordering of the rows, not the numbers.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
from typing import Sequence

from petra_jax import config as config_lib
from petra_jax import data as data_lib
from petra_jax.engine import methods as methods_lib
from petra_jax.training import validation
from petra_jax.training import metrics as metrics_lib
from petra_jax import train
import jax
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

# Paper Table 4 (CIFAR-100, RevNet18, k = 1): method -> accuracy (%).
TABLE4_PAPER_ACCURACY = {"backprop": 77.5, "delayed": 76.5, "dsp": 76.4,
                         "approximate_input": 75.4, "petra": 75.9}


def _yes(flag: bool) -> str:
  return "yes" if flag else "no"


def table4_columns(method: str) -> tuple[str, str, str]:
  """Table 4's ``(delayed, input buffer, param. buffer)`` of ``method``."""
  m = methods_lib.get(method)
  if not m.pipelined:
    return "no", "-", "-"
  keeps = methods_lib.keeps(m, reversible=True)
  return _yes(m.delayed), _yes(keeps.input), _yes(keeps.weights)


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


def _machine() -> str:
  d = jax.devices()[0]
  return (f"{platform.machine()} {os.cpu_count()}-core {d.platform.upper()} "
          f"({d.device_kind}), jax {jax.__version__}, {platform.python_version()}")


def _plot(rows: Sequence[dict], path: str, title: str):
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


def _setting(args, seeds) -> str:
  """The RevNet18 studies' recipe in one sentence."""
  return (f"Model: RevNet18 width {args.width}, batch {args.batch_size} images per update, "
          f"{args.epochs} epoch(s), SGD-Nesterov lr {args.learning_rate} with "
          f"{args.warmup_epochs} warm-up epoch(s) then cosine, wd 5e-4, "
          f"seed(s) {', '.join(map(str, seeds))}.")


def _write(args, study: str, header: str, table: list[str], rows, notes: str):
  """Writes ``OUT/<study>.md`` and ``OUT/<study>.png``."""
  os.makedirs(args.out, exist_ok=True)
  png = os.path.join(args.out, f"{study}.png")
  _plot(rows, png, header)
  seeds = sorted({r.get("seed", args.seed) for r in rows}) if rows else [args.seed]
  setting = "" if args.study == "transformers" else _setting(args, seeds)
  lines = [f"# {header}", "", "Command:", "", "```",
           "python -m petra_jax.studies " + " ".join(args.argv), "```", "",
           f"Machine: {_machine()}. Date: {datetime.date.today().isoformat()}. {setting}", "",
           *table, "", notes, "", f"![{study}]({study}.png)", ""]
  path = os.path.join(args.out, f"{study}.md")
  with open(path, "w", encoding="utf-8") as f:
    f.write("\n".join(lines))
  print(f"wrote {path} and {png}")


def table4(args):
  """Paper Table 4's five rows with k = 1."""
  rows = [run(args, m, m, 1) for m in TABLE4_PAPER_ACCURACY]
  table = ["| method | delayed | input buffer | param. buffer | test acc. (%) | final train "
           "loss | wall (s) | paper (CIFAR-100, %) |", "|---|---|---|---|---|---|---|---|"]
  for r in rows:
    (delayed, inp, par), paper = table4_columns(r["method"]), TABLE4_PAPER_ACCURACY[r["method"]]
    table.append(f"| `{r['method']}` | {delayed} | {inp} | {par} | "
                 f"{100 * r['test_accuracy']:.1f} | {r['final_train_loss']:.3f} | "
                 f"{r['wall_time']:.0f} | {paper} |")
  _write(args, "table4", "Table 4 at small scale: gradient approximations, k = 1", table, rows,
         "`backprop` is exact (no delay); the other rows run the pipeline with "
         "delays tau_j = 2(J-1-j) ticks over J = 10 stages.")


def ksweep(args):
  """PETRA with k accumulation steps against backprop (paper Fig. 4)."""
  rows = [run(args, "backprop", "backprop", 1)]
  rows += [run(args, f"petra_k{k}", "petra", k) for k in args.ks]
  table = ["| run | k | micro-batch | test acc. (%) | final train loss | wall (s) |",
           "|---|---|---|---|---|---|"]
  for r in rows:
    table.append(f"| `{r['name']}` | {r['k']} | {args.batch_size // r['k']} | "
                 f"{100 * r['test_accuracy']:.1f} | {r['final_train_loss']:.3f} | "
                 f"{r['wall_time']:.0f} |")
  _write(args, "ksweep", "Fig. 4 at small scale: PETRA with k accumulation steps", table,
         rows, "Every run updates on the same batch of images; k splits it into "
         "micro-batches, so the delay in updates of stage j is about tau_j / k.")


STAGE_SPLITS = {10: (), 5: (1, 2, 2, 2, 3), 4: (1, 2, 2, 5)}  # RevNet18's 10 blocks


def _at_wall_time(records: Sequence[dict], seconds: float) -> float:
  """Test accuracy of the last evaluation at or before ``seconds`` (NaN if none)."""
  done = [r["test_accuracy"] for r in records
          if "test_accuracy" in r and r["wall_time"] <= seconds + 1e-9]
  return done[-1] if done else float("nan")


def _mean_reconstruction_error(records: Sequence[dict]) -> float:
  """Mean of every ``reconstruction_error/stage_j`` logged (NaN if none)."""
  errs = [v for r in records for key, v in r.items() if key.startswith("reconstruction_error/")]
  return sum(errs) / len(errs) if errs else float("nan")


def _plot_accuracy(rows: Sequence[dict], path: str, title: str):
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


def compensation_study(args):
  """Per k: ``backprop``, then ``petra`` per stage count with each of ``--compensations``.

  Table: test accuracy at equal epochs, and backprop's at the row's wall time (one device).
  """
  rows = []
  for k in args.ks:
    base = run(args, f"backprop_k{k}", "backprop", k)
    rows.append(dict(base, stages=1, compensation="-", gap=0.0, backprop_same_time=float("nan")))
    for J in args.stages:
      for comp in args.compensations:
        r = run(args, f"petra_J{J}_k{k}_{comp}", "petra", k,
                **{"model.stage_sizes": STAGE_SPLITS[J], "compensation.name": comp})
        rows.append(dict(r, stages=J, compensation=comp,
                         gap=100 * (base["test_accuracy"] - r["test_accuracy"]),
                         backprop_same_time=_at_wall_time(base["records"], r["wall_time"])))
  table = ["| run | stages J | k | compensation | test acc. (%) | gap to backprop, same epochs "
           "(points) | backprop at the same wall time (%) | wall (s) | mean rel. "
           "reconstruction error |", "|---|---|---|---|---|---|---|---|---|"]
  for r in rows:
    table.append(f"| `{r['name']}` | {r['stages']} | {r['k']} | {r['compensation']} | "
                 f"{100 * r['test_accuracy']:.1f} | {r['gap']:+.1f} | "
                 f"{100 * r['backprop_same_time']:.1f} | {r['wall_time']:.0f} | "
                 f"{_mean_reconstruction_error(r['records']):.2e} |")
  os.makedirs(args.out, exist_ok=True)
  _write(args, "compensation", "Delay compensation for PETRA against backprop", table, rows,
         "One seed: differences of about 1 point are within run-to-run noise. Gap = backprop "
         "minus the row at the same number of epochs (positive: the row is worse).")
  _plot_accuracy(rows, os.path.join(args.out, "compensation_accuracy.png"),
                 "PETRA with delay compensation: test accuracy")


def _local(args):
  """Forward gradients and DGL beside PETRA (:mod:`petra_jax.study_local`)."""
  from petra_jax import study_local  # pylint: disable=g-import-not-at-top
  study_local.local_study(args, run, _write, _plot_accuracy, _at_wall_time, STAGE_SPLITS)


def _transformers(args):
  """PETRA on the RevViT recipe with delay-robust optimizers (:mod:`petra_jax.study_transformers`)."""
  from petra_jax import study_transformers  # pylint: disable=g-import-not-at-top
  study_transformers.transformers_study(args, _write, _plot_accuracy, _at_wall_time)


def main(argv: Sequence[str] | None = None) -> int:
  p = argparse.ArgumentParser(prog="python -m petra_jax.studies", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("study", choices=("table4", "ksweep", "compensation", "local", "transformers"))
  p.add_argument("--width", type=int, default=8)
  p.add_argument("--epochs", type=int, default=None, help="default 1; transformers: 6")
  p.add_argument("--steps-per-epoch", type=int, default=0, help="0 = the full split")
  p.add_argument("--batch-size", type=int, default=128, help="images per update")
  p.add_argument("--learning-rate", type=float, default=0.05)
  p.add_argument("--warmup-epochs", type=float, default=0.5)
  p.add_argument("--ks", type=lambda s: [int(k) for k in s.split(",")], default=None,
                 help="micro-batches per update: ksweep and compensation (default 1,2,4,8), "
                 "local (the first; default 1)")
  p.add_argument("--stages", type=lambda s: [int(j) for j in s.split(",")], default=[10, 4],
                 help=f"compensation study: stage counts, of {sorted(STAGE_SPLITS)}")
  p.add_argument("--compensations", type=lambda s: s.split(","),
                 default=["none", "lr_scale", "spike", "weight_prediction", "nesterov_lookahead"],
                 help="compensation study: config.compensation.name values")
  p.add_argument("--compensation", default="none",
                 help="table4 / ksweep: compensation of the delayed methods")
  p.add_argument("--reconstruction-error-every", type=int, default=0,
                 help="updates between reconstruction-error probes (0: off)")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--seeds", type=lambda s: [int(x) for x in s.split(",")], default=[0],
                 help="local and transformers studies: seeds")
  p.add_argument("--rows", type=lambda s: [r for r in s.split(",") if r], default=None,
                 help="local and transformers studies: which rows, by name (default all; "
                 "ROWS of petra_jax.study_local / study_transformers)")
  p.add_argument("--recipe", default="configs/cifar10_vit_cpu.py",
                 help="transformers study: the recipe every row changes")
  p.add_argument("--log-every", type=int, default=10)
  p.add_argument("--data-dir", default="")
  p.add_argument("--workdir", default="", help="default: runs/<study>")
  p.add_argument("--out", default="docs")
  argv = sys.argv[1:] if argv is None else list(argv)
  args = p.parse_args(argv)
  args.argv = argv
  args.workdir = args.workdir or os.path.join("runs", args.study)
  if args.epochs is None:
    args.epochs = 6 if args.study == "transformers" else 1
  if args.ks is None:
    args.ks = [1] if args.study == "local" else [1, 2, 4, 8]
  try:
    {"table4": table4, "ksweep": ksweep, "compensation": compensation_study,
     "local": _local, "transformers": _transformers}[args.study](args)
  except (validation.ConfigError, data_lib.DataError, ValueError, KeyError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 1
  return 0


if __name__ == "__main__":
  sys.exit(main())
