"""Images/s, device busy fraction and reconstruction error on one accelerator.

``python -m petra_jax.benchmarks.accelerator [--model=revnet18] [--micro-batches=64,256]
[--dtypes=float32,bfloat16] [--methods=backprop,petra,1f1b] [--accumulation-steps=4]
[--ticks=N] [--json]``

Per (method, micro-batch ``B``, dtype), on a pipeline built as training builds it and one
random micro-batch: ``tick_ms`` (wall ms per micro-batch), ``images_per_s = B / tick_ms``,
``device_ms`` (the jitted steps alone), ``busy_fraction = device_ms / tick_ms`` and
``host_us_per_tick``. ``reconstruction_error`` is ``||x~ - x|| / ||x||`` (paper Sec. 3.2) of
the reversible stages under matmul precision ``"default"`` and ``"highest"``.
"""

from __future__ import annotations

import argparse
import math
import platform
import sys
import time
from typing import Optional, Sequence

from petra_jax import config as config_lib
from petra_jax import data as data_lib
from petra_jax.benchmarks import cli
from petra_jax.engine.stages import diagnostics
from petra_jax.engine import schedules as schedule_lib
from petra_jax.engine.stages import stage as stage_lib
from petra_jax.engine.arrays.precision import DTYPES
from petra_jax.engine.timing import median_ms, stage_cost, stage_times
from petra_jax.training import assembly, validation
import flax
import jax
import jaxlib
import ml_collections
import numpy as np

METHODS = ("backprop", "petra", "1f1b")
MATMUL_PRECISIONS = ("default", "highest")
_STEPS_PER_EPOCH = 1000  # only shapes the optimizers' learning-rate schedule


def run_config(model: str, dataset: str, width: int, method: str, micro_batch: int,
               dtype: str, accumulation_steps: int) -> ml_collections.ConfigDict:
  """The training config of one row (one device); ConfigError as training would raise."""
  c = config_lib.get_config()
  c.method, c.dataset, c.dtype, c.num_devices = method, dataset, dtype, 1
  c.model.name, c.model.width = model, width
  c.accumulation_steps = accumulation_steps
  c.batch_size = micro_batch * accumulation_steps
  validation.validate_config(c, len(jax.local_devices()))
  return c


def random_batch(shape: Sequence[int], num_classes: int, batch: int, seed: int = 0):
  """``(images float32[B, *shape], labels int32[B])`` drawn on the default device."""
  ki, kl = jax.random.split(jax.random.key(seed))
  return (jax.random.normal(ki, (batch, *shape), np.float32),
          jax.random.randint(kl, (batch,), 0, num_classes, np.int32))


def segments(pipe, ticks: int, warmup: int):
  """``(untimed ticks, timed ticks, micro-batches completed in the timed ticks)``.

  Stream: ``2(J-1) + warmup`` filling ticks then ``ticks``; periodic schedules: whole rounds.
  """
  if pipe.method.delayed:
    fill = schedule_lib.drain_ticks(pipe.num_stages) + warmup
    table = list(pipe.schedule(fill + ticks))
    return table[:fill], table[fill:fill + ticks], ticks
  size = pipe.schedule(0).round_size
  warm_rounds, rounds = math.ceil(warmup / size), math.ceil(ticks / size)
  table = list(pipe.schedule(size * (warm_rounds + rounds)))
  split = len(table) * warm_rounds // (warm_rounds + rounds)
  return table[:split], table[split:], size * rounds


def _all_arrays(state, losses=()):
  """Every array the next tick depends on, and the losses."""
  return state.train_states, state.inbox, state.grad_inbox, state.buffers, list(losses)


def tick_wall_ms(pipe, state, images, labels, ticks: int, warmup: int):
  """``(state, ms)``: the final state and the timed ticks' wall ms per completed micro-batch."""
  batch = lambda m: (images, labels)  # noqa: E731
  warm, timed, done = segments(pipe, ticks, warmup)
  state, _ = pipe.run(state, warm, batch)
  jax.block_until_ready(_all_arrays(state))
  start = time.perf_counter()
  state, outs = pipe.run(state, timed, batch)
  jax.block_until_ready(_all_arrays(state, [o.loss for o in outs]))
  return state, 1e3 * (time.perf_counter() - start) / done


def device_ms(pipe, state, images, labels, iters: int) -> float:
  """Median ms of one micro-batch's jitted steps, each called alone and waited for."""
  if pipe.method.pipelined:
    rows, _ = stage_times(pipe, state, images, labels, iters, warmup=1)
    return float(sum(stage_cost([r["forward"] for r in rows], [r["backward"] for r in rows])))
  box = {"states": state.train_states}

  def step():
    box["states"], loss = pipe.steps.backprop(box["states"], images, labels)
    return box["states"], loss
  return median_ms(step, iters, warmup=1)


def measure(cfg: ml_collections.ConfigDict, ticks: int, warmup: int, seed: int = 0) -> dict:
  """One result row for the config of :func:`run_config`."""
  info = data_lib.get_dataset_info(cfg.dataset)
  micro = cfg.batch_size // cfg.accumulation_steps
  pipe, _, _ = assembly.build_pipeline(cfg, "", info, micro, _STEPS_PER_EPOCH)
  images, labels = random_batch(info.image_shape, info.num_classes, micro, seed)
  state = pipe.init(seed, images)
  state, tick_ms = tick_wall_ms(pipe, state, images, labels, ticks, warmup)
  dev_ms = device_ms(pipe, state, images, labels, ticks)
  return {"method": cfg.method, "micro_batch": micro, "dtype": cfg.dtype,
          "images_per_s": 1e3 * micro / tick_ms, "tick_ms": tick_ms, "device_ms": dev_ms,
          "busy_fraction": dev_ms / tick_ms, "host_us_per_tick": 1e3 * (tick_ms - dev_ms),
          "num_stages": pipe.num_stages}


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


def benchmark(args: argparse.Namespace) -> dict:
  """Every row of the grid, the reconstruction errors, device and versions."""
  results = [measure(run_config(args.model, args.dataset, args.width, m, b, d,
                                args.accumulation_steps), args.ticks, args.warmup)
             for m in args.methods for b in args.micro_batches for d in args.dtypes]
  info = data_lib.get_dataset_info(args.dataset)
  stages = cli.build(args.model, args.dataset, args.width)
  images, _ = random_batch(info.image_shape, info.num_classes, max(args.micro_batches))
  variables = init_variables(stages, images)
  dev = jax.devices()[0]
  return {"device": {"kind": dev.device_kind, "platform": dev.platform},
          "versions": _versions(), "model": args.model, "dataset": args.dataset,
          "width": args.width, "accumulation_steps": args.accumulation_steps,
          "ticks": args.ticks, "warmup": args.warmup, "results": results,
          "reconstruction_error": {p: reconstruction_error(stages, variables, images, p)
                                   for p in MATMUL_PRECISIONS}}


def _print_report(r: dict) -> None:
  print(f"{r['model']} width {r['width']} on {r['device']['kind']} ({r['device']['platform']}); "
        f"jax {r['versions']['jax']}")
  print(f"{'method':<9}{'B':>5} {'dtype':<9}{'images/s':>10}{'tick ms':>10}{'device ms':>11}"
        f"{'busy':>7}{'host us':>10}")
  for x in r["results"]:
    print(f"{x['method']:<9}{x['micro_batch']:>5} {x['dtype']:<9}{x['images_per_s']:10.1f}"
          f"{x['tick_ms']:10.2f}{x['device_ms']:11.2f}{x['busy_fraction']:7.2f}"
          f"{x['host_us_per_tick']:10.0f}")
  e = r["reconstruction_error"]
  print(f"reconstruction error ||x~ - x||/||x||: matmul precision default {e['default']:.2e}, "
        f"highest {e['highest']:.2e}")


def _csv(kind, choices: Optional[Sequence[str]] = None):
  """An argparse type: a comma-separated list of ``kind`` (in ``choices``)."""
  def parse(text: str) -> list:
    try:
      values = [kind(v) for v in text.split(",") if v.strip()]
    except ValueError:
      raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list") from None
    bad = [v for v in values if (v not in choices if choices else v < 1)]
    if not values or bad:
      need = f"choose from {', '.join(choices)}" if choices else "each at least 1"
      raise argparse.ArgumentTypeError(f"bad value(s) {bad or text!r}: {need}")
    return values
  return parse


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
  """The flags of the module docstring; a bad one exits with status 2."""
  p = argparse.ArgumentParser(prog="python -m petra_jax.benchmarks.accelerator",
                              description=__doc__.splitlines()[0])
  p.add_argument("--model", default="revnet18", type=cli.model_name,
                 help="a zoo name or MODULE:FUNCTION (docs/api.md)")
  p.add_argument("--dataset", default="cifar10", choices=sorted(data_lib.DATASETS),
                 help="fixes the image size, stem and classes (default cifar10)")
  p.add_argument("--width", type=int, default=64, help="base width (paper: 64)")
  p.add_argument("--micro-batches", type=_csv(int), default=[64, 256],
                 help="comma-separated micro-batch sizes, one measurement each (default 64,256)")
  p.add_argument("--dtypes", type=_csv(str, DTYPES), default=["float32", "bfloat16"],
                 help=f"comma-separated compute dtypes among {DTYPES} (default: both)")
  p.add_argument("--methods", type=_csv(str, METHODS), default=list(METHODS),
                 help=f"comma-separated methods among {tuple(METHODS)} (default: all)")
  p.add_argument("--accumulation-steps", type=int, default=4, help="k, micro-batches per update")
  p.add_argument("--ticks", type=int, default=20, help="measured micro-batches (N)")
  p.add_argument("--warmup", type=int, default=2, help="unmeasured micro-batches first")
  p.add_argument("--json", action="store_true", help="print JSON")
  args = p.parse_args(argv)
  for flag in ("width", "accumulation_steps", "ticks", "warmup"):
    if getattr(args, flag) < 1:
      p.error(f"--{flag.replace('_', '-')} must be at least 1")
  return args


def main(argv: Optional[Sequence[str]] = None) -> int:
  """``python -m petra_jax.benchmarks.accelerator``."""
  args = parse_args(argv)
  return cli.emit(benchmark(args), args.json, _print_report)


if __name__ == "__main__":
  sys.exit(main())
