"""What each child process of the scaling benchmark measures.

``--role=single``: backprop and single-process PETRA on ``N`` cores, and each stage's ms per
tick; ``--role=worker``: one of ``N`` ``jax.distributed`` processes on one core, its compute
per tick, the transfer round trips and PETRA's images/s.
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Optional

import jax
import numpy as np
import optax

from petra_jax.engine.stages import partition
from petra_jax import data as data_lib
from petra_jax.benchmarks import cli
from petra_jax.benchmarks.scaling.processes import available_cores, pin_to_cores
from petra_jax.engine.arrays import quantize as quantize_lib
from petra_jax.engine import schedules as schedule
from petra_jax.engine import timing
from petra_jax.engine.pipeline import Pipeline


def build_stages(args) -> list:
  """The model's blocks grouped as ``--stage-sizes`` (one block per stage if empty)."""
  blocks = cli.build(args.model, args.dataset, args.width, depth=args.depth or None)
  sizes = stage_sizes(args)
  return partition.group_stages(blocks, sizes) if sizes else blocks


def stage_sizes(args) -> list[int]:
  """``--stage-sizes`` as block counts (empty: one block per stage); ValueError if not ints."""
  return [int(s) for s in args.stage_sizes.split(",") if s.strip()]


def _micro_batch(args, device):
  """A fixed random micro-batch ``(float32[B, H, W, C], int32[B])`` on ``device``."""
  shape = cli.image_shape(args.dataset, args.image_size)
  rng = np.random.default_rng(0)
  images = rng.normal(size=(args.batch_size, *shape)).astype(np.float32)
  labels = rng.integers(0, data_lib.DATASETS[args.dataset].num_classes,
                        args.batch_size).astype(np.int32)
  return jax.device_put(images, device), jax.device_put(labels, device)


def _tx():
  return optax.sgd(1e-3, momentum=0.9)


def _timed(run_steps, rounds: int, iters: int, batch: int, barrier=None) -> list[float]:
  """Images/s of each of ``rounds`` calls of ``run_steps(iters)``, each after ``barrier()``."""
  out = []
  for _ in range(rounds):
    if barrier is not None:
      barrier()
    start = time.perf_counter()
    jax.block_until_ready(run_steps(iters))
    out.append(iters * batch / (time.perf_counter() - start))
  return out


class _Stream:
  """PETRA's stream on ``pipe`` fed one micro-batch; ``host_s`` / ``host_cpu_s``: wall / CPU
  seconds spent in ``run_tick``."""

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


def run_single(args) -> dict:
  """``{"images_per_s": {backprop, petra}, "stage_ms", "cores"}`` on ``args.processes`` cores."""
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
  for fn in runs.values():  # warm-up
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


def run_worker(args) -> Optional[dict]:
  """One process of the multi-process run on one core; the report on process 0, else None."""
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
  """This process's compute ms per tick: forward + backward of its stages on random inputs."""
  specs = pipe.message_specs(images)
  rng = np.random.default_rng(1)
  total = 0.0
  for j in (j for j in range(pipe.num_stages) if pipe.owned[j]):
    x = _random_like(specs[j], pipe.devices[j], rng) if j else images
    y = None if j == pipe.num_stages - 1 else pipe.steps[j].forward(state.train_states[j], x)[0]
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
  """Bytes and median round-trip ms of one tick's messages across boundary ``b``.

  Every process calls it; ``round_trip_ms`` is set on the owner of stage ``b-1``.
  """
  from petra_jax.engine.transport import transfers as transport  # pylint: disable=g-import-not-at-top
  specs = pipe.message_specs(images)
  fwd_spec = specs[b]
  bwd_spec = (specs[b] if pipe.reconstructs[b - 1] else None, specs[b])
  src, dst = pipe.devices[b - 1], pipe.devices[b]
  out = {"boundary": b, "bytes_forward": quantize_lib.nbytes(fwd_spec),
         "bytes_backward": quantize_lib.nbytes(bwd_spec)}
  if not (pipe.owned[b - 1] or pipe.owned[b]):
    return out
  rng = np.random.default_rng(2)
  fwd = _random_like(fwd_spec, src, rng) if pipe.owned[b - 1] else None
  bwd = _random_like(bwd_spec, dst, rng) if pipe.owned[b] else None

  def trip():
    transport.transfer(fwd, src, dst, fwd_spec)
    return transport.transfer(bwd, dst, src, bwd_spec)
  ms = timing.median_ms(trip, iters, warmup=2)
  if pipe.owned[b - 1]:
    out["round_trip_ms"] = ms
  return out


if __name__ == "__main__":
  import sys  # pylint: disable=g-import-not-at-top
  from petra_jax.benchmarks import cli  # pylint: disable=g-import-not-at-top
  sys.exit(cli.library_main("scaling.roles", "scaling"))
