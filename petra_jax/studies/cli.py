"""``python -m petra_jax.studies NAME``: the command line of every study.

Commands::

  python -m petra_jax.studies table4 [--width=8] [--epochs=1]
  python -m petra_jax.studies ksweep [--ks=1,2,4,8] [--width=8] [--epochs=1]
  python -m petra_jax.studies compensation [--stages=10,4] [--compensations=none,spike,...]
  python -m petra_jax.studies local [--stages=4,10] [--seeds=0]
  python -m petra_jax.studies transformers [--rows=...] [--seeds=0,1]
  python -m petra_jax.studies depth [--rows=...] [--seeds=0,1,2] [--finished-only]
  python -m petra_jax.studies language_model [--rows=...] [--seeds=0,1]

Each study is one module of :mod:`petra_jax.studies` (see :data:`STUDIES`). It writes its page
(``<study>.md``, table, command, machine, date) and plots into ``--out``, by default the run
directory ``runs/studies/<study>``: a study never writes into ``docs/`` unless asked
(``--out=docs``). Runs keep their ``metrics.jsonl`` under ``--workdir`` (default
``runs/<study>``).
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from petra_jax import data as data_lib
from petra_jax.studies import common
from petra_jax.training import validation

# study -> (module of petra_jax.studies, its entry point taking the parsed arguments).
STUDIES = {"table4": ("table4", "table4"), "ksweep": ("ksweep", "ksweep"),
           "compensation": ("compensation", "compensation_study"),
           "local": ("local", "local_study"), "transformers": ("transformers", "transformers_study"),
           "depth": ("depth", "depth_study"),
           "language_model": ("language_model", "language_model_study")}
_EPOCHS = {"transformers": 6, "depth": 6, "language_model": 0}  # the others: 1; 0: the recipe's
_RECIPES = {"language_model": "configs/shakespeare_cpu.py"}  # the others: the RevViT recipe


def _ints(text: str) -> list[int]:
  return [int(x) for x in text.split(",") if x]


def parser() -> argparse.ArgumentParser:
  """Every study's options, each with its help."""
  p = argparse.ArgumentParser(prog="python -m petra_jax.studies", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("study", choices=tuple(STUDIES), help="which study to run")
  p.add_argument("--width", type=int, default=8, help="RevNet18 studies: channels of stage 0")
  p.add_argument("--epochs", type=int, default=None,
                 help="epochs per run (default 1; transformers and depth: 6; language_model: "
                 "the recipe's)")
  p.add_argument("--steps-per-epoch", type=int, default=0, help="0 = the full split")
  p.add_argument("--batch-size", type=int, default=128, help="RevNet18 studies: images per update")
  p.add_argument("--learning-rate", type=float, default=0.05,
                 help="RevNet18 studies: SGD learning rate")
  p.add_argument("--warmup-epochs", type=float, default=0.5,
                 help="RevNet18 studies: linear warm-up before the cosine decay")
  p.add_argument("--ks", type=_ints, default=None,
                 help="micro-batches per update: ksweep and compensation (default 1,2,4,8), "
                 "local (the first; default 1)")
  p.add_argument("--stages", type=_ints, default=[10, 4],
                 help=f"compensation and local studies: stage counts, of "
                 f"{sorted(common.STAGE_SPLITS)}")
  p.add_argument("--compensations", type=lambda s: s.split(","),
                 default=["none", "lr_scale", "spike", "weight_prediction", "nesterov_lookahead"],
                 help="compensation study: config.compensation.name values")
  p.add_argument("--compensation", default="none",
                 help="table4 / ksweep: compensation of the delayed methods")
  p.add_argument("--reconstruction-error-every", type=int, default=0,
                 help="updates between reconstruction-error probes (0: off)")
  p.add_argument("--seed", type=int, default=0, help="RevNet18 studies: the seed")
  p.add_argument("--seeds", type=_ints, default=[0],
                 help="local, transformers and depth studies: seeds")
  p.add_argument("--rows", type=lambda s: [r for r in s.split(",") if r], default=None,
                 help="local, transformers and depth studies: which rows, by name (default "
                 "all; depth: its REFERENCES; ROWS of the study's module)")
  p.add_argument("--recipe", default="",
                 help="transformers, depth and language_model studies: the recipe every row "
                 "changes (default configs/cifar10_vit_cpu.py; language_model: "
                 "configs/shakespeare_cpu.py)")
  p.add_argument("--log-every", type=int, default=10, help="updates between loss records")
  p.add_argument("--data-dir", default="", help="TFDS data directory (default: the config's)")
  p.add_argument("--workdir", default="", help="where runs live (default: runs/<study>)")
  p.add_argument("--finished-only", action="store_true",
                 help="depth study: train and measure nothing; the page from the (row, seed) runs "
                 "already finished under --workdir (the others skipped) and the stage costs "
                 "stored there")
  p.add_argument("--reference", default="revprop",
                 help="language_model study: the row every gap is to (default revprop; a "
                 "re-tuned one: revprop_<probe>)")
  p.add_argument("--stage-iters", type=int, default=7,
                 help="depth study: timed calls per stage cost (their median is kept)")
  p.add_argument("--out", default="",
                 help="where the page and plots go (default: runs/studies/<study>; "
                 "--out=docs to update the committed docs)")
  return p


def _study_modules() -> dict:
  """``{module name: module}`` of :data:`STUDIES` (imported on a run: they import matplotlib)."""
  from petra_jax.studies import (compensation, depth, ksweep, language_model, local,  # noqa: PLC0415
                                 table4, transformers)
  return {m.__name__.rpartition(".")[2]: m
          for m in (table4, ksweep, compensation, local, transformers, depth, language_model)}


def main(argv: Sequence[str] | None = None) -> int:
  """Parses ``argv``, runs the study; 0 on success, 1 with one line on bad input."""
  argv = sys.argv[1:] if argv is None else list(argv)
  args = parser().parse_args(argv)
  args.argv = argv
  args.workdir = args.workdir or f"runs/{args.study}"
  args.out = common.output_dir(args.study, args.out)
  args.recipe = args.recipe or _RECIPES.get(args.study, "configs/cifar10_vit_cpu.py")
  if args.epochs is None:
    args.epochs = _EPOCHS.get(args.study, 1)
  if args.ks is None:
    args.ks = [1] if args.study == "local" else [1, 2, 4, 8]
  module, function = STUDIES[args.study]
  try:
    study = getattr(_study_modules()[module], function)
    study(args)
  except (validation.ConfigError, data_lib.DataError, ValueError, KeyError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 1
  return 0
