"""Measured multi-process speed-up of PETRA on this machine (CPU, one core per process).

``python -m petra_jax.benchmarks.scaling --processes=2 [--model=revnet18 --width=8
--stage-sizes=1,2,2,5 --batch-size=64 --rounds=3 --iters=20 --warmup=5] [--json]``
measures, in one invocation and back to back, the training throughput
(images/s, warm-up excluded, median over ``rounds`` rounds of ``iters``
steps) of:

* ``backprop`` and single-process ``petra`` (every stage on one device),
  interleaved round by round, in one process pinned to ``N`` cores (XLA's
  intra-op thread pool then has ``N`` threads);
* ``petra`` with its stages split over ``N`` ``jax.distributed`` processes
  (``launch/local.sh N``; stage ``j`` on process ``j*N//J``), process ``i``
  pinned to core ``i`` (one XLA thread each), messages between processes
  through :mod:`petra_jax.engine.transport` (gloo).

Pinning: XLA sizes its CPU thread pools from the process's CPU affinity mask
(``sched_getaffinity``, as ``taskset`` sets it) when its client starts, so each
process sets the affinity of all its threads (:func:`pin_to_cores`) before
JAX starts its backend; ``--xla_cpu_multi_thread_eigen=false`` keeps Eigen's
kernels single-threaded too. ``XLA_FLAGS=intra_op_parallelism_threads=1`` is
not an XLA flag (a TensorFlow session option) and the Eigen flag alone still
lets a process use both cores (measured: 1.7 cores busy); the affinity does
not (``ps -L -o psr`` shows each process's threads on its own core).

Reported (``--json``): ``images_per_s`` of the three runs, ``measured_speedup``
(multi-process PETRA over single-process PETRA), ``speedup_vs_backprop``,
``simulated_speedup`` (the schedule's prediction for ``N`` devices each as fast
as the single process: :func:`petra_jax.benchmarks.throughput.simulated_speedup`
of the per-process compute measured in the single process, with the measured
transfers), ``efficiency`` = measured / simulated, and under ``limits`` what
explains the gap:

* ``group_ms_1thread`` and ``thread_slowdown``: each process's compute per
  tick on its one core (timed in the workers), and its sum over the same on
  the single process's ``N`` cores: the intra-op parallelism a process loses;
* ``load_balance``: the slowest process's one-core compute over the mean;
* ``transfer``: per process boundary, the bytes of one tick's messages and
  the median round trip (ms) of sending them (:mod:`petra_jax.engine.transport`);
* ``host_cpu_ms_per_tick``: CPU time of process 0's host loop per tick
  (dispatching its stages' steps and transfers; on one core it competes with
  the compute), and ``host_ms_per_tick`` its wall time in ``run_tick``
  (which also waits whenever XLA's queue of in-flight computations is full);
* ``predicted_ms_per_tick``: the schedule's tick from the one-core compute and
  the transfers, against ``measured_ms_per_tick``; what is left between them
  is the host loop and the processes waiting on each other.

Each figure is the median over ``--rounds`` (and ``--repeats``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Optional, Sequence

_EIGEN_FLAG = "--xla_cpu_multi_thread_eigen=false"
_RESULT = "RESULT "
_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def pin_to_cores(cores: Sequence[int]) -> list[int]:
  """Sets the CPU affinity of every thread of this process to ``cores``.

  Call before JAX starts its backend: XLA sizes its thread pools from the
  affinity mask then, and threads created later inherit it.

  Args:
    cores: CPU indices (from ``os.sched_getaffinity(0)``).

  Returns:
    The cores set, sorted.

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


import petra_jax  # noqa: E402,F401  (applies the XLA-CPU work-around)
import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from petra_jax import data as data_lib  # noqa: E402
from petra_jax import models  # noqa: E402
from petra_jax.engine import schedule  # noqa: E402
from petra_jax.engine import timing  # noqa: E402
from petra_jax.benchmarks.throughput import simulated_speedup  # noqa: E402
from petra_jax.engine.pipeline import Pipeline, assign_devices  # noqa: E402


# ----------------------------------------------------------------------------
# The model and its inputs (the same in every process).
# ----------------------------------------------------------------------------

def build_stages(args) -> list:
  """The model's blocks grouped as ``--stage-sizes`` (one block per stage if empty)."""
  d = data_lib.DATASETS[args.dataset]
  blocks = models.build_model(args.model, width=args.width, num_classes=d.num_classes,
                              imagenet_stem=d.imagenet_stem, depth=args.depth or None)
  sizes = _sizes(args)
  return models.group_stages(blocks, sizes) if sizes else blocks


def _sizes(args) -> list[int]:
  return [int(s) for s in args.stage_sizes.split(",") if s.strip()]


def _micro_batch(args, device):
  """A fixed random micro-batch ``(float32[B, H, W, C], int32[B])`` on ``device``."""
  d = data_lib.DATASETS[args.dataset]
  shape = d.image_shape if args.image_size is None else (args.image_size, args.image_size, 3)
  rng = np.random.default_rng(0)
  images = rng.normal(size=(args.batch_size, *shape)).astype(np.float32)
  labels = rng.integers(0, d.num_classes, args.batch_size).astype(np.int32)
  return jax.device_put(images, device), jax.device_put(labels, device)


def _tx():
  return optax.sgd(1e-3, momentum=0.9)


# ----------------------------------------------------------------------------
# Timed loops.
# ----------------------------------------------------------------------------

def _timed(run_steps, rounds: int, iters: int, batch: int, barrier=None) -> list[float]:
  """Images/s of each of ``rounds`` calls of ``run_steps(iters)`` (which
  returns what to wait for), each started after ``barrier()`` if given."""
  out = []
  for _ in range(rounds):
    if barrier is not None:
      barrier()
    start = time.perf_counter()
    jax.block_until_ready(run_steps(iters))
    out.append(iters * batch / (time.perf_counter() - start))
  return out


class _Stream:
  """PETRA's stream on ``pipe``, one tick per step, the same micro-batch fed
  on every tick; ``host_s`` sums the wall time spent in ``run_tick``
  (dispatch, and any wait inside it), ``host_cpu_s`` the CPU time of the
  calling thread there (the host loop's own work)."""

  def __init__(self, pipe: Pipeline, images, labels, num_ticks: int):
    self.pipe, self.state = pipe, pipe.init(0, images)
    self.ticks = iter(pipe.schedule(num_ticks))
    labels = np.asarray(labels)  # (read once: the engine sends them to the last stage)
    self.batches = lambda m: (images if pipe.owns_input else None, labels)
    self.host_s = self.host_cpu_s = 0.0

  def run(self, n: int):
    start, cpu = time.perf_counter(), time.thread_time()
    for _ in range(n):
      self.state, _ = self.pipe.run_tick(self.state, next(self.ticks), self.batches)
    self.host_s += time.perf_counter() - start
    self.host_cpu_s += time.thread_time() - cpu
    return self.local_arrays()

  def local_arrays(self) -> list:
    """This process's stage states and messages (what the ticks so far wrote)."""
    s = self.state
    return [x for x in s.train_states if x is not None] + [s.inbox, s.grad_inbox]


def _stream_ticks(args, num_stages: int) -> int:
  """Ticks to fill the stream, warm up and run every measured round."""
  return schedule.drain_ticks(num_stages) + args.warmup + args.rounds * args.iters + 1


# ----------------------------------------------------------------------------
# Role "single": backprop and PETRA in one process on N cores.
# ----------------------------------------------------------------------------

def run_single(args) -> dict:
  """Backprop and single-process PETRA images/s (interleaved rounds) and
  each stage's ms per tick, in this process (pinned to ``args.processes``
  cores). Returns ``{"images_per_s": {...}, "stage_ms": [...], "cores"}``."""
  cores = pin_to_cores(available_cores()[:args.processes])
  device = jax.devices()[0]
  stages = build_stages(args)
  images, labels = _micro_batch(args, device)
  backprop = Pipeline(stages, _tx(), [device], method="backprop")
  bp_state = {"s": backprop.init(0, images)}

  def backprop_steps(n):
    bp_state["s"], out = backprop.run(bp_state["s"], backprop.schedule(n),
                                      lambda m: (images, labels))
    return out[-1].loss
  petra = _Stream(Pipeline(stages, _tx(), [device]), images, labels,
                  _stream_ticks(args, len(stages)))
  petra.run(schedule.drain_ticks(len(stages)))  # fill: every stage busy
  runs = {"backprop": backprop_steps, "petra": petra.run}
  times = {k: [] for k in runs}
  for name, fn in runs.items():  # warm-up
    jax.block_until_ready(fn(args.warmup))
  for _ in range(args.rounds):  # interleaved: a drift of the machine hits both
    for name, fn in runs.items():
      times[name] += _timed(fn, 1, args.iters, args.batch_size)
  rows, _ = timing.stage_times(petra.pipe, petra.pipe.init(0, images), images, labels,
                               iters=max(3, args.iters // 4))
  return {"images_per_s": {k: statistics.median(v) for k, v in times.items()},
          "stage_ms": timing.stage_cost([r["forward"] for r in rows],
                                        [r["backward"] for r in rows]),
          "cores": cores}


# ----------------------------------------------------------------------------
# Role "worker": one of N jax.distributed processes (started by launch/local.sh).
# ----------------------------------------------------------------------------

def run_worker(args) -> Optional[dict]:
  """One process of the multi-process PETRA run, pinned to one core.

  Measures its stages' one-thread ms per tick, the transfer round trip at
  every process boundary and PETRA's images/s over all processes (timed on
  process 0 between barriers). Returns the report on process 0, None on the
  others.
  """
  from petra_jax import config as config_lib, train  # pylint: disable=g-import-not-at-top
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  index = int(os.environ.get("JAX_PROCESS_ID", "0"))
  cores = available_cores()
  core = pin_to_cores([cores[index % len(cores)]])
  train.initialize_distributed(config_lib.get_config())  # from $JAX_* (launch/local.sh)
  stages = build_stages(args)
  pipe = Pipeline(stages, _tx(), jax.devices())
  images, labels = _micro_batch(args, jax.local_devices()[0])
  stream = _Stream(pipe, images, labels, _stream_ticks(args, len(stages)))
  group_ms = _local_group_ms(pipe, stream.state, images, labels, max(3, args.iters // 4))
  transfers = [_round_trip_ms(pipe, b, images, args.iters) for b in _boundaries(pipe)]
  trips = multihost_utils.process_allgather(np.asarray(
      [t.pop("round_trip_ms", 0.0) for t in transfers], np.float64))
  for t, ms in zip(transfers, np.asarray(trips).reshape(jax.process_count(), -1).max(0)):
    t["round_trip_ms"] = float(ms)  # (timed by the owner of stage b-1, 0 elsewhere)
  barrier = lambda: multihost_utils.sync_global_devices("petra_jax scaling")  # noqa: E731
  jax.block_until_ready(stream.run(schedule.drain_ticks(len(stages)) + args.warmup))
  stream.host_s = stream.host_cpu_s = 0.0
  ips = _timed(stream.run, args.rounds, args.iters, args.batch_size, barrier)
  ticks = args.rounds * args.iters
  groups = multihost_utils.process_allgather(np.asarray([group_ms], np.float64)).reshape(-1)
  if jax.process_index() != 0:
    return None
  return {"images_per_s": statistics.median(ips), "group_ms_1thread": groups.tolist(),
          "transfer": transfers, "host_ms_per_tick": 1e3 * stream.host_s / ticks,
          "host_cpu_ms_per_tick": 1e3 * stream.host_cpu_s / ticks, "core_of_process_0": core,
          "processes": jax.process_count()}


def _local_group_ms(pipe: Pipeline, state, images, labels, iters: int) -> float:
  """This process's compute per tick (ms): the sum over its stages of
  forward + backward (the last stage: its backward, which holds its forward),
  each timed on random inputs of its shapes."""
  specs = pipe.message_specs(images)
  rng = np.random.default_rng(1)
  total = 0.0
  for j in (j for j in range(pipe.num_stages) if pipe.local[j]):
    x = _random_like(specs[j], pipe.devices[j], rng) if j else images
    y = None if j == pipe.num_stages - 1 else pipe.steps.forward(j, state.train_states[j], x)[0]
    row = timing.one_stage_times(pipe, state, j, x, y, labels, iters)
    total += row["backward"] + (row["forward"] if y is not None else 0.0)
  return total


def _random_like(spec, device, rng):
  return jax.tree.map(lambda s: jax.device_put(
      rng.normal(size=s.shape).astype(s.dtype), device), spec)


def _boundaries(pipe: Pipeline) -> list[int]:
  """Stages ``b`` whose predecessor ``b-1`` is on another process."""
  return [b for b in range(1, pipe.num_stages)
          if pipe.devices[b].process_index != pipe.devices[b - 1].process_index]


def _round_trip_ms(pipe: Pipeline, b: int, images, iters: int) -> dict:
  """Median ms of one tick's messages across boundary ``b``: stage ``b-1``'s
  output forward, then ``(x~ or None, delta)`` back, as the engine sends them
  (:func:`petra_jax.engine.transport.transfer`). Every process calls it; the two
  owners time it, and ``round_trip_ms`` is set on the owner of ``b-1``."""
  from petra_jax.engine import transport  # pylint: disable=g-import-not-at-top
  specs = pipe.message_specs(images)
  fwd_spec = specs[b]
  bwd_spec = (specs[b] if pipe.reconstructs[b - 1] else None, specs[b])
  src, dst = pipe.devices[b - 1], pipe.devices[b]
  nbytes = lambda spec: sum(int(np.prod(s.shape)) * s.dtype.itemsize  # noqa: E731
                            for s in jax.tree.leaves(spec))
  out = {"boundary": b, "bytes_forward": nbytes(fwd_spec), "bytes_backward": nbytes(bwd_spec)}
  if not (pipe.local[b - 1] or pipe.local[b]):
    return out
  rng = np.random.default_rng(2)
  fwd = _random_like(fwd_spec, src, rng) if pipe.local[b - 1] else None
  bwd = _random_like(bwd_spec, dst, rng) if pipe.local[b] else None

  def trip():
    transport.transfer(fwd, src, dst, fwd_spec)
    return transport.transfer(bwd, dst, src, bwd_spec)
  ms = timing.median_ms(trip, iters, warmup=2)
  if pipe.local[b - 1]:
    out["round_trip_ms"] = ms
  return out


# ----------------------------------------------------------------------------
# Role "driver": both runs back to back, and the report.
# ----------------------------------------------------------------------------

def _child_args(args) -> list[str]:
  """The measurement flags, as given, for a child process."""
  return [f"--processes={args.processes}", f"--model={args.model}", f"--width={args.width}",
          f"--depth={args.depth}", f"--dataset={args.dataset}",
          f"--stage-sizes={args.stage_sizes}", f"--batch-size={args.batch_size}",
          f"--rounds={args.rounds}", f"--iters={args.iters}", f"--warmup={args.warmup}"] + (
              [f"--image-size={args.image_size}"] if args.image_size else [])


def _run_child(cmd: list[str], env: dict, timeout_s: float) -> dict:
  """Runs ``cmd`` and returns the JSON after its (single) ``RESULT`` line.

  Raises:
    RuntimeError: the command failed or printed no result (its output's tail
      in the message).
  """
  proc = subprocess.run(cmd, cwd=_REPO, env=env, stdout=subprocess.PIPE,
                        stderr=subprocess.STDOUT, text=True, timeout=timeout_s, check=False)
  lines = [l for l in proc.stdout.splitlines() if _RESULT in l]
  if proc.returncode or len(lines) != 1:
    raise RuntimeError(f"{' '.join(cmd[:4])} ... failed (status {proc.returncode}):\n"
                       f"{proc.stdout[-3000:]}")
  return json.loads(lines[0].split(_RESULT, 1)[1])


def _child_env() -> dict:
  """This environment for CPU children that import this checkout."""
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
  env["PYTHONPATH"] = os.pathsep.join(p for p in (_REPO, env.get("PYTHONPATH")) if p)
  env.setdefault("XLA_FLAGS", "")
  for k in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
    env.pop(k, None)
  return env


def measure(args) -> tuple[dict, dict]:
  """``(single, multi)``: the single-process run, then the multi-process one,
  ``args.repeats`` times in alternation; each figure is the median over the
  repeats (integers, e.g. byte counts, are the same in every repeat)."""
  module = ["-m", "petra_jax.benchmarks.scaling"]
  env = _child_env()
  env.setdefault("JAX_COMPILATION_CACHE_DIR", tempfile.mkdtemp(prefix="petra_jax_scaling_"))
  multi_env = dict(env, XLA_FLAGS=f"{env['XLA_FLAGS']} {_EIGEN_FLAG}", PYTHON=sys.executable,
                   PETRA_MODULE="petra_jax.benchmarks.scaling", LOCAL_DEVICES="1")
  singles, multis = [], []
  for _ in range(args.repeats):
    singles.append(_run_child([sys.executable, *module, "--role=single", *_child_args(args)],
                              env, args.timeout))
    multis.append(_run_child([os.path.join(_REPO, "launch", "local.sh"), str(args.processes),
                              "--role=worker", *_child_args(args)], multi_env, args.timeout))
  return _median(singles), _median(multis)


def _median(results: list) -> dict:
  """Leaf by leaf median of JSON results of the same structure (ints: the first)."""
  return jax.tree.map(lambda *xs: xs[0] if isinstance(xs[0], int) else statistics.median(xs),
                      *results)


def report(args, single: dict, multi: dict) -> dict:
  """The JSON report from the two runs (see the module docstring)."""
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
  """Per process, ms per tick sending forward / backward: each boundary's
  round trip split between its two directions in proportion to their bytes
  (the forward part charged to the process before it, the backward part to
  the one after, as :func:`petra_jax.engine.schedule.simulate` charges sends)."""
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
  p = argparse.ArgumentParser(prog="python -m petra_jax.benchmarks.scaling",
                              description=__doc__.splitlines()[0])
  p.add_argument("--processes", type=int, default=2, help="jax.distributed processes (>= 2)")
  p.add_argument("--model", default="revnet18", choices=sorted(models.MODEL_SPECS))
  p.add_argument("--width", type=int, default=8)
  p.add_argument("--depth", type=int, default=0, help="revnet_fixed's blocks (0: default)")
  p.add_argument("--dataset", default="cifar10", choices=sorted(data_lib.DATASETS))
  p.add_argument("--stage-sizes", default="1,2,2,5",
                 help="blocks per stage, comma-separated (configs/cifar10_cpu.py's; '' for one "
                      "block per stage)")
  p.add_argument("--batch-size", type=int, default=64, help="micro-batch size")
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
    sizes = _sizes(args)
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
  """``python -m petra_jax.benchmarks.scaling``; see the module docstring."""
  args = parse_args(argv)
  if args.role == "single":
    print(_RESULT + json.dumps(run_single(args)), flush=True)
    return 0
  if args.role == "worker":
    result = run_worker(args)
    if result is not None:
      print(_RESULT + json.dumps(result), flush=True)
    return 0
  _check(args)
  r = report(args, *measure(args))
  if args.json:
    print(json.dumps(r))
  else:
    print_table(r)
  return 0


if __name__ == "__main__":
  sys.exit(main())
