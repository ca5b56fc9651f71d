"""The scaling benchmark's processes: core pinning, child runs, medians over repeats."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from typing import Sequence

import jax

EIGEN_FLAG = "--xla_cpu_multi_thread_eigen=false"
RESULT = "RESULT "  # a child's report line: RESULT <json>
_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))))


def pin_to_cores(cores: Sequence[int]) -> list[int]:
  """Pins this process's threads to ``cores`` (before JAX starts); returns them, sorted.

  Raises:
    OSError: a core this process may not use.
  """
  cores = sorted(set(cores))
  for tid in os.listdir("/proc/self/task"):  # threads already started (e.g. BLAS)
    try:
      os.sched_setaffinity(int(tid), cores)
    except ProcessLookupError:  # a thread that has just ended
      pass
  return cores


def available_cores() -> list[int]:
  """The cores this process may run on, sorted."""
  return sorted(os.sched_getaffinity(0))


def child_args(args) -> list[str]:
  """The measurement flags, as given, for a child process."""
  return [f"--processes={args.processes}", f"--model={args.model}", f"--width={args.width}",
          f"--depth={args.depth}", f"--dataset={args.dataset}",
          f"--stage-sizes={args.stage_sizes}", f"--batch-size={args.batch_size}",
          f"--rounds={args.rounds}", f"--iters={args.iters}", f"--warmup={args.warmup}"] + (
              [f"--image-size={args.image_size}"] if args.image_size else [])


def run_child(cmd: list[str], env: dict, timeout_s: float) -> dict:
  """The JSON after ``cmd``'s one ``RESULT`` line; RuntimeError with the output's tail if none."""
  proc = subprocess.run(cmd, cwd=_REPO, env=env, stdout=subprocess.PIPE,
                        stderr=subprocess.STDOUT, text=True, timeout=timeout_s, check=False)
  lines = [l for l in proc.stdout.splitlines() if RESULT in l]
  if proc.returncode or len(lines) != 1:
    raise RuntimeError(f"{' '.join(cmd[:4])} ... failed (status {proc.returncode}):\n"
                       f"{proc.stdout[-3000:]}")
  return json.loads(lines[0].split(RESULT, 1)[1])


def child_env() -> dict:
  """This environment for CPU children that import this checkout."""
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
  env["PYTHONPATH"] = os.pathsep.join(p for p in (_REPO, env.get("PYTHONPATH")) if p)
  env.setdefault("XLA_FLAGS", "")
  for k in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
    env.pop(k, None)
  return env


def measure(args) -> tuple[dict, dict]:
  """``(single, multi)`` results, run ``args.repeats`` times in alternation, medians. The
  children share one compilation cache: the caller's, or a temporary one removed after."""
  with tempfile.TemporaryDirectory(prefix="petra_jax_scaling_") as cache:
    env = child_env()
    env.setdefault("JAX_COMPILATION_CACHE_DIR", cache)
    return _alternate(args, env)


def _alternate(args, env: dict) -> tuple[dict, dict]:
  """:func:`measure`'s runs in ``env``."""
  module = ["-m", "petra_jax.benchmarks.scaling"]
  multi_env = dict(env, XLA_FLAGS=f"{env['XLA_FLAGS']} {EIGEN_FLAG}", PYTHON=sys.executable,
                   PETRA_MODULE="petra_jax.benchmarks.scaling", LOCAL_DEVICES="1")
  singles, multis = [], []
  for _ in range(args.repeats):
    singles.append(run_child([sys.executable, *module, "--role=single", *child_args(args)],
                             env, args.timeout))
    multis.append(run_child([os.path.join(_REPO, "launch", "local.sh"), str(args.processes),
                             "--role=worker", *child_args(args)], multi_env, args.timeout))
  return _median(singles), _median(multis)


def _median(results: list) -> dict:
  """Leaf by leaf median of JSON results of the same structure (ints: the first)."""
  return jax.tree.map(lambda *xs: xs[0] if isinstance(xs[0], int) else statistics.median(xs),
                      *results)


if __name__ == "__main__":
  import sys  # pylint: disable=g-import-not-at-top
  from petra_jax.benchmarks import cli  # pylint: disable=g-import-not-at-top
  sys.exit(cli.library_main("scaling.processes", "scaling"))
