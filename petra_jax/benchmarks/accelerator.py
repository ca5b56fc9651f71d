"""Images/s, device busy fraction, the tick's fixed and per-image cost, reconstruction error.

``python -m petra_jax.benchmarks.accelerator [--config=FILE] [--model=revnet18] [--micro-batches=64,256]
[--dtypes=float32,bfloat16] [--methods=backprop,petra,1f1b] [--accumulation-steps=4]
[--ticks=N] [--num-stages=J] [--row-seconds=S] [--rows-file=PATH] [--executor=auto]
[--periods-per-dispatch=64] [--unroll-ticks=4] [--order-writes=0,1] [--json]``

Per (method, micro-batch ``B``, dtype, and for a compiled row each ``N`` of
``--periods-per-dispatch``, ``U`` of ``--unroll-ticks`` and value of ``--order-writes``:
comma-separated lists, timed one row each), on a pipeline built as training builds it and one
random micro-batch, its ticks run by ``--executor`` (``executor`` in the row: ``compiled`` runs
the steady-state ticks ``--periods-per-dispatch`` at a time in one call), after the filling
ticks (which compile; ``compile_s``):

- ``tick_ms``: wall ms per completed micro-batch over ``N`` ticks dispatched back to back with one
  wait at the end (no wait per call); ``images_per_s = 1000 B / tick_ms``.
- Busy time, from a ``jax.profiler`` trace of the same ``N`` ticks run again
  (:mod:`petra_jax.benchmarks.device_time`): ``profiled_tick_ms`` is that window's wall ms per
  micro-batch, ``device_ms`` the time per micro-batch in which at least one device event ran
  (kernels and copies on a GPU, XLA thunks on the CPU), ``busy_fraction = device_ms /
  profiled_tick_ms`` and ``device_idle_us_per_tick = 1000 (profiled_tick_ms - device_ms)``: the
  tick's time in which the device waited for the host. Both windows are measured, never
  derived from per-call timings, so ``0 <= busy_fraction <= 1`` and the idle time is ``>= 0``
  by construction. The profile costs a little host time: compare ``profiled_tick_ms`` with
  ``tick_ms``.
- ``fits``: per (method, dtype) over the micro-batches, the least-squares line
  ``tick_ms = fixed_ms + ms_per_image * B`` (``H`` and ``C``), and the same for ``device_ms``.

A row stops after the phase in which it passes ``--row-seconds`` (compiling can't be cut short)
and reports what it measured with ``"incomplete"`` saying why. Rows print to stderr as they
finish; the table (or ``--json``'s one line) comes at the end. ``reconstruction_error`` is
``||x~ - x|| / ||x||`` (paper Sec. 3.2) of the reversible stages under matmul precision
``"default"`` and ``"highest"`` (``--no-reconstruction`` skips it).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import platform
import re
import sys
import time
from typing import Optional, Sequence

from petra_jax import config as config_lib
from petra_jax import data as data_lib
from petra_jax.benchmarks import cli, device_time
from petra_jax.engine.stages import diagnostics
from petra_jax.engine import compiled
from petra_jax.engine import periods as periods_lib
from petra_jax.engine import schedules as schedule_lib
from petra_jax.engine.stages import stage as stage_lib
from petra_jax.engine.arrays.precision import DTYPES
from petra_jax.training import assembly, validation
import flax
import jax
import jaxlib
import ml_collections
import numpy as np

METHODS = ("backprop", "petra", "1f1b")
MATMUL_PRECISIONS = ("default", "highest")
TOP_KERNELS = 12  # a row's longest device kernels, in microseconds per tick
_STEPS_PER_EPOCH = 1000  # only shapes the optimizers' learning-rate schedule


def run_config(model: str, dataset: str, width: int, method: str, micro_batch: int,
               dtype: str, accumulation_steps: int, num_stages: int = 0,
               executor: str = "auto", periods: int = periods_lib.PERIODS_PER_DISPATCH,
               recipe: str = "", unroll_ticks: int = periods_lib.UNROLL_TICKS,
               order_writes: bool = periods_lib.ORDER_WRITES) -> ml_collections.ConfigDict:
  """The training config of one row (one device; ``num_stages`` 0: the recipe's split, by
  default one block per stage; the tick ``executor``, its ``periods`` per call,
  ``unroll_ticks`` per loop iteration and ``order_writes``): the
  default config, or the training ``recipe`` ``FILE[:VARIANT]`` (its optimizer, compensation
  and split) with the row's fields set. ConfigError as training would raise; ValueError for
  a missing recipe file."""
  c = config_lib.recipe(recipe) if recipe else config_lib.get_config()
  c.executor, c.periods_per_dispatch, c.unroll_ticks = executor, periods, unroll_ticks
  c.order_writes = order_writes
  c.method, c.dataset, c.dtype, c.num_devices = method, dataset, dtype, 1
  c.model.name, c.model.width = model, width
  if num_stages or not recipe:
    c.model.num_stages, c.model.stage_sizes = num_stages, ()
  c.accumulation_steps = accumulation_steps
  c.batch_size = micro_batch * accumulation_steps
  validation.validate_config(c, len(jax.local_devices()))
  return c


def random_batch(shape: Sequence[int], num_classes: int, batch: int, seed: int = 0):
  """``(images float32[B, *shape], labels int32[B])`` drawn on the default device."""
  ki, kl = jax.random.split(jax.random.key(seed))
  return (jax.random.normal(ki, (batch, *shape), np.float32),
          jax.random.randint(kl, (batch,), 0, num_classes, np.int32))


def segments(pipe, ticks: int, warmup: int, repeats: int = 1, per_call: int = 1):
  """``(untimed ticks, [timed ticks] * repeats, micro-batches completed per timed segment)``.

  Consecutive segments of one schedule, so each may follow the one before. Stream: ``2(J-1) +
  warmup`` filling ticks then ``repeats`` segments of ``ticks``; periodic schedules: whole
  rounds. ``per_call``: steady-state periods one executor call runs (ticks for a stream,
  rounds for a periodic schedule); warm-up and each segment are rounded up to whole calls, so
  the untimed ticks compile every program the timed ones run.
  """
  table, fill, length, done = segment_bounds(pipe, ticks, warmup, repeats, per_call)
  table = list(table)
  return table[:fill], [table[fill + i * length:fill + (i + 1) * length]
                        for i in range(repeats)], done


def segment_bounds(pipe, ticks: int, warmup: int, repeats: int = 1, per_call: int = 1):
  """``(schedule, untimed ticks, ticks per timed segment, micro-batches completed per
  segment)`` of :func:`segments`: the segments are ticks ``[fill + i * length, fill + (i + 1)
  * length)`` of ``schedule``, which says itself which of its ticks are steady (an executor
  run over it finds its periods as the training loop's does)."""
  if pipe.method.delayed:
    ticks, warmup = _whole(ticks, per_call), _whole(max(warmup, 1), per_call)
    fill = schedule_lib.drain_ticks(pipe.num_stages) + warmup
    return pipe.schedule(fill + repeats * ticks), fill, ticks, ticks
  size = pipe.schedule(0).round_size
  warm_rounds = _whole(math.ceil(warmup / size), per_call)
  rounds = _whole(math.ceil(ticks / size), per_call)
  table = pipe.schedule(size * (warm_rounds + repeats * rounds))
  per_round = len(table) // (warm_rounds + repeats * rounds)
  return table, per_round * warm_rounds, per_round * rounds, size * rounds


def _whole(count: int, per_call: int) -> int:
  """``count`` rounded up to a multiple of ``per_call``."""
  return per_call * math.ceil(count / per_call)


def _run_ticks(executor, state, table, start: int, stop: int, images, labels):
  """Runs ticks ``[start, stop)`` of ``table`` with ``executor`` and waits once for everything
  they produced; returns the new state."""
  t, losses = start, []
  while t < stop:
    state, outs, ran = executor.advance(state, table, t, lambda m: (images, labels), limit=stop)
    losses += [o.loss for o in outs]
    t += ran
  jax.block_until_ready(losses)
  state.block_until_ready()  # (a compiled call's carry as it is: nothing converted)
  return state


def measure(cfg: ml_collections.ConfigDict, ticks: int, warmup: int, seed: int = 0,
            row_seconds: float = math.inf) -> dict:
  """One result row (module docstring) for the config of :func:`run_config`, its ticks run
  by ``cfg.executor`` (:mod:`petra_jax.engine.compiled`).

  Stops after the first phase (compile, timed ticks, profiled ticks) that ends past
  ``row_seconds`` from the row's start, with ``"incomplete"`` naming it.
  """
  start = time.perf_counter()
  info = data_lib.get_dataset_info(cfg.dataset)
  micro = cfg.batch_size // cfg.accumulation_steps
  row = {"method": cfg.method, "micro_batch": micro, "dtype": cfg.dtype}
  pipe, _, _ = assembly.build_pipeline(cfg, "", info, micro, _STEPS_PER_EPOCH)
  executor = compiled.executor(pipe, cfg.executor, cfg.periods_per_dispatch, cfg.unroll_ticks,
                               cfg.order_writes)
  row["executor"] = executor.name
  if executor.name == "compiled":
    row.update(periods_per_dispatch=cfg.periods_per_dispatch, unroll_ticks=cfg.unroll_ticks,
               order_writes=cfg.order_writes)
  images, labels = random_batch(info.image_shape, info.num_classes, micro, seed)
  table, a, length, done = segment_bounds(pipe, ticks, warmup, repeats=2,
                                          per_call=getattr(executor, "n", 1))
  b = a + length
  state = _run_ticks(executor, pipe.init(seed, images), table, 0, a, images, labels)
  row.update(num_stages=pipe.num_stages, compile_s=time.perf_counter() - start)
  if _late(row, "compiling", start, row_seconds):
    return row
  t0 = time.perf_counter()
  state = _run_ticks(executor, state, table, a, b, images, labels)
  tick_ms = 1e3 * (time.perf_counter() - t0) / done
  row.update(tick_ms=tick_ms, images_per_s=1e3 * micro / tick_ms)
  if _late(row, "the timed ticks", start, row_seconds):
    return row
  with device_time.profile_window() as window:
    state = _run_ticks(executor, state, table, b, b + length, images, labels)
  if not window.num_events:
    row.update(incomplete="the profile holds no device event (a GPU needs CUPTI)",
               seconds=time.perf_counter() - start)
    return row
  profiled_ms, busy_ms = 1e-6 * window.wall_ns / done, 1e-6 * window.busy_ns / done
  row.update(profiled_tick_ms=profiled_ms, device_ms=busy_ms,
             busy_fraction=window.busy_fraction,
             device_idle_us_per_tick=1e3 * (profiled_ms - busy_ms),
             device_events=window.num_events, seconds=time.perf_counter() - start,
             top_kernels=[[name, round(1e-3 * ns / done, 1)]
                          for name, ns in kernel_families(window.kernels)[:TOP_KERNELS]])
  return row


def kernel_families(kernels: dict) -> list:
  """``[(family, ns)]`` largest first: device time per kernel name with its instance number
  (``fusion.12``, ``loop_add_fusion_3``) dropped."""
  total: dict = {}
  for name, ns in kernels.items():
    family = re.sub(r"[._]\d+$", "", name)
    total[family] = total.get(family, 0.0) + ns
  return sorted(total.items(), key=lambda kv: -kv[1])


def _late(row: dict, phase: str, start: float, limit: float) -> bool:
  """Marks ``row`` incomplete if ``limit`` s have passed since ``start``."""
  spent = time.perf_counter() - start
  if spent <= limit:
    return False
  row.update(incomplete=f"{phase} ended {spent:.0f} s into the row (--row-seconds={limit:g})",
             seconds=spent)
  return True


def fits(rows: Sequence[dict]) -> list[dict]:
  """Per (method, dtype, executor and its ticks per loop iteration), the lines
  ``tick_ms = H + C B`` and ``device_ms = H + C B``.

  Each entry: ``{"method", "dtype", "executor", "tick": fit, "device": fit}`` with ``fit`` as
  :func:`device_time.fit_line` (None with fewer than two micro-batches measured); ``executor``
  is "" for rows that name none, ``compiled/uU/nN`` for a compiled row of ``unroll_ticks = U``
  and ``periods_per_dispatch = N`` (each part only where the row records it), ending in
  ``/ordered`` where it ordered its writes.
  """
  def key(r):
    executor = r.get("executor", "")
    if "unroll_ticks" in r:
      executor += f"/u{r['unroll_ticks']}"
    if "periods_per_dispatch" in r:
      executor += f"/n{r['periods_per_dispatch']}"
    if r.get("order_writes"):
      executor += "/ordered"
    return r["method"], r["dtype"], executor
  out = []
  for method, dtype, executor in dict.fromkeys(key(r) for r in rows):
    mine = [r for r in rows if key(r) == (method, dtype, executor)]
    entry = {"method": method, "dtype": dtype, "executor": executor}
    for name, field in (("tick", "tick_ms"), ("device", "device_ms")):
      got = [r for r in mine if field in r]
      entry[name] = device_time.fit_line([r["micro_batch"] for r in got], [r[field] for r in got])
    out.append(entry)
  return out


def reconstruction_error(stages, variables: Sequence[dict], images, precision: str) -> float:
  """``||x~ - x|| / ||x||`` over the reversible stages' inputs under ``precision``.

  ``images`` float32 ``[B, H, W, C]``; ``variables`` per stage ``{"params", "batch_stats"}``.
  Raises ValueError if no stage is reversible.
  """
  if not stage_lib.has_reversible(stages):
    raise ValueError("reconstruction needs a reversible stage: use a RevNet model.")

  def rebuild(variables, x):
    rebuilt, true = [], []
    for stage, v in zip(stages[:-1], variables):
      y, _ = stage_lib.forward(stage, v["params"], v["batch_stats"], x)
      if stage.reversible:
        true.append(x)
        rebuilt.append(stage_lib.inverse(stage, v["params"], v["batch_stats"], y))
      x = y
    return diagnostics.relative_error(rebuilt, true)
  with jax.default_matmul_precision(precision):
    return float(jax.jit(rebuild)(list(variables), images))  # traced under `precision`


def init_variables(stages, images, seed: int = 0) -> list[dict]:
  """Each stage's ``{"params", "batch_stats"}`` from ``fold_in(key(seed), j)``."""
  out, x, key = [], images, jax.random.key(seed)
  for j, stage in enumerate(stages):
    v = stage.init(jax.random.fold_in(key, j), x)
    out.append(v)
    x, _ = stage_lib.forward(stage, v["params"], v["batch_stats"], x)
  return out


def _versions() -> dict:
  return {"python": platform.python_version(), "jax": jax.__version__,
          "jaxlib": jaxlib.__version__,
          "flax": flax.__version__, "numpy": np.__version__}


def grid(args: argparse.Namespace) -> list[list[ml_collections.ConfigDict]]:
  """Every row's config, validated before any row runs: per (dtype, micro-batch, method), the
  configs of each ``(periods_per_dispatch, unroll_ticks, order_writes)``. ConfigError and
  ValueError as :func:`run_config`."""
  return [[run_config(args.model, args.dataset, args.width, m, b, d, args.accumulation_steps,
                      args.num_stages, args.executor, n, args.config, u, o)
           for n, u, o in itertools.product(args.periods_per_dispatch, args.unroll_ticks,
                                            args.order_writes)]
          for d in args.dtypes for b in args.micro_batches for m in args.methods]


def benchmark(args: argparse.Namespace, configs: Optional[list] = None) -> dict:
  """Every row of the grid (``configs``, default :func:`grid`; each row printed to stderr as it
  ends), the fits, the reconstruction errors (unless ``args.no_reconstruction``), device and
  versions. Rows run micro-batch by micro-batch, every method at one size before the next size,
  so a check stopped by its time limit keeps comparable pairs (it loses the largest sizes, not
  a whole method)."""
  results = []
  for row in grid(args) if configs is None else configs:
    for cfg in row:
      results.append(measure(cfg, args.ticks, args.warmup, row_seconds=args.row_seconds))
      print(_row_line(results[-1]), file=sys.stderr, flush=True)
      if args.rows_file:
        with open(args.rows_file, "a") as f:
          f.write(json.dumps(results[-1]) + "\n")
      if results[-1].get("executor") != "compiled":
        break  # the host executor ran it: N and U change nothing
  dev = jax.devices()[0]
  report = {"device": {"kind": dev.device_kind, "platform": dev.platform},
            "versions": _versions(), "recipe": args.config or "default config",
            "model": args.model, "dataset": args.dataset,
            "width": args.width, "accumulation_steps": args.accumulation_steps,
            "ticks": args.ticks, "warmup": args.warmup, "results": results,
            "fits": fits(results)}
  if not args.no_reconstruction:
    info = data_lib.get_dataset_info(args.dataset)
    stages = cli.build(args.model, args.dataset, args.width)
    images, _ = random_batch(info.image_shape, info.num_classes, max(args.micro_batches))
    variables = init_variables(stages, images)
    report["reconstruction_error"] = {p: reconstruction_error(stages, variables, images, p)
                                      for p in MATMUL_PRECISIONS}
  return report


_HEADER = (f"{'method':<9}{'B':>5} {'dtype':<9}{'executor':<9}{'images/s':>10}{'tick ms':>10}{'prof. ms':>10}"
           f"{'device ms':>11}{'busy':>7}{'idle us':>10}{'compile s':>10}")


def _row_line(x: dict) -> str:
  """One table line; fields a row did not reach print as ``-``."""
  def f(key, fmt, width):
    return format(x[key], fmt).rjust(width) if key in x else "-".rjust(width)
  line = (f"{x['method']:<9}{x['micro_batch']:>5} {x['dtype']:<9}{x.get('executor', '-'):<9}"
          + f("images_per_s", ".1f", 10)
          + f("tick_ms", ".2f", 10) + f("profiled_tick_ms", ".2f", 10)
          + f("device_ms", ".2f", 11) + f("busy_fraction", ".2f", 7)
          + f("device_idle_us_per_tick", ".0f", 10) + f("compile_s", ".1f", 10))
  line += "  writes ordered" if x.get("order_writes") else ""
  return line + (f"  incomplete: {x['incomplete']}" if "incomplete" in x else "")


def _fit_text(fit: Optional[dict]) -> str:
  if fit is None:
    return "needs two micro-batches"
  return f"H = {fit['fixed_ms']:.3f} ms + C = {fit['ms_per_image']:.5f} ms/image"


def _print_report(r: dict) -> None:
  print(f"{r['model']} width {r['width']} on {r['device']['kind']} ({r['device']['platform']}); "
        f"jax {r['versions']['jax']}")
  print(_HEADER)
  for x in r["results"]:
    print(_row_line(x))
  print("tick = H + C * B (least squares over the micro-batches):")
  for f in r["fits"]:
    print(f"  {f['method']:<9}{f['dtype']:<9}{f['executor']:<9} tick {_fit_text(f['tick'])}; "
          f"device {_fit_text(f['device'])}")
  e = r.get("reconstruction_error")
  if e:
    print(f"reconstruction error ||x~ - x||/||x||: matmul precision default {e['default']:.2e}, "
          f"highest {e['highest']:.2e}")


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
  """The flags of the module docstring; a bad one exits with status 2."""
  p = argparse.ArgumentParser(prog="python -m petra_jax.benchmarks.accelerator",
                              description=__doc__.splitlines()[0])
  p.add_argument("--config", default="",
                 help="a training recipe FILE[:VARIANT] whose optimizer, compensation and "
                      "split the rows train with, as the main job does (default: the default "
                      "config); the flags below still set their fields")
  p.add_argument("--model", default="revnet18", type=cli.model_name,
                 help="a zoo name or MODULE:FUNCTION (docs/api.md)")
  p.add_argument("--dataset", default="cifar10", choices=sorted(data_lib.DATASETS),
                 help="fixes the image size, stem and classes (default cifar10)")
  p.add_argument("--width", type=int, default=64, help="base width (paper: 64)")
  p.add_argument("--num-stages", type=int, default=0,
                 help="pipeline stages (default 0: the --config's split, else one block per "
                      "stage, as the paper)")
  p.add_argument("--micro-batches", type=cli.csv_list(int), default=[64, 256],
                 help="comma-separated micro-batch sizes, one measurement each (default 64,256)")
  p.add_argument("--dtypes", type=cli.csv_list(str, DTYPES), default=["float32", "bfloat16"],
                 help=f"comma-separated compute dtypes among {DTYPES} (default: both)")
  p.add_argument("--methods", type=cli.csv_list(str, METHODS), default=list(METHODS),
                 help=f"comma-separated methods among {tuple(METHODS)} (default: all)")
  p.add_argument("--accumulation-steps", type=int, default=4, help="k, micro-batches per update")
  p.add_argument("--ticks", type=int, default=20, help="measured micro-batches (N)")
  p.add_argument("--warmup", type=int, default=2, help="unmeasured micro-batches first")
  p.add_argument("--row-seconds", type=float, default=math.inf,
                 help="stop a row after the phase that passes this many seconds (default: none)")
  p.add_argument("--no-reconstruction", action="store_true",
                 help="skip the reconstruction error (it compiles the whole model twice)")
  p.add_argument("--rows-file", default="",
                 help="append each row to this file as one JSON line when it ends")
  p.add_argument("--executor", default="auto", choices=compiled.EXECUTORS,
                 help="the tick executor (default auto: compiled where it runs the pipeline)")
  cli.add_compiled_flags(p, lists=("periods_per_dispatch", "unroll_ticks", "order_writes"))
  p.add_argument("--json", action="store_true", help="print JSON")
  args = p.parse_args(argv)
  if args.num_stages < 0:
    p.error("--num-stages must be at least 0")
  for flag in ("width", "accumulation_steps", "ticks", "warmup", "row_seconds",
               "periods_per_dispatch", "unroll_ticks"):
    value = getattr(args, flag)
    if (min(value) if isinstance(value, list) else value) < 1:
      p.error(f"--{flag.replace('_', '-')} must be at least 1")
  return args


def main(argv: Optional[Sequence[str]] = None) -> int:
  """``python -m petra_jax.benchmarks.accelerator``."""
  args = parse_args(argv)
  try:
    configs = grid(args)
  except (validation.ConfigError, ValueError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  return cli.emit(benchmark(args, configs), args.json, _print_report)


if __name__ == "__main__":
  sys.exit(main())
