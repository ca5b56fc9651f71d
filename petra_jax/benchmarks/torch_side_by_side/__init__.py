"""Side by side: PyTorch steps against ours, in one run on one machine.

``python -m petra_jax.benchmarks.torch_side_by_side [--model=revnet18] --petra-repo=PATH
--torch-python=PY [--batch-size=64] [--iters=5] [--threads=2] [--repeats=1] [--json]``

``PATH``: an export of stephane-rivaud/PETRA (imported, never copied), ``PY``: a Python with
torch that runs this file with ``--worker``. RevNet18 at width 64 on random CIFAR-10-shaped
float32 batches: the authors' PETRA and backprop steps against ours.

``--model=gpt_nano`` (no ``--petra-repo``; batch 12, 20 iterations by default): a plain
PyTorch decoder in nanoGPT's layout (:mod:`petra_jax.benchmarks.torch_side_by_side.gpt`, run by ``PY``) at ``gpt_nano``'s shapes
(width 32: 4 layers, 4 heads, 128 wide, context 64, vocabulary 65) against our backprop
step on ``gpt_nano`` and our PETRA tick on ``revgpt_nano`` in 4 stages, AdamW on random
int tokens ``[B, 64]``; ms, tokens per second, parameter counts (checked equal).

``R`` runs of ours each bracketed by runs of theirs, ratios per bracket and their medians.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import warnings
from typing import Callable


# ``python -m petra_jax.benchmarks.torch_side_by_side.PART`` imports this package, which imports its parts,
# before runpy runs the part (it then prints where its command lives); runpy's warning that the
# part is already imported says nothing to the user.
warnings.filterwarnings("ignore", message=r"'petra_jax\.benchmarks\.torch_side_by_side\.\w+' found in sys\.modules",
                        category=RuntimeWarning)


def _worker(repo: str, batch: int, iters: int, warmup: int, threads: int) -> dict:
  """Their steps' median ms, timed in this (torch) process."""
  sys.path.insert(0, repo)
  import torch  # noqa: PLC0415  (only the torch Python has it)
  from async_torch.models.utils import get_model  # noqa: PLC0415
  from async_torch.optim.optimizer import add_optimizer  # noqa: PLC0415
  from async_torch.sequential_layers import (  # noqa: PLC0415
      AsynchronousSequential, SynchronousSequential)
  torch.set_num_threads(threads)
  torch.manual_seed(0)
  x, y = torch.randn(batch, 3, 32, 32), torch.randint(0, 10, (batch,))
  sgd = {"lr": 1e-3, "momentum": 0.9, "dampening": 0.0, "nesterov": False,
         "maximize": False, "weight_decay": 5e-4}
  nets, calls = {}, {}
  for name, cls in (("backprop", SynchronousSequential), ("petra", AsynchronousSequential)):
    arch = get_model("cifar10", "revnet18", False)
    for layer in arch:
      add_optimizer(layer, "sgd", dict(sgd))
    nets[name], calls[name] = cls(arch).to("cpu", torch.float32), 0
  times = {k: [] for k in nets}

  def step(name):
    t = time.perf_counter()
    with torch.no_grad():
      nets[name].forward_and_update(x, y, calls[name])
    calls[name] += 1
    return 1e3 * (time.perf_counter() - t)

  for _ in range(2 * len(nets["petra"].modules)):  # fill their pipeline
    step("petra")
  for i in range(warmup + iters):
    for name in nets:
      ms = step(name)
      if i >= warmup:
        times[name].append(ms)
  return {"ms_per_step": {k: statistics.median(v) for k, v in times.items()},
          "torch": torch.__version__, "threads": threads}


def _revnet_command(args) -> list:
  """The torch command line of :func:`_worker` (the authors' RevNet18 steps)."""
  return [args.torch_python, os.path.abspath(__file__), "--worker",
          f"--petra-repo={args.petra_repo}", f"--batch-size={args.batch_size}",
          f"--iters={args.iters}", f"--warmup={args.warmup}", f"--threads={args.threads}"]


def _theirs(args) -> dict:
  """Runs the torch side under ``--torch-python``; its JSON result."""
  command, env = MODES[args.model].theirs(args)
  out = subprocess.run(command, capture_output=True, text=True, check=False, env=env)
  if out.returncode != 0:
    raise RuntimeError(f"the torch steps failed under {args.torch_python} (is torch "
                       f"installed there{MODES[args.model].hint}?):\n{out.stderr[-2000:]}")
  return json.loads(out.stdout.strip().splitlines()[-1])


def _ours(args) -> dict:
  """Our steps' median ms (backprop task, full PETRA tick) at width 64."""
  from petra_jax.benchmarks import cli, throughput  # noqa: PLC0415
  from petra_jax.engine.pipeline import Pipeline  # noqa: PLC0415
  import jax  # noqa: PLC0415
  import optax  # noqa: PLC0415
  stages = cli.build("revnet18", "cifar10", 64)
  tx, devices = optax.sgd(1e-3, momentum=0.9), jax.devices()[:1]
  pipes = {m: Pipeline(stages, tx, devices, method=m) for m in ("backprop", "petra")}
  images = jax.random.normal(jax.random.key(0), (args.batch_size, 32, 32, 3))
  labels = jax.numpy.arange(args.batch_size) % 10
  ms, _ = throughput.step_times(pipes, images, labels, args.iters, args.warmup)
  return {"ms_per_step": ms, "jax": jax.__version__}


# ratio: (numerator, denominator), each (side, method); a bracket has those whose runs it has
RATIO_TERMS = {
    "ratio_petra_ours_theirs": (("ours", "petra"), ("theirs", "petra")),
    "ratio_backprop_ours_theirs": (("ours", "backprop"), ("theirs", "backprop")),
    "ratio_petra_backprop_ours": (("ours", "petra"), ("ours", "backprop")),
    "ratio_petra_backprop_theirs": (("theirs", "petra"), ("theirs", "backprop")),
}
RATIOS = tuple(RATIO_TERMS)


def compare(theirs_before: dict, ours: dict, theirs_after: dict) -> dict:
  """Ratios ours/theirs per method (theirs: the mean of the two runs) and petra/backprop,
  for the methods both runs of theirs and ours time (``gpt_nano``: theirs backprop only)."""
  ms = {"ours": ours["ms_per_step"],
        "theirs": {k: (v + theirs_after["ms_per_step"][k]) / 2
                   for k, v in theirs_before["ms_per_step"].items()}}
  return {name: ms[a][m] / ms[b][n] for name, ((a, m), (b, n)) in RATIO_TERMS.items()
          if m in ms[a] and n in ms[b]}


def brackets(theirs: list, ours: list) -> list:
  """Per bracket (a run of ours between two of theirs), its runs and :func:`compare`'s ratios.

  Raises:
    ValueError: ``len(theirs) != len(ours) + 1``.
  """
  if len(theirs) != len(ours) + 1:
    raise ValueError(f"{len(ours)} runs of ours need {len(ours) + 1} of theirs, "
                     f"not {len(theirs)}.")
  return [{"theirs_before": b, "ours": o, "theirs_after": a, **compare(b, o, a)}
          for b, o, a in zip(theirs, ours, theirs[1:])]


def summary(rows: list) -> dict:
  """The median of each ratio (those the brackets have) over the brackets of :func:`brackets`."""
  return {k: statistics.median(r[k] for r in rows) for k in RATIOS if k in rows[0]}


# gpt_nano: our backprop model, our PETRA model grouped as configs/shakespeare_cpu.py, the data
GPT_MODELS = {"backprop": "gpt_nano", "petra": "revgpt_nano"}
GPT_WIDTH, GPT_STAGE_SIZES, GPT_DATASET = 32, (3, 2, 2, 3), "tiny_shakespeare"
GPT_OPTIMIZER = {"learning_rate": 1e-3, "b1": 0.9, "b2": 0.99, "weight_decay": 0.1}


def gpt_shapes() -> dict:
  """``gpt_nano``'s shapes at :data:`GPT_WIDTH`: ``layers, heads, dim, context, vocab``."""
  from petra_jax.data import DATASETS  # noqa: PLC0415
  from petra_jax.models import MODEL_SPECS  # noqa: PLC0415
  spec, data = MODEL_SPECS[GPT_MODELS["backprop"]], DATASETS[GPT_DATASET]
  return {"layers": spec.blocks_per_group[0], "heads": spec.heads, "dim": spec.heads * GPT_WIDTH,
          "context": data.image_shape[0], "vocab": data.num_classes}


def gpt_params() -> dict:
  """Trainable parameters of our two models: ``{"backprop": int, "petra": int}``."""
  from petra_jax.models.summary import summarize  # noqa: PLC0415
  return {m: summarize(name, GPT_DATASET, GPT_WIDTH)["total_params"]
          for m, name in GPT_MODELS.items()}


def _gpt_command(args) -> tuple:
  """``(command, env)`` of :mod:`.gpt` at :func:`gpt_shapes`; idle OpenMP threads sleep
  (``OMP_WAIT_POLICY=PASSIVE`` unless set): spinning ones stall on a shared, loaded CPU."""
  from petra_jax.benchmarks.torch_side_by_side import gpt as torch_gpt  # noqa: PLC0415  (no torch at import)
  flags = {**gpt_shapes(), "batch-size": args.batch_size, "iters": args.iters,
           "warmup": args.warmup, "threads": args.threads}
  env = {"OMP_WAIT_POLICY": "PASSIVE", **os.environ}
  return ([args.torch_python, torch_gpt.__file__, *(f"--{k}={v}" for k, v in flags.items())],
          env)


def _gpt_pipelines() -> dict:
  """``{"backprop": gpt_nano, "petra": revgpt_nano in 4 stages}`` on one device, AdamW."""
  from petra_jax.benchmarks import cli  # noqa: PLC0415
  from petra_jax.engine.stages import objective
  from petra_jax.engine.stages import partition  # noqa: PLC0415
  from petra_jax.engine.pipeline import Pipeline  # noqa: PLC0415
  import jax  # noqa: PLC0415
  import optax  # noqa: PLC0415
  stages = {m: cli.build(name, GPT_DATASET, GPT_WIDTH) for m, name in GPT_MODELS.items()}
  stages["petra"] = partition.group_stages(stages["petra"], GPT_STAGE_SIZES)
  tx = optax.adamw(**GPT_OPTIMIZER)
  return {m: Pipeline(s, tx, jax.devices()[:1], method=m, objective=objective.NEXT_TOKEN)
          for m, s in stages.items()}


def _ours_gpt(args) -> dict:
  """Our steps' median ms on random tokens ``int32[B, T]``: backprop, a full PETRA tick."""
  from petra_jax.benchmarks import throughput  # noqa: PLC0415
  import jax  # noqa: PLC0415
  shapes = gpt_shapes()
  tokens = jax.random.randint(jax.random.key(0), (args.batch_size, shapes["context"] + 1), 0,
                              shapes["vocab"])
  ms, _ = throughput.step_times(_gpt_pipelines(), tokens[:, :-1], tokens[:, 1:], args.iters,
                                args.warmup)
  return {"ms_per_step": ms, "jax": jax.__version__}


def run_medians(theirs: list, ours: list) -> dict:
  """``{"theirs_backprop": ms, "ours_backprop": ms, ...}``: each side's median over its runs."""
  return {f"{side}_{m}": statistics.median(r["ms_per_step"][m] for r in runs)
          for side, runs in (("theirs", theirs), ("ours", ours))
          for m in runs[0]["ms_per_step"]}


def tokens_per_second(ms_per_step: dict, tokens_per_step: int) -> dict:
  """``1000 tokens_per_step / ms`` of each entry of ``ms_per_step``."""
  return {k: 1e3 * tokens_per_step / ms for k, ms in ms_per_step.items()}


def _gpt_report(args, theirs: list, ours: list) -> dict:
  """Shapes, ms and tokens per second, parameter counts, versions; SystemExit if the torch
  model's parameter count is not our ``gpt_nano``'s."""
  params, shapes = gpt_params(), gpt_shapes()
  if theirs[0]["params"] != params["backprop"]:
    raise SystemExit(f"the torch decoder has {theirs[0]['params']} parameters, our gpt_nano "
                     f"{params['backprop']}: torch_gpt.py no longer matches models/gpt.py.")
  ms = run_medians(theirs, ours)
  return {"model": GPT_MODELS["backprop"], **shapes, "ms_per_step": ms,
          "tokens_per_step": args.batch_size * shapes["context"],
          "tokens_per_second": tokens_per_second(ms, args.batch_size * shapes["context"]),
          "params": {"theirs_backprop": theirs[0]["params"], "ours_backprop": params["backprop"],
                     "ours_petra": params["petra"]},
          "torch": theirs[0]["torch"], "jax": ours[0]["jax"], "threads": args.threads,
          "omp_wait_policy": _gpt_command(args)[1]["OMP_WAIT_POLICY"]}


def _check_revnet(args) -> None:
  """SystemExit unless ``--petra-repo`` is an export of the authors' code."""
  if not args.petra_repo:
    raise SystemExit("--petra-repo is required with --model=revnet18: an export of "
                     "stephane-rivaud/PETRA (git archive HEAD | tar -x -C PATH).")
  if not os.path.isdir(os.path.join(args.petra_repo, "async_torch")):
    raise SystemExit(f"--petra-repo={args.petra_repo!r} has no async_torch/: give an export "
                     "of stephane-rivaud/PETRA (git archive HEAD | tar -x -C PATH).")


@dataclasses.dataclass(frozen=True)
class Mode:
  """One ``--model``: its defaults, input check, torch command, our side, report entries."""
  batch_size: int
  iters: int
  check: Callable      # args -> None, or SystemExit
  theirs: Callable     # args -> (command, env or None)
  ours: Callable       # args -> {"ms_per_step": {...}, "jax": str}
  report: Callable     # (args, theirs runs, ours runs) -> extra report entries
  hint: str            # what else the torch side needs, for its error


MODES = {
    "revnet18": Mode(64, 5, _check_revnet, lambda a: (_revnet_command(a), None), _ours,
                     lambda a, t, o: {}, ", and --petra-repo an export of stephane-rivaud/PETRA"),
    "gpt_nano": Mode(12, 20, lambda a: None, _gpt_command, _ours_gpt, _gpt_report, ""),
}


def _parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog="python -m petra_jax.benchmarks.torch_side_by_side",
                              description=__doc__.splitlines()[0])
  p.add_argument("--model", choices=sorted(MODES), default="revnet18",
                 help="revnet18: the authors' PETRA code; gpt_nano: a plain torch decoder")
  p.add_argument("--petra-repo", default=None,
                 help="export of stephane-rivaud/PETRA (--model=revnet18 only)")
  p.add_argument("--torch-python", default=None, help="a Python with torch (not for --worker)")
  p.add_argument("--batch-size", type=int, default=None,
                 help="micro-batch size (revnet18: 64, gpt_nano: 12)")
  p.add_argument("--iters", type=int, default=None,
                 help="measured rounds per side (revnet18: 5, gpt_nano: 20)")
  p.add_argument("--warmup", type=int, default=1, help="unmeasured rounds first")
  p.add_argument("--threads", type=int, default=2, help="torch threads")
  p.add_argument("--repeats", type=int, default=1,
                 help="brackets: runs of ours, each between two of theirs")
  p.add_argument("--json", action="store_true", help="print JSON")
  p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
  return p


def parse_args(argv=None) -> argparse.Namespace:
  """The flags, ``--batch-size`` and ``--iters`` defaulting to ``--model``'s."""
  args = _parser().parse_args(argv)
  mode = MODES[args.model]
  args.batch_size = mode.batch_size if args.batch_size is None else args.batch_size
  args.iters = mode.iters if args.iters is None else args.iters
  return args


def main(argv=None) -> int:
  """``python -m petra_jax.benchmarks.torch_side_by_side``."""
  args = parse_args(argv)
  if args.worker:
    print(json.dumps(_worker(args.petra_repo, args.batch_size, args.iters, args.warmup,
                             args.threads)))
    return 0
  mode = MODES[args.model]
  mode.check(args)
  if not args.torch_python:
    raise SystemExit("--torch-python is required: a Python interpreter with torch installed.")
  if args.repeats < 1:
    raise SystemExit(f"--repeats={args.repeats}: give at least 1.")
  theirs, ours = [_theirs(args)], []
  for _ in range(args.repeats):
    ours.append(mode.ours(args))
    theirs.append(_theirs(args))
  rows = brackets(theirs, ours)
  report = {**summary(rows), "brackets": rows, "batch_size": args.batch_size,
            **mode.report(args, theirs, ours),
            "machine": f"{platform.machine()}, {os.cpu_count()} cores",
            "date": time.strftime("%Y-%m-%d")}
  if args.json:
    print(json.dumps(report))
  else:
    for k, v in report.items():
      print(f"{k}: {v}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
