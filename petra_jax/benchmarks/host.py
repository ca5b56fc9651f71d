"""The engine's host cost per stage and tick, and the tiny-model tick/step ratio.

``python -m petra_jax.benchmarks.host [--model=revnet18 --dataset=cifar10 --width=2
--batch-size=2 --ticks=200 --iters=3 --periods-per-dispatch=64 --unroll-ticks=4] [--json]``
(or
``python -m petra_jax.benchmarks.throughput ... --host``) runs :func:`benchmark`.

**Isolation method.** Two PETRA pipelines of the same stages run the same
stream tick table on one device: the *real* one, and a *hollow* one whose
every jitted step (forward, backward, the last stage's loss step, predictor)
is replaced by a jitted no-op of the same signature and donation
(:func:`noop_step`: the body traces the real step only for
``jax.eval_shape`` and returns zeros of its output shapes). Both are filled (``2(J-1)`` ticks, every step compiled) and
warmed up; then ``ticks`` steady-state ticks (every stage runs a forward and a
backward) are run back to back, the ticks' task tuples built before the
clock starts, and the clock stops after ``jax.block_until_ready`` of the
final state. For the hollow pipeline the devices have next to nothing to do,
so the time is the host's: every jit dispatch, message move and the engine's
bookkeeping. ``host_us_per_stage_tick`` is that time over ``ticks x J``.

The same clock gives the real tiny-model numbers: ms per steady-state PETRA
tick (one micro-batch through every stage, forward and backward) and per
``backprop`` step (``jax.grad`` of the composed model, one jitted call), run
back to back in the same way, and their ratio. Each figure is the median of
``repeats`` rounds, the variants interleaved within a round so that a
drifting machine affects them alike. ``ticks_per_second`` (``1e6 / (J x
host_us_per_stage_tick)``) is how many ticks one host loop can drive at
``J`` stages when the devices cost nothing.
"""

from __future__ import annotations

import statistics
import sys
import time
from typing import Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from petra_jax import data as data_lib
from petra_jax.benchmarks import cli
from petra_jax.engine import compiled
from petra_jax.engine.periods import ORDER_WRITES, PERIODS_PER_DISPATCH, UNROLL_TICKS
from petra_jax.engine import schedules as schedule
from petra_jax.engine.pipeline import Pipeline
from petra_jax.engine.stages.stage import Stage


EXECUTORS = tuple(e for e in compiled.EXECUTORS if e != "auto")  # each timed side by side


def noop_step(fn: Callable) -> Callable:
  """A step with ``fn``'s signature and output shapes that computes nothing:
  jitted with ``fn``'s donation, it costs the host what dispatching ``fn`` costs."""
  def body(*args):
    shapes = jax.eval_shape(fn, *args)
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
  return body


def hollow_pipeline(stages: Sequence[Stage], tx, device, method: str = "petra") -> Pipeline:
  """A pipeline whose steps compute nothing (see the module docstring)."""
  return Pipeline(stages, tx, [device], method=method, step_wrap=noop_step)


class _Driver:
  """One pipeline run over a long stream table by an executor (``host`` or ``compiled``)."""

  def __init__(self, pipe: Pipeline, images, labels, num_ticks: int, seed: int,
               executor: str = "host", periods: int = PERIODS_PER_DISPATCH,
               unroll_ticks: int = UNROLL_TICKS, order_writes: bool = ORDER_WRITES):
    self.pipe, self.batch = pipe, (lambda m: (images, labels))
    self.state = pipe.init(seed, images)
    self.table = pipe.schedule(num_ticks)
    self.executor = compiled.executor(pipe, executor, periods, unroll_ticks, order_writes)
    self.next = 0

  def run(self, n: int) -> float:
    """Seconds to run the next ``n`` ticks (at least), waited for at the end."""
    end, state = self.next + n, self.state
    start = time.perf_counter()
    while self.next < end:
      state, _, ran = self.executor.advance(state, self.table, self.next, self.batch, limit=end)
      self.next += ran
    state.block_until_ready()  # as stored (a compiled call's carry is not converted)
    self.state = state
    return time.perf_counter() - start


def _backprop_seconds(pipe: Pipeline, state_box: list, images, labels, n: int) -> float:
  """Seconds for ``n`` backprop steps back to back, waited for at the end."""
  table = pipe.schedule(1)[0]
  batch = lambda m: (images, labels)  # noqa: E731
  start = time.perf_counter()
  state = state_box[0]
  for _ in range(n):
    state, _ = pipe.run_tick(state, table, batch)
  state.block_until_ready()
  state_box[0] = state
  return time.perf_counter() - start


def _random_batch(input_shape, num_classes: int, batch_size: int, seed: int, device) -> tuple:
  """``(images float32[B, *input_shape], labels int32[B])`` on ``device``, from ``seed``."""
  rng = np.random.default_rng(seed)
  images = rng.normal(size=(batch_size, *input_shape)).astype(np.float32)
  labels = rng.integers(0, num_classes, batch_size).astype(np.int32)
  return jax.device_put(images, device), jax.device_put(labels, device)


def benchmark(stages: Sequence[Stage], input_shape: Sequence[int], num_classes: int,
              batch_size: int, ticks: int = 200, repeats: int = 5, seed: int = 0,
              periods: int = PERIODS_PER_DISPATCH, executors: Sequence[str] = EXECUTORS,
              unroll_ticks: Sequence[int] = (UNROLL_TICKS,),
              order_writes: bool = ORDER_WRITES) -> dict:
  """Host cost per stage and tick, and the real PETRA tick against backprop.

  Args:
    stages: the model (``J`` stages).
    input_shape: one example's shape, e.g. ``(32, 32, 3)``.
    num_classes: classes of the head.
    batch_size: micro-batch size.
    ticks: ticks (or backprop steps) per timed round.
    repeats: timed rounds; every figure is their median.
    seed: initialisation and data seed.
    periods: the compiled executor's ticks per call.
    executors: those timed (:data:`EXECUTORS`), side by side in every round.
    unroll_ticks: the compiled executor's ticks per loop iteration; each value is timed side
      by side, the first gives the ``compiled_*`` figures.
    order_writes: whether the compiled executor orders its carried writes.

  Returns:
    A JSON-able dict: ``host_us_per_stage_tick``, ``ticks_per_second``,
    ``petra_ms_per_tick``, ``backprop_ms_per_step``,
    ``ratio_petra_backprop``, the same three with the compiled executor
    (``compiled_*``; per value of ``unroll_ticks`` in ``compiled_by_unroll_ticks``), ``num_stages``, ``ticks``, ``repeats``,
    ``batch_size``, ``device`` and the per-round lists ``rounds_*``.
  """
  J, device = len(stages), jax.devices()[0]
  images, labels = _random_batch(input_shape, num_classes, batch_size, seed, device)
  tx = optax.sgd(1e-3, momentum=0.9)
  fill = schedule.drain_ticks(J) + 2
  total = fill + (repeats + 1) * ticks + 1
  variants = [("", "host", 1)] if "host" in executors else []
  if "compiled" in executors:
    variants += [(f"_compiled_u{u}", "compiled", u) for u in unroll_ticks]
  drivers = {}
  for suffix, executor, unroll in variants:
    make = lambda pipe, e=executor, u=unroll: _Driver(  # noqa: E731
        pipe, images, labels, total, seed, e, periods, u, order_writes)
    drivers["hollow" + suffix] = make(hollow_pipeline(stages, tx, device))
    drivers["petra" + suffix] = make(Pipeline(stages, tx, [device]))
  backprop = Pipeline(stages, tx, [device], method="backprop")
  bp_state = [backprop.init(seed, images)]
  for d in drivers.values():  # fill, compile and warm up
    d.run(fill)
    d.run(ticks)
  _backprop_seconds(backprop, bp_state, images, labels, max(2, ticks // 10))
  rounds = {name: [] for name in [*drivers, "backprop"]}
  for _ in range(repeats):
    for name, d in drivers.items():
      rounds[name].append(d.run(ticks) / ticks)
    rounds["backprop"].append(_backprop_seconds(backprop, bp_state, images, labels, ticks) / ticks)
  return {**_figures({k: statistics.median(v) for k, v in rounds.items()}, J, periods,
                      unroll_ticks),
          "num_stages": J, "ticks": ticks, "repeats": repeats, "batch_size": batch_size,
          "device": str(device),
          **{f"rounds_{k}_ms": [1e3 * x for x in v] for k, v in rounds.items()}}


def _figures(med: dict, J: int, periods: int, unroll_ticks: Sequence[int]) -> dict:
  """The report's figures from the median seconds per tick of each variant (``med``)."""
  out = {"host_us_per_stage_tick": 1e6 * med["hollow"] / J,
         "ticks_per_second": 1.0 / med["hollow"],
         "petra_ms_per_tick": 1e3 * med["petra"],
         "backprop_ms_per_step": 1e3 * med["backprop"],
         "ratio_petra_backprop": med["petra"] / med["backprop"]}
  by_unroll = {u: {"host_us_per_stage_tick": 1e6 * med[f"hollow_compiled_u{u}"] / J,
                   "petra_ms_per_tick": 1e3 * med[f"petra_compiled_u{u}"],
                   "ratio_petra_backprop": med[f"petra_compiled_u{u}"] / med["backprop"]}
               for u in unroll_ticks if f"hollow_compiled_u{u}" in med}
  if by_unroll:
    first = by_unroll[unroll_ticks[0]]
    out.update({"compiled_" + k: v for k, v in first.items()},
               compiled_by_unroll_ticks={str(u): f for u, f in by_unroll.items()},
               periods_per_dispatch=periods)
  return out


def print_report(r: dict, name: str) -> None:
  """The human-readable form of :func:`benchmark`'s report."""
  print(f"{name}: {r['num_stages']} stages, batch {r['batch_size']}, {r['device']}, "
        f"median of {r['repeats']} rounds of {r['ticks']} ticks:")
  print(f"  host cost per stage and tick (no-op steps) {r['host_us_per_stage_tick']:8.1f} us"
        f"  ({r['ticks_per_second']:.0f} ticks/s at {r['num_stages']} stages)")
  print(f"  PETRA tick {r['petra_ms_per_tick']:.3f} ms, backprop step "
        f"{r['backprop_ms_per_step']:.3f} ms: {r['ratio_petra_backprop']:.2f}x")
  for u, f in r.get("compiled_by_unroll_ticks", {}).items():
    print(f"  compiled executor ({r['periods_per_dispatch']} ticks per call, {u} per loop "
          f"iteration): host cost per stage and tick {f['host_us_per_stage_tick']:8.1f} us, "
          f"PETRA tick {f['petra_ms_per_tick']:.3f} ms: {f['ratio_petra_backprop']:.2f}x backprop")



def main(argv: Optional[Sequence[str]] = None) -> int:
  """``python -m petra_jax.benchmarks.host``: :func:`benchmark` on a tiny model, printed or
  as one JSON line (``--json``)."""
  p = cli.parser("petra_jax.benchmarks.host", __doc__, model="revnet18", dataset="cifar10",
                 width=2, batch_size=2, batch_help="micro-batch size (default 2)")
  p.add_argument("--ticks", type=int, default=200, help="ticks per timed round")
  p.add_argument("--iters", type=int, default=3, help="timed rounds (the median is reported)")
  cli.add_compiled_flags(p, lists=("unroll_ticks",))
  p.add_argument("--json", action="store_true", help="print JSON")
  args = p.parse_args(argv)
  stages = cli.build(args.model, args.dataset, args.width)
  report = benchmark(stages, cli.image_shape(args.dataset),
                     data_lib.DATASETS[args.dataset].num_classes, args.batch_size, args.ticks,
                     args.iters, periods=args.periods_per_dispatch, unroll_ticks=args.unroll_ticks,
                     order_writes=args.order_writes)
  report.update(model=args.model, dataset=args.dataset, width=args.width)
  return cli.emit(report, args.json, lambda r: print_report(r, args.model))


if __name__ == "__main__":
  sys.exit(main())
