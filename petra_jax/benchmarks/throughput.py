"""Time per training step: backprop, revprop and PETRA (paper Tables 1 and 5).

``python -m petra_jax.benchmarks.throughput --model=revnet18 --dataset=cifar10 --batch-size=64
[--width=W] [--iters=N] [--json] [--host]`` times, on one device, the median ms of one step
(one micro-batch through every stage, forward and backward) and of each stage's steps and sends,
then simulates PETRA, GPipe and 1F1B on ``J`` devices and balances stages on ``J' < J``.
``--host`` measures the engine's host cost per tick instead (``benchmarks.host``).
"""

from __future__ import annotations

import os
import sys

_DEVICE_FLAG = "--xla_force_host_platform_device_count"


def _request_cpu_devices(count: int) -> None:
  """Asks XLA for ``count`` virtual CPU devices (before JAX starts) unless a count is set."""
  flags = os.environ.get("XLA_FLAGS", "")
  if _DEVICE_FLAG not in flags:
    os.environ["XLA_FLAGS"] = f"{flags} {_DEVICE_FLAG}={count}".strip()


if __name__ == "__main__":  # before JAX starts: one device to run, one to send to
  _request_cpu_devices(2)

import statistics  # noqa: E402
from typing import Optional, Sequence  # noqa: E402

from petra_jax.benchmarks import simulate  # noqa: E402
from petra_jax.engine.stages import partition  # noqa: E402
from petra_jax import data as data_lib  # noqa: E402
from petra_jax.benchmarks import cli, host, reversible_backward  # noqa: E402
from petra_jax.benchmarks.memory.model import stage_bytes, stored_bytes  # noqa: E402
from petra_jax.engine.arrays import quantize as quantize_lib  # noqa: E402
from petra_jax.engine import schedules as schedule  # noqa: E402
from petra_jax.engine.periods import PERIODS_PER_DISPATCH  # noqa: E402
from petra_jax.engine.stages.partition import balanced_partition, equal_partition, group_cost  # noqa: E402
from petra_jax.engine.pipeline import Pipeline  # noqa: E402
from petra_jax.engine.stages.stage import Stage, has_reversible  # noqa: E402
from petra_jax.engine.timing import median_ms, stage_cost, stage_times  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

PAPER_SPEEDUP = {"revnet18": 3.0, "revnet34": 2.4}  # Table 5, 10 / 18 GPUs


def _pipeline_arrays(state):
  """Every array the next tick depends on (to wait for a whole tick)."""
  return state.train_states, [box for box in state.inbox + state.grad_inbox]


def step_times(pipes: dict, images, labels, iters: int, warmup: int = 1, seed: int = 0):
  """``({"backprop": ms, "revprop": ms, "petra": ms}, petra state)``, medians of interleaved rounds.

  ``petra`` is one tick of the full stream (after ``2(J-1)`` filling ticks).
  """
  batch = lambda m: (images, labels)  # noqa: E731
  states = {name: pipe.init(seed, images) for name, pipe in pipes.items()}
  petra = pipes["petra"]
  table = petra.schedule(schedule.drain_ticks(petra.num_stages) + warmup + iters + 1)
  ticks = iter(table)
  for _ in range(schedule.drain_ticks(petra.num_stages)):  # fill: every stage busy
    states["petra"], _ = petra.run_tick(states["petra"], next(ticks), batch)

  def one_step(name):
    def step():
      if name == "petra":
        states[name], out = petra.run_tick(states[name], next(ticks), batch)
        return _pipeline_arrays(states[name]), out[0].loss
      states[name], out = pipes[name].run(states[name], pipes[name].schedule(1), batch)
      return states[name].train_states, out[0].loss
    return step

  times = {k: [] for k in pipes}
  for i in range(warmup + iters):
    for name in pipes:
      t = median_ms(one_step(name), iters=1, warmup=0)
      if i >= warmup:
        times[name].append(t)
  return {k: statistics.median(v) for k, v in times.items()}, states["petra"]


def transfer_times(pipe: Pipeline, acts: Sequence, src: jax.Device, dst: jax.Device,
                   iters: int, warmup: int = 1) -> list[dict]:
  """Per stage, median ms and bytes of ``device_put(src -> dst)`` of its sends per tick.

  ``acts``: stage inputs ``[images, x_1, ..., x_{J-1}]``. Forward sends ``x_{j+1}``,
  backward ``(x~_j, delta_j)`` (``x~_j`` only if stage ``j-1`` reconstructs).
  """
  J = pipe.num_stages
  acts = [jax.device_put(a, src) for a in acts]

  def put(tree):
    return median_ms(lambda: jax.device_put(tree, dst), iters, warmup)

  rows = []
  for j in range(J):
    fwd = acts[j + 1] if j < J - 1 else None
    bwd = None
    if j > 0:
      bwd = (acts[j], acts[j]) if pipe.reconstructs[j - 1] else (acts[j],)
    rows.append({"send_forward": put(fwd) if fwd is not None else 0.0,
                 "send_backward": put(bwd) if bwd is not None else 0.0,
                 "bytes_forward": quantize_lib.nbytes(fwd),
                 "bytes_backward": quantize_lib.nbytes(bwd)})
  return rows


def simulated_speedup(costs: Sequence[float], send_forward: Optional[Sequence[float]] = None,
                      send_backward: Optional[Sequence[float]] = None) -> float:
  """``sum_j c_j / max_j (c_j + T_j)``: sequential revprop over PETRA's simulated tick."""
  J = len(costs)
  forward = list(costs[:-1]) + [0.0]  # the table needs F_j and B_j; only c_j matters
  backward = [0.0] * (J - 1) + [costs[-1]]
  tick = simulate.ms_per_update("stream", J, 1, forward, backward, send_forward,
                                send_backward)["simulated_ms_per_update"]
  return float(sum(costs)) / tick


def balancing_table(costs, send_forward=None, send_backward=None,
                    group_counts: Sequence[int] = (2, 3, 4, 5, 6, 8),
                    flops: Optional[Sequence[float]] = None) -> list[dict]:
  """Per ``J'``, the simulated speed-up of contiguous groups balanced on time, equal in block
  count, and (with ``flops``) balanced on FLOPs."""
  total = float(sum(costs))
  tick_of = lambda groups: max(group_cost(costs, a, b, send_forward, send_backward)
                               for a, b in groups)
  rows = []
  for g in sorted({k for k in group_counts if 1 <= k <= len(costs)} | {len(costs)}):
    groups, tick = balanced_partition(costs, g, send_forward, send_backward)
    equal = equal_partition(len(costs), g)
    row = {"devices": g, "groups": [list(x) for x in groups], "tick_ms": tick,
           "simulated_speedup": total / tick,
           "equal_groups": [list(x) for x in equal], "equal_tick_ms": tick_of(equal),
           "equal_speedup": total / tick_of(equal)}
    if flops is not None:
      by_flops, _ = balanced_partition(flops, g)
      row.update(flops_groups=[list(x) for x in by_flops],
                 flops_speedup=total / tick_of(by_flops))
    rows.append(row)
  return rows


def schedule_table(rows: Sequence[dict], rows_stored: Sequence[dict], sizes: Sequence[dict],
                   ks: Sequence[int] = (1, 4, 8)) -> dict:
  """``{method: {str(k): simulated ms, bubble fraction, stored bytes per stage}}`` on ``J`` devices.

  ``rows`` are PETRA's stage costs, ``rows_stored`` those of steps recomputing from a
  stored input (GPipe, 1F1B); ``formula_bubble_fraction`` is ``(J-1)/(k+J-1)``.
  """
  J, out = len(rows), {}
  for method, r in (("gpipe", rows_stored), ("1f1b", rows_stored), ("petra", rows)):
    name = "stream" if method == "petra" else method
    out[method] = {}
    for k in ks:
      sim = simulate.ms_per_update(
          name, J, k, [x["forward"] for x in r], [x["backward"] for x in r],
          [x.get("send_forward", 0.0) for x in r], [x.get("send_backward", 0.0) for x in r])
      sim["stored_bytes_per_stage"] = stored_bytes(sizes, method, accumulation_steps=k)
      sim["formula_bubble_fraction"] = 0.0 if name == "stream" else (J - 1) / (k + J - 1)
      out[method][str(k)] = sim
  return out


def _measure(stages, images, labels, iters: int, warmup: int, seed: int):
  """``(ms_per_step, stage rows, recompute stage rows)``, sends included."""
  devices = jax.devices()
  tx = optax.sgd(1e-3, momentum=0.9)
  pipes = {m: Pipeline(stages, tx, devices[:1], method=m) for m in ("backprop", "revprop", "petra")}
  ms, state = step_times(pipes, images, labels, iters, warmup, seed)
  rows, acts = stage_times(pipes["petra"], state, images, labels, iters, warmup)
  flushed = Pipeline(stages, tx, devices[:1], method="1f1b")
  rows_stored, _ = stage_times(flushed, flushed.init(seed, images), images, labels, iters,
                               warmup)
  if len(devices) > 1:
    sends = transfer_times(pipes["petra"], acts, devices[0], devices[1], iters, warmup)
  else:  # nowhere to send to: report compute only
    sends = [{"send_forward": 0.0, "send_backward": 0.0} for _ in rows]
  for row, stored, send in zip(rows, rows_stored, sends):
    row.update(send)
    stored.update(send)
  return ms, rows, rows_stored


def benchmark(stages: Sequence[Stage], input_shape: Sequence[int], num_classes: int,
              batch_size: int, iters: int = 5, warmup: int = 1, seed: int = 0) -> dict:
  """The JSON-able report of every measurement on ``jax.devices()[0]`` (keys as returned)."""
  devices = jax.devices()
  rng = np.random.default_rng(seed)
  images = jax.device_put(
      rng.normal(size=(batch_size, *input_shape)).astype(np.float32), devices[0])
  labels = jax.device_put(rng.integers(0, num_classes, batch_size).astype(np.int32),
                          devices[0])
  ms, rows, rows_stored = _measure(stages, images, labels, iters, warmup, seed)
  costs = stage_cost([r["forward"] for r in rows], [r["backward"] for r in rows])
  flops = partition.block_flops(stages, (batch_size, *input_shape))
  fwd_send = [r["send_forward"] for r in rows]
  bwd_send = [r["send_backward"] for r in rows]
  return {
      "ms_per_step": ms,
      "ratio_petra_backprop": ms["petra"] / ms["backprop"],
      "ratio_revprop_backprop": ms["revprop"] / ms["backprop"],
      "stage_ms": rows,
      "sum_stage_ms": float(sum(costs)),
      "simulated_speedup": simulated_speedup(costs, fwd_send, bwd_send),
      "simulated_speedup_compute_only": simulated_speedup(costs),
      "block_gflops": [f / 1e9 for f in flops],
      "balancing": balancing_table(costs, fwd_send, bwd_send, flops=flops),
      "stage_ms_recompute": rows_stored,
      "schedules": schedule_table(rows, rows_stored,
                                  stage_bytes(stages, input_shape, batch_size)),
      "num_stages": len(stages),
      "batch_size": batch_size,
      "devices": [str(d) for d in devices[:2]],
  }


def _print_report(r: dict, name: str) -> None:
  ms = r["ms_per_step"]
  print(f"{name}: {r['num_stages']} stages, batch {r['batch_size']}, "
        f"ms per step (median):")
  for k in ("backprop", "revprop", "petra"):
    print(f"  {k:<9} {ms[k]:10.1f} ms  ({ms[k] / ms['backprop']:.2f}x backprop)")
  print(f"{'stage':<13}{'F ms':>9}{'B ms':>9}{'send F':>9}{'send B':>9}{'F GFLOP':>9}")
  for r_, gf in zip(r["stage_ms"], r["block_gflops"]):
    print(f"{r_['name']:<13}{r_['forward']:9.1f}{r_['backward']:9.1f}"
          f"{r_['send_forward']:9.2f}{r_['send_backward']:9.2f}{gf:9.2f}")
  print(f"sum of stage costs {r['sum_stage_ms']:.1f} ms; simulated speed-up on "
        f"{r['num_stages']} devices: {r['simulated_speedup']:.2f}x "
        f"({r['simulated_speedup_compute_only']:.2f}x without sends; paper Table 5: "
        f"{PAPER_SPEEDUP.get(name, float('nan'))}x)")
  print("stage balancing: simulated speed-up on J' devices (vs the sequential step) of contiguous")
  print("groups with equal block counts, balanced on FLOPs, balanced on the measured times:")
  print(f"  {'J':>3} {'equal':>7} {'flops':>7} {'time':>7}  blocks per stage (time)")
  for b in r["balancing"]:
    sizes = [last - first + 1 for first, last in b["groups"]]
    print(f"  {b['devices']:>3} {b['equal_speedup']:6.2f}x {b['flops_speedup']:6.2f}x "
          f"{b['simulated_speedup']:6.2f}x  {sizes}")
  print(f"schedules on {r['num_stages']} devices (simulated from the measured stage costs, "
        "sends included): ms per update, bubble fraction (1F1B/GPipe formula), stored MiB")
  for method, by_k in r["schedules"].items():
    for k, v in by_k.items():
      print(f"  {method:<6} k={k:<2} {v['simulated_ms_per_update']:10.1f} ms  bubble "
            f"{v['bubble_fraction']:.3f} ({v['formula_bubble_fraction']:.3f})  stored "
            f"{sum(v['stored_bytes_per_stage']) / 2**20:8.1f} MiB")


def main(argv: Optional[Sequence[str]] = None) -> int:
  """``python -m petra_jax.benchmarks.throughput``."""
  p = cli.parser("petra_jax.benchmarks.throughput", __doc__, model="revnet18",
                 dataset="cifar10", width=64, batch_size=64,
                 width_help="base width (paper: 64)", batch_help="micro-batch size")
  p.add_argument("--iters", type=int, default=5, help="measured calls per timing")
  p.add_argument("--warmup", type=int, default=1, help="unmeasured calls first")
  p.add_argument("--image-size", type=int, default=None,
                 help="override the dataset's image side (tiny smoke runs)")
  p.add_argument("--json", action="store_true", help="print JSON")
  p.add_argument("--host", action="store_true",
                 help="host cost per stage and tick instead (petra_jax.benchmarks.host; "
                      "--iters rounds of --ticks ticks)")
  p.add_argument("--ticks", type=int, default=200, help="ticks per timed round (--host)")
  p.add_argument("--periods-per-dispatch", type=int, default=PERIODS_PER_DISPATCH,
                 help=f"the compiled executor's ticks per call (--host; default "
                      f"{PERIODS_PER_DISPATCH})")
  p.add_argument("--only-reversible-backward", action="store_true", help="that key alone")
  args = p.parse_args(argv)
  shape = cli.image_shape(args.dataset, args.image_size)
  stages = cli.build(args.model, args.dataset, args.width)
  num_classes = data_lib.DATASETS[args.dataset].num_classes
  if args.host:
    report = host.benchmark(stages, shape, num_classes, args.batch_size, args.ticks, args.iters,
                            periods=args.periods_per_dispatch)
    report.update(model=args.model, dataset=args.dataset, width=args.width)
    return cli.emit(report, args.json, lambda r: host.print_report(r, args.model))
  report = ({} if args.only_reversible_backward else
            benchmark(stages, shape, num_classes, args.batch_size, args.iters, args.warmup))
  if has_reversible(stages):
    report["reversible_backward"] = reversible_backward.measure(
        stages, shape, args.batch_size, args.iters, args.warmup)
  report.update(model=args.model, dataset=args.dataset, width=args.width)
  return cli.emit(report, args.json, lambda r: (
      "ms_per_step" in r and _print_report(r, args.model),
      "reversible_backward" in r and reversible_backward.print_report(r["reversible_backward"])))


if __name__ == "__main__":
  sys.exit(main())
