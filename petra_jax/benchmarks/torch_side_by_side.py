"""Side by side: the authors' PyTorch PETRA and backprop steps against ours.

``python -m petra_jax.benchmarks.torch_side_by_side --petra-repo=PATH --torch-python=PY
[--batch-size=64] [--iters=5] [--threads=2] [--repeats=1] [--json]``

``PATH``: an export of stephane-rivaud/PETRA (imported, never copied), ``PY``: a Python with
torch that runs this file with ``--worker``. RevNet18 at width 64 on random CIFAR-10-shaped
float32 batches; ``R`` runs of ours each bracketed by runs of theirs, ratios per bracket and
their medians.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time


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


def _theirs(args) -> dict:
  """Runs :func:`_worker` under ``--torch-python``; its JSON result."""
  cmd = [args.torch_python, os.path.abspath(__file__), "--worker",
         f"--petra-repo={args.petra_repo}", f"--batch-size={args.batch_size}",
         f"--iters={args.iters}", f"--warmup={args.warmup}", f"--threads={args.threads}"]
  out = subprocess.run(cmd, capture_output=True, text=True, check=False)
  if out.returncode != 0:
    raise RuntimeError(f"the authors' steps failed under {args.torch_python} (is torch "
                       f"installed there, and --petra-repo an export of "
                       f"stephane-rivaud/PETRA?):\n{out.stderr[-2000:]}")
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


RATIOS = ("ratio_petra_ours_theirs", "ratio_backprop_ours_theirs",
          "ratio_petra_backprop_ours", "ratio_petra_backprop_theirs")


def compare(theirs_before: dict, ours: dict, theirs_after: dict) -> dict:
  """Ratios ours/theirs per method (theirs: the mean of the two runs) and petra/backprop."""
  mean = {k: (theirs_before["ms_per_step"][k] + theirs_after["ms_per_step"][k]) / 2
          for k in ("backprop", "petra")}
  o = ours["ms_per_step"]
  return dict(zip(RATIOS, (o["petra"] / mean["petra"], o["backprop"] / mean["backprop"],
                           o["petra"] / o["backprop"], mean["petra"] / mean["backprop"])))


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
  """The median of each ratio over the brackets of :func:`brackets`."""
  return {k: statistics.median(r[k] for r in rows) for k in RATIOS}


def _parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog="python -m petra_jax.benchmarks.torch_side_by_side",
                              description=__doc__.splitlines()[0])
  p.add_argument("--petra-repo", required=True, help="export of stephane-rivaud/PETRA")
  p.add_argument("--torch-python", default=None, help="a Python with torch (not for --worker)")
  p.add_argument("--batch-size", type=int, default=64, help="micro-batch size")
  p.add_argument("--iters", type=int, default=5, help="measured rounds per side")
  p.add_argument("--warmup", type=int, default=1, help="unmeasured rounds first")
  p.add_argument("--threads", type=int, default=2, help="torch threads")
  p.add_argument("--repeats", type=int, default=1,
                 help="brackets: runs of ours, each between two of theirs")
  p.add_argument("--json", action="store_true", help="print JSON")
  p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
  return p


def main(argv=None) -> int:
  """``python -m petra_jax.benchmarks.torch_side_by_side``."""
  args = _parser().parse_args(argv)
  if args.worker:
    print(json.dumps(_worker(args.petra_repo, args.batch_size, args.iters, args.warmup,
                             args.threads)))
    return 0
  if not os.path.isdir(os.path.join(args.petra_repo, "async_torch")):
    raise SystemExit(f"--petra-repo={args.petra_repo!r} has no async_torch/: give an export "
                     "of stephane-rivaud/PETRA (git archive HEAD | tar -x -C PATH).")
  if not args.torch_python:
    raise SystemExit("--torch-python is required: a Python interpreter with torch installed.")
  if args.repeats < 1:
    raise SystemExit(f"--repeats={args.repeats}: give at least 1.")
  theirs, ours = [_theirs(args)], []
  for _ in range(args.repeats):
    ours.append(_ours(args))
    theirs.append(_theirs(args))
  rows = brackets(theirs, ours)
  report = {**summary(rows), "brackets": rows, "batch_size": args.batch_size,
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
