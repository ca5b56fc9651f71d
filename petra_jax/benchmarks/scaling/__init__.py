"""Measured multi-process speed-up of PETRA on the CPU, one core per process.

``python -m petra_jax.benchmarks.scaling --processes=2 [--model=revnet18 --width=8
--stage-sizes=1,2,2,5 --batch-size=64 --rounds=3 --iters=20 --warmup=5] [--json]`` measures
images/s of backprop and single-process PETRA in one process pinned to ``N`` cores, and of PETRA
split over ``N`` ``jax.distributed`` processes each pinned to one core (``pin_to_cores``).
Reports ``measured_speedup``, ``simulated_speedup`` (``throughput.simulated_speedup`` of the
per-process compute and measured transfers), ``efficiency`` = measured / simulated, and under
``limits`` the thread slowdown, load balance, transfer round trips and host loop per tick.
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from typing import Optional, Sequence

from petra_jax import models
from petra_jax.benchmarks import cli
from petra_jax.benchmarks.scaling.processes import RESULT, measure
from petra_jax.benchmarks.scaling.roles import run_single, run_worker, stage_sizes
from petra_jax.benchmarks.throughput import simulated_speedup
from petra_jax.engine.pipeline import assign_devices


# ``python -m petra_jax.benchmarks.scaling.PART`` imports this package, which imports its parts,
# before runpy runs the part (it then prints where its command lives); runpy's warning that the
# part is already imported says nothing to the user.
warnings.filterwarnings("ignore", message=r"'petra_jax\.benchmarks\.scaling\.\w+' found in sys\.modules",
                        category=RuntimeWarning)


def report(args, single: dict, multi: dict) -> dict:
  """The JSON report from the single- and multi-process runs."""
  N, J = args.processes, len(single["stage_ms"])
  owner = assign_devices(J, list(range(N)))  # stage j -> its process
  group_ms = [sum(c for c, p in zip(single["stage_ms"], owner) if p == i) for i in range(N)]
  one_thread = multi["group_ms_1thread"]
  send_f, send_b = _sends(multi["transfer"], owner, N)
  ips = {"backprop": single["images_per_s"]["backprop"],
         "petra_single_process": single["images_per_s"]["petra"],
         "petra_multiprocess": multi["images_per_s"]}
  measured = ips["petra_multiprocess"] / ips["petra_single_process"]
  simulated = simulated_speedup(group_ms, send_f, send_b)
  predicted_tick = sum(one_thread) / simulated_speedup(one_thread, send_f, send_b)
  return {
      "processes": N, "model": args.model, "width": args.width, "dataset": args.dataset,
      "batch_size": args.batch_size, "num_stages": J, "stage_process": owner,
      "cores": {"single_process": single["cores"], "per_process": 1},
      "images_per_s": ips,
      "measured_speedup": measured,
      "speedup_vs_backprop": ips["petra_multiprocess"] / ips["backprop"],
      "simulated_speedup": simulated,
      "efficiency": measured / simulated,
      # predicted tick (one-core compute + transfers) / measured tick
      "efficiency_one_core": predicted_tick / (1e3 * args.batch_size / ips["petra_multiprocess"]),
      "limits": {
          "stage_ms_single_process": single["stage_ms"],
          "group_ms_single_process": group_ms,
          "group_ms_1thread": one_thread,
          "thread_slowdown": sum(one_thread) / sum(group_ms),
          "load_balance": max(one_thread) / (sum(one_thread) / N),
          "transfer": multi["transfer"],
          "host_ms_per_tick": multi["host_ms_per_tick"],
          "host_cpu_ms_per_tick": multi["host_cpu_ms_per_tick"],
          "measured_ms_per_tick": 1e3 * args.batch_size / ips["petra_multiprocess"],
          "predicted_ms_per_tick": predicted_tick,
      },
  }


def _sends(transfers: list, owner: list, N: int) -> tuple[list, list]:
  """Per process, ms per tick sending forward / backward: each boundary's round trip split
  in proportion to the two directions' bytes."""
  send_f, send_b = [0.0] * N, [0.0] * N
  for t in transfers:
    share = t["bytes_forward"] / (t["bytes_forward"] + t["bytes_backward"])
    send_f[owner[t["boundary"] - 1]] += share * t["round_trip_ms"]
    send_b[owner[t["boundary"]]] += (1 - share) * t["round_trip_ms"]
  return send_f, send_b


def print_table(r: dict) -> None:
  """The report as a readable table."""
  ips, lim = r["images_per_s"], r["limits"]
  print(f"{r['model']} width {r['width']}, {r['num_stages']} stages (process of each: "
        f"{r['stage_process']}), micro-batch {r['batch_size']}")
  print(f"{'run':<40}{'images/s':>10}")
  print(f"{'backprop, 1 process, ' + str(len(r['cores']['single_process'])) + ' cores':<40}"
        f"{ips['backprop']:10.1f}")
  print(f"{'PETRA, 1 process, ' + str(len(r['cores']['single_process'])) + ' cores':<40}"
        f"{ips['petra_single_process']:10.1f}")
  print(f"{'PETRA, ' + str(r['processes']) + ' processes, 1 core each':<40}"
        f"{ips['petra_multiprocess']:10.1f}")
  print(f"measured speed-up {r['measured_speedup']:.2f}x (vs backprop "
        f"{r['speedup_vs_backprop']:.2f}x), simulated {r['simulated_speedup']:.2f}x, "
        f"efficiency {r['efficiency']:.2f}")
  print(f"limits: compute per tick per process {_ms(lim['group_ms_single_process'])} ms on "
        f"the single process's cores, {_ms(lim['group_ms_1thread'])} ms on one core "
        f"(thread slowdown {lim['thread_slowdown']:.2f}x, load balance "
        f"{lim['load_balance']:.2f}); transfer round trip per tick "
        f"{_ms([t['round_trip_ms'] for t in lim['transfer']])} ms; host loop "
        f"{lim['host_ms_per_tick']:.1f} ms per tick in run_tick ({lim['host_cpu_ms_per_tick']:.1f} "
        f"ms of its CPU); tick measured "
        f"{lim['measured_ms_per_tick']:.1f} ms, predicted {lim['predicted_ms_per_tick']:.1f} ms")


def _ms(values) -> str:
  return "[" + ", ".join(f"{v:.1f}" for v in values) + "]"


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
  """The command's flags; ``--role`` is internal."""
  p = cli.parser("petra_jax.benchmarks.scaling", __doc__, model="revnet18", dataset="cifar10",
                 width=8, batch_size=64, batch_help="micro-batch size")
  p.add_argument("--processes", type=int, default=2, help="jax.distributed processes (>= 2)")
  p.add_argument("--depth", type=int, default=0, help="revnet_fixed's blocks (0: default)")
  p.add_argument("--stage-sizes", default="1,2,2,5",
                 help="blocks per stage, comma-separated (configs/cifar10_cpu.py's; '' for one "
                      "block per stage)")
  p.add_argument("--rounds", type=int, default=3, help="timed rounds (the median is reported)")
  p.add_argument("--iters", type=int, default=20, help="steps (ticks) per timed round")
  p.add_argument("--warmup", type=int, default=5, help="untimed steps first")
  p.add_argument("--repeats", type=int, default=1,
                 help="alternate the single- and multi-process runs this many times (medians)")
  p.add_argument("--image-size", type=int, default=None, help="override the image side")
  p.add_argument("--timeout", type=float, default=1800, help="seconds per run")
  p.add_argument("--json", action="store_true", help="print JSON")
  p.add_argument("--role", default="driver", choices=("driver", "single", "worker"),
                 help=argparse.SUPPRESS)
  return p.parse_args(argv)


def _check(args) -> None:
  """Exits with one line naming the fix for a bad argument."""
  try:
    num_blocks = len(models.build_model(args.model, width=1, depth=args.depth or None))
  except ValueError as e:  # e.g. a depth for a model whose block counts are fixed
    sys.exit(f"error: {e}")
  try:
    sizes = stage_sizes(args)
  except ValueError:
    sys.exit(f"error: --stage-sizes={args.stage_sizes}: give comma-separated block counts, "
             "e.g. 1,2,2,5.")
  if sizes and (sum(sizes) != num_blocks or min(sizes) < 1 or len(sizes) < 2):
    sys.exit(f"error: --stage-sizes={args.stage_sizes}: give at least 2 positive block counts "
             f"summing to {args.model}'s {num_blocks} blocks ('' for one block per stage).")
  num_stages = len(sizes) or num_blocks
  if not 2 <= args.processes <= num_stages:
    sys.exit(f"error: --processes={args.processes}: use 2 to {num_stages} (the number of "
             "stages; --stage-sizes sets it).")
  if min(args.rounds, args.iters, args.batch_size, args.repeats) < 1 or args.warmup < 0:
    sys.exit("error: --rounds, --iters, --repeats and --batch-size must be >= 1, "
             "--warmup >= 0.")


def main(argv: Optional[Sequence[str]] = None) -> int:
  """``python -m petra_jax.benchmarks.scaling``."""
  args = parse_args(argv)
  if args.role == "single":
    print(RESULT + json.dumps(run_single(args)), flush=True)
    return 0
  if args.role == "worker":
    result = run_worker(args)
    if result is not None:
      print(RESULT + json.dumps(result), flush=True)
    return 0
  _check(args)
  return cli.emit(report(args, *measure(args)), args.json, print_table)

