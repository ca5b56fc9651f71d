"""A GPU check in at most 8 minutes, one command, no package registry: ``launch/gpu_check.sh``.

``python -m petra_jax.benchmarks.gpu_check [--tiny] [--out=DIR] [--parts=a,b] [--executor=auto]
[--data-dir=DIR]``

Each part runs as its own process under its own time limit (s), its stdout and stderr kept in
``DIR/<part>.log``; a part that runs out of time is stopped and the others still run:

- ``info`` (15): date, ``nvidia-smi``, JAX's devices and versions, the git commit.
- ``accelerator_float32`` (160), ``accelerator_bfloat16`` (80): ``petra`` and ``backprop`` ticks
  of RevNet18 width 64 (10 stages, k = 1) at micro-batches 64, 256, 1024
  (:mod:`petra_jax.benchmarks.accelerator`); rows land in ``DIR/rows.jsonl`` as they end.
- ``accelerator_host`` (25): ``petra`` float32 at 256 under the host executor (the reference
  loop), beside the rows above.
- ``train`` (65): the main job (``configs/cifar10.py``, real CIFAR-10, no evaluation) with a
  progress line every 10 s, stopped by its limit: its img/s. Needs ``cifar10`` in the data dir.
- ``accelerator_recipe`` (40): the benchmark on the main job's recipe (``--config=
  configs/cifar10.py``: its split, optimizer and compensation; ``petra`` float32, micro-batch 64,
  k = 2, the main job's shapes), its row in ``DIR/recipe_rows.jsonl``: what the main job's img/s
  is compared with (issue 47 item 4).
- ``language_model`` (65): ``revgpt_small`` in 4 stages on tiny_shakespeare (context 256, 64
  sequences in 4 micro-batches): its sequences/s and tokens/s. Needs ``tiny_shakespeare``.
- ``summary``: ``DIR/summary.txt``: each part's exit status, the fits ``tick = H + C B`` per
  (method, dtype) from the rows, the last progress line of each training run, and the main
  job's img/s as a percentage of the benchmark's on its recipe.
- ``train_profile`` (90; only when ``--parts`` names it, beyond the 8 minutes): the main job as
  ``train`` with ``--config.profile_steps=96:192`` (about three compiled calls of 32 updates at
  its k = 2), the trace under ``DIR/train_profile/profile``; the summary gives the device's
  busy fraction inside the window and its five longest kernels: where the main job loses to the
  benchmark.
- ``accelerator_ordered`` (100; only when ``--parts`` names it, beyond the 8 minutes): ``petra``
  float32 at 64 and 256 under the compiled executor whatever ``--executor`` says (the writes
  it orders are that executor's), without and then with its carried writes ordered
  (``--order-writes=0,1``, :mod:`petra_jax.engine.transport.ordered_writes`); the summary
  compares each ordered row with the row of the same program unordered: whether the engine's
  default should change.

Then ``DIR`` is bundled into ``DIR.tar.gz``. ``DIR`` defaults to
``gpu_check_<UTC date and time>_<host>``. ``--tiny``: the same parts at CPU sizes (width 2,
2 stages, micro-batches 2 and 4, a few updates), for a dry run on the CPU. ``--executor`` is
the tick executor every timed part runs under (``auto``: compiled where it runs the pipeline).
Exit status: 0, or 1 if a part failed or ran out of time (a training run stopped by its limit
is a success).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import dataclasses
from dataclasses import dataclass
from typing import Optional, Sequence

from petra_jax.benchmarks import accelerator
from petra_jax.benchmarks import device_time
from petra_jax.engine.compiled import EXECUTORS
from petra_jax.training import profile_window
_PY = sys.executable
GRACE_S = 5  # after SIGTERM at a part's limit, SIGKILL this many seconds later
MAIN_JOB = "configs/cifar10.py"
ROWS, RECIPE_ROWS = "rows.jsonl", "recipe_rows.jsonl"  # the grid's rows; the recipe's row


@dataclass(frozen=True)
class Part:
  """One part: its name, command line (argv), time limit in seconds, and whether it runs until
  the limit stops it (a training run: then being stopped is its success)."""
  name: str
  argv: tuple
  seconds: float
  until_stopped: bool = False
  optional: bool = False  # runs only when --parts names it


def _accelerator(name: str, dtype: str, tiny: bool, seconds: float, out: str, executor: str,
                 methods: str = "petra,backprop", micro_batches: str = "64,256,1024",
                 extra: Sequence[str] = ()) -> Part:
  sizes = (["--width=2", "--num-stages=2", "--micro-batches=2,4", "--ticks=3", "--warmup=1"]
           if tiny else ["--width=64", f"--micro-batches={micro_batches}", "--ticks=30",
                         "--warmup=2"])
  return _benchmark(name, seconds, os.path.join(out, ROWS), f"--executor={executor}",
                    f"--dtypes={dtype}", f"--methods={methods}", "--accumulation-steps=1", *sizes,
                    *extra)


def _recipe(tiny: bool, seconds: float, out: str, executor: str) -> Part:
  """The benchmark's row on the main job's recipe and shapes (micro-batch 64 in k = 2; tiny: the
  tiny main job's width 2 and micro-batch 4)."""
  sizes = (["--width=2", "--micro-batches=4", "--ticks=3", "--warmup=1"] if tiny
           else ["--width=64", "--micro-batches=64", "--ticks=32", "--warmup=2"])
  return _benchmark("accelerator_recipe", seconds, os.path.join(out, RECIPE_ROWS),
                    f"--config={MAIN_JOB}", f"--executor={executor}", "--dtypes=float32",
                    "--methods=petra", "--accumulation-steps=2", *sizes)


def _benchmark(name: str, seconds: float, rows_file: str, *flags: str) -> Part:
  argv = [_PY, "-m", "petra_jax.benchmarks.accelerator", "--model=revnet18", "--dataset=cifar10",
          "--no-reconstruction", f"--row-seconds={seconds:g}", f"--rows-file={rows_file}",
          "--json", *flags]
  return Part(name, tuple(argv), seconds)


def _train(name: str, config: str, overrides: Sequence[str], seconds: float, out: str,
           data_dir: str, progress_seconds: float, executor: str) -> Part:
  argv = [_PY, "-m", "petra_jax.train", f"--config={config}", f"--config.executor={executor}",
          f"--workdir={os.path.join(out, name)}", f"--config.progress_seconds={progress_seconds:g}",
          "--config.checkpoint_every=0", "--config.checkpoint_minutes=0", *overrides]
  if data_dir:
    argv.append(f"--config.data_dir={data_dir}")
  return Part(name, tuple(argv), seconds, until_stopped=True)


def parts(tiny: bool, out: str, executor: str, data_dir: str = "") -> list[Part]:
  """Every part of the check in order (module docstring); ValueError for an unknown executor."""
  if executor not in EXECUTORS:
    raise ValueError(f"--executor={executor}: this checkout has the {', '.join(EXECUTORS)} "
                     "executor only")
  if tiny:
    # (enough updates, and train_loss lines, for progress lines: the summary reads the last one)
    main_job = ["--config.model.width=2", "--config.max_steps=48", "--config.num_epochs=1",
                "--config.log_every=4",
                "--config.optim.warmup_epochs=0",
                "--config.steps_per_epoch=48", "--config.batch_size=8",
                "--config.eval_batch_size=1000"]
    lm = ["--config.model.width=8", "--config.max_steps=48", "--config.steps_per_epoch=48",
          "--config.log_every=4",
          "--config.num_epochs=1", "--config.model.context=16", "--config.batch_size=8",
          "--config.accumulation_steps=2", "--config.eval_batch_size=8"]
  else:
    main_job = ["--config.num_epochs=1000", "--config.eval_every=0"]  # stopped by its limit
    lm = ["--config.model.name=revgpt_small", "--config.model.width=64",
          "--config.model.context=256", "--config.model.stage_sizes=()",
          "--config.model.num_stages=4", "--config.batch_size=64",
          "--config.accumulation_steps=4", "--config.num_epochs=1000"]
  times = ((30, 150, 150, 150, 150, 150, 150, 150, 150) if tiny
           else (15, 155, 25, 80, 65, 40, 65, 100, 90))
  every = 1 if tiny else 10
  return [Part("info", (_PY, "-m", "petra_jax.benchmarks.gpu_check", "--info"), times[0]),
          _accelerator("accelerator_float32", "float32", tiny, times[1], out, executor),
          _accelerator("accelerator_host", "float32", tiny, times[2], out, "host",
                       methods="petra", micro_batches="256"),
          _accelerator("accelerator_bfloat16", "bfloat16", tiny, times[3], out, executor),
          _train("train", MAIN_JOB, main_job, times[4], out, data_dir, every, executor),
          _recipe(tiny, times[5], out, executor),
          _train("language_model", "configs/shakespeare_cpu.py", lm, times[6], out, data_dir,
                 every, executor),
          dataclasses.replace(
              _accelerator("accelerator_ordered", "float32", tiny, times[7], out, "compiled",
                           methods="petra", micro_batches="64,256", extra=("--order-writes=0,1",)),
              optional=True),
          dataclasses.replace(
              _train("train_profile", MAIN_JOB,
                     main_job + ["--config.profile_steps=" + ("1:3" if tiny else "96:192")],
                     times[8], out, data_dir, every, executor), optional=True)]


def run_part(part: Part, out: str) -> dict:
  """Runs ``part`` with output to ``out/<name>.log``; ``{"name", "status", "seconds"}``.

  ``status``: the exit status, or ``"timeout"`` if the limit stopped it (SIGTERM to its process
  group, SIGKILL :data:`GRACE_S` later), ``"stopped"`` for a part that runs until stopped.
  """
  log = os.path.join(out, f"{part.name}.log")
  start = datetime.datetime.now()
  with open(log, "w") as f:
    f.write("$ " + " ".join(part.argv) + "\n")
    f.flush()
    proc = subprocess.Popen(part.argv, stdout=f, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
      status = proc.wait(timeout=part.seconds)
    except subprocess.TimeoutExpired:
      status = "stopped" if part.until_stopped else "timeout"
      _stop(proc)
  seconds = (datetime.datetime.now() - start).total_seconds()
  print(f"gpu_check: {part.name}: {status} after {seconds:.0f} s (limit {part.seconds:g} s)",
        flush=True)
  return {"name": part.name, "status": status, "seconds": seconds}


def _stop(proc: subprocess.Popen) -> None:
  os.killpg(proc.pid, signal.SIGTERM)
  try:
    proc.wait(timeout=GRACE_S)
  except subprocess.TimeoutExpired:
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def info() -> None:
  """Prints the date, ``nvidia-smi``, JAX's devices and versions, the git commit."""
  print("date (UTC):", datetime.datetime.now(datetime.timezone.utc).isoformat())
  print("host:", platform.node(), platform.platform(), "python", platform.python_version())
  for cmd in (["nvidia-smi"], ["git", "rev-parse", "HEAD"], ["git", "status", "--short"]):
    if shutil.which(cmd[0]):
      r = subprocess.run(cmd, capture_output=True, text=True, check=False)
      print(f"$ {' '.join(cmd)}\n{r.stdout}{r.stderr}", end="")
    else:
      print(f"$ {' '.join(cmd)}: not found")
  import jax
  print("jax", jax.__version__, "backend", jax.default_backend())
  for d in jax.devices():
    print(" ", d.id, d.platform, d.device_kind)


def last_line(path: str, *words: str) -> str:
  """The last line of the file at ``path`` containing every one of ``words``; "" if none."""
  if not os.path.exists(path):
    return ""
  found = ""
  with open(path, errors="replace") as f:
    for line in f:
      if all(w in line for w in words):
        found = line.strip()
  return found


def summary(out: str, results: Sequence[dict]) -> str:
  """The check in a few lines (module docstring)."""
  lines = [f"{r['name']}: {r['status']} ({r['seconds']:.0f} s)" for r in results]
  rows, recipe_rows = _rows(os.path.join(out, ROWS)), _rows(os.path.join(out, RECIPE_ROWS))
  for r in rows:
    lines.append(accelerator._row_line(r))
  for fit in accelerator.fits(rows):
    name = " ".join(x for x in (fit["method"], fit["dtype"], fit["executor"]) if x)
    lines.append(f"{name}: tick {accelerator._fit_text(fit['tick'])}; "
                 f"device {accelerator._fit_text(fit['device'])}")
  main_line = last_line(os.path.join(out, "train.log"), "img/s")
  lines.append("main job: " + (main_line or "no progress line"))
  for r in recipe_rows:
    lines.append("benchmark on the main job's recipe: " + accelerator._row_line(r))
  lines.append("main job against the benchmark on its recipe: "
               + against_benchmark(main_line, recipe_rows))
  lines.append("language model: " + (last_line(os.path.join(out, "language_model.log"),
                                               "tokens/s") or "no progress line"))
  ordered = ordered_against_unordered(rows)
  if ordered:
    lines.append("writes ordered against not (petra float32, img/s): " + ordered)
  if any(r["name"] == "train_profile" for r in results):
    lines.append("main job's profile: " + profile_summary(os.path.join(out, "train_profile")))
  return "\n".join(lines) + "\n"


def profile_summary(workdir: str) -> str:
  """The device's busy time in the traced window of the run in ``workdir`` and its five longest
  kernels, or what is missing."""
  import jax  # pylint: disable=g-import-not-at-top
  try:
    data = jax.profiler.ProfileData.from_file(
        device_time.xplane_file(os.path.join(workdir, "profile")))
    window = device_time.measure(data, profile_window.WINDOW_EVENT, device_time.platform_of(data))
  except RuntimeError as e:
    return f"none ({e})"
  lo, hi = device_time.window_bounds(data, profile_window.WINDOW_EVENT)
  calls, batches = (device_time.named_time(data, name, lo, hi) / 1e6 for name in
                    (profile_window.CALL_EVENT, profile_window.BATCHES_EVENT))
  top = ", ".join(f"{name} {ns / 1e6:.1f} ms" for name, ns in list(window.kernels.items())[:5])
  return (f"device busy {window.busy_ns / 1e6:.1f} ms of a {window.wall_ns / 1e6:.1f} ms window "
          f"({100 * window.busy_fraction:.0f} %, {window.num_events} device events); host: "
          f"{calls:.1f} ms in executor calls ({batches:.1f} ms of them taking micro-batches), "
          f"{window.wall_ns / 1e6 - calls:.1f} ms between calls; longest kernels: {top}")


def _rows(path: str) -> list[dict]:
  """The JSON lines of the rows file at ``path``; [] if there is none."""
  if not os.path.exists(path):
    return []
  with open(path) as f:
    return [json.loads(x) for x in f if x.strip()]


def against_benchmark(progress_line: str, recipe_rows: Sequence[dict]) -> str:
  """``"A img/s / B img/s = P %"``: the main job's rate in its progress line against the
  benchmark row's ``images_per_s`` on the same recipe (issue 47 item 4: within 10 %), or what is
  missing."""
  rate = re.search(r"([0-9][0-9,]*(?:\.[0-9]+)?) img/s", progress_line)
  bench = next((r["images_per_s"] for r in recipe_rows if "images_per_s" in r), None)
  if rate is None or bench is None:
    return "needs " + " and ".join(
        w for w, miss in (("a progress line", rate is None), ("the recipe's row", bench is None))
        if miss)
  main = float(rate.group(1).replace(",", ""))
  return f"{main:.1f} img/s / {bench:.1f} img/s = {100 * main / bench:.0f} %"


def ordered_against_unordered(rows: Sequence[dict]) -> str:
  """Per micro-batch, ``"B: X against Y (+P %)"``: ``petra`` float32's img/s with its writes
  ordered (X) against the compiled row that differs only in not ordering them (Y), or what is
  missing; "" without ordered rows."""
  def program(r):  # what a compiled row ran, but the ordering
    return (r["micro_batch"], r.get("unroll_ticks"), r.get("periods_per_dispatch"))
  petra = [r for r in rows if r["method"] == "petra" and r["dtype"] == "float32"
           and r.get("executor") == "compiled"]
  plain = {program(r): r["images_per_s"] for r in petra
           if not r.get("order_writes") and "images_per_s" in r}
  said = []
  for r in (r for r in petra if r.get("order_writes")):
    x, y = r.get("images_per_s"), plain.get(program(r))
    said.append(f"{r['micro_batch']}: " + (
        "no rate (incomplete)" if x is None else
        "needs the float32 row of the same compiled program" if y is None else
        f"{x:.1f} against {y:.1f} ({100 * (x / y - 1):+.1f} %)"))
  return "; ".join(said)


def bundle(out: str) -> str:
  """``out.tar.gz`` holding ``out``; returns its path."""
  path = out.rstrip(os.sep) + ".tar.gz"
  with tarfile.open(path, "w:gz") as tar:
    tar.add(out, arcname=os.path.basename(out.rstrip(os.sep)))
  return path


def default_out() -> str:
  stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d_%H%M%S")
  return f"gpu_check_{stamp}_{platform.node() or 'host'}"


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
  """The flags of the module docstring; a bad one exits with status 2."""
  p = argparse.ArgumentParser(prog="python -m petra_jax.benchmarks.gpu_check",
                              description=__doc__.splitlines()[0])
  p.add_argument("--tiny", action="store_true", help="CPU sizes: a dry run of the check")
  p.add_argument("--out", default="", help="output folder (default gpu_check_<date>_<host>)")
  p.add_argument("--parts", default="", help="comma-separated parts to run (default: all)")
  p.add_argument("--executor", default="auto", choices=EXECUTORS,
                 help="the tick executor of the timed parts")
  p.add_argument("--data-dir", default="", help="tfds data dir (default: training's)")
  p.add_argument("--info", action="store_true", help=argparse.SUPPRESS)
  return p.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> int:
  """``python -m petra_jax.benchmarks.gpu_check``."""
  args = parse_args(argv)
  if args.info:
    info()
    return 0
  out = os.path.abspath(args.out or default_out())
  os.makedirs(out, exist_ok=True)
  todo = parts(args.tiny, out, args.executor, args.data_dir)
  wanted = [x for x in args.parts.split(",") if x]
  unknown = sorted(set(wanted) - {p.name for p in todo})
  if unknown:
    print(f"unknown part(s) {unknown}: choose from {[p.name for p in todo]}", file=sys.stderr)
    return 2
  results = [run_part(p, out) for p in todo
             if (p.name in wanted if wanted else not p.optional)]
  text = summary(out, results)
  with open(os.path.join(out, "summary.txt"), "w") as f:
    f.write(text)
  print(text, end="")
  print(f"gpu_check: everything is in {out} and {bundle(out)}")
  return 0 if all(r["status"] in (0, "stopped") for r in results) else 1


if __name__ == "__main__":
  sys.exit(main())
