"""Two commits' step times side by side, alternating on the same CPU.

``python -m petra_jax.benchmarks.commits OLD NEW [--pairs=2] [--model=revnet18 --width=64
--batch-size=64 --iters=5]`` exports both commits of this repository (``git archive``) to
temporary directories and runs ``python -m petra_jax.benchmarks.throughput --json`` from each in
turn, ``--pairs`` times, so that a drift of the machine's speed affects both: OLD first in the
odd pairs, NEW first in the even ones (a run that gains from going first or second, its caches
warm, gains as often for each). It prints each run's ms per step of ``backprop``, ``revprop``
and ``petra`` and the change of NEW's median against OLD's; run it before a refactor lands.
OLD and NEW may be one commit (an A/A sitting: the machine's noise); the second is then named
``NEW@2``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from typing import Optional, Sequence

METHODS = ("backprop", "revprop", "petra")


def export(commit: str, repo: str, into: str) -> str:
  """``commit``'s tree of ``repo`` extracted under ``into``; its path.

  Raises:
    subprocess.CalledProcessError: an unknown commit.
  """
  path = os.path.join(into, commit.replace("/", "_"))
  os.makedirs(path)
  archive = subprocess.run(["git", "-C", repo, "archive", commit], check=True,
                           capture_output=True).stdout
  subprocess.run(["tar", "-x", "-C", path], input=archive, check=True)
  return path


def step_ms(tree: str, throughput_args: Sequence[str]) -> dict:
  """``{method: ms per step}`` of one throughput run from the code in ``tree``."""
  env = dict(os.environ, PYTHONPATH=tree)
  out = subprocess.run([sys.executable, "-m", "petra_jax.benchmarks.throughput", "--json",
                        *throughput_args], cwd=tree, env=env, check=True,
                       capture_output=True, text=True).stdout
  report = json.loads(out.strip().splitlines()[-1])
  return {m: report["ms_per_step"][m] for m in METHODS}


def order(labels: Sequence[str], pairs: int) -> list[str]:
  """The runs' labels in the order they run: ``labels`` in turn for pair 1, reversed for pair
  2, and so on (``order(["a", "b"], 3)`` is ``a b b a a b``)."""
  return [c for i in range(pairs) for c in (labels if i % 2 == 0 else labels[::-1])]


def labels(old: str, new: str) -> tuple[str, str]:
  """The two runs' names: the commits, the second ``NEW@2`` when both are one commit."""
  return (old, new if new != old else f"{new}@2")


def compare(runs: dict) -> list[dict]:
  """Per method: each commit's runs (ms) and NEW's median change against OLD's (%)."""
  (old, a), (new, b) = runs.items()
  rows = []
  for m in METHODS:
    x, y = [r[m] for r in a], [r[m] for r in b]
    rows.append({"method": m, old: x, new: y,
                 "change_pct": 100.0 * (statistics.median(y) / statistics.median(x) - 1.0)})
  return rows


def main(argv: Optional[Sequence[str]] = None) -> int:
  """``python -m petra_jax.benchmarks.commits``."""
  p = argparse.ArgumentParser("petra_jax.benchmarks.commits", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("old")
  p.add_argument("new")
  p.add_argument("--pairs", type=int, default=2, help="OLD, NEW alternations")
  p.add_argument("--repo", default=".", help="the git repository holding both commits")
  args, throughput_args = p.parse_known_args(argv)
  throughput_args = throughput_args or ["--model=revnet18", "--dataset=cifar10",
                                        "--batch-size=64", "--width=64", "--iters=5"]
  old, new = labels(args.old, args.new)
  with tempfile.TemporaryDirectory() as tmp:
    trees = {old: export(args.old, args.repo, os.path.join(tmp, "old")),
             new: export(args.new, args.repo, os.path.join(tmp, "new"))}
    runs = {c: [] for c in trees}
    for c in order([old, new], args.pairs):
      runs[c].append(step_ms(trees[c], throughput_args))
      print(f"{c}: " + ", ".join(f"{m} {v:.0f} ms" for m, v in runs[c][-1].items()),
            flush=True)
  for r in compare(runs):
    print(f"{r['method']:<9} {old}: {r[old]}  {new}: {r[new]}  "
          f"median change {r['change_pct']:+.1f} %")
  return 0


if __name__ == "__main__":
  sys.exit(main())
