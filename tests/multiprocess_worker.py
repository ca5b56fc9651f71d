"""One process of a small multi-process PETRA run, for tests/test_multiprocess.py.

Usage (one process; several with ``launch/local.sh`` and
``PETRA_MODULE=tests.multiprocess_worker``)::

  python -m tests.multiprocess_worker --data_dir=DIR [--die_after=T] [--quantize=FMT]

A 5-stage RevNet of width 4 (stem, two reversible blocks, a downsampling
block, head) trains with PETRA on 8 micro-batches of 8 real CIFAR-10 images,
then is evaluated on 40 test images with ``train.evaluate``. A
:class:`petra_jax.engine.observers.GradientProbe` measures the gradient quality of
micro-batches 0, 3 and 6. Process 0 prints ``RESULT {"losses": [...], "test":
{...}, "grad_quality": {...}}`` (losses and figures as ``float.hex``, exact).
``--die_after=T`` makes the last process kill itself (SIGKILL) at tick T.
``--data_parallel=D`` puts each stage on ``D`` devices (launch with
``LOCAL_DEVICES``: a multiple of ``D``). ``--quantize=FMT`` sends forward and backward messages in ``FMT``; every
process then prints ``RECEIVED [dtypes]``: the dtypes of the message leaves
that arrived at its stages from the other process.

Every process also prints ``BALANCE [sizes]``: the 2-stage grouping that
``assembly.stage_sizes`` picks with ``model.balance_by="time"`` when each
process "measures" different block costs (process 0 a slow stem, the others
a slow head): all must print process 0's choice, ``[1, 4]``.
"""

import argparse
import json
import os
import signal
import sys
import time

from petra_jax.training import evaluate as evaluate_lib
import petra_jax  # noqa: F401  (XLA-CPU work-around before JAX starts)
import jax
import jax.numpy as jnp
import optax

from petra_jax import config as config_lib
from petra_jax import data as data_lib
from petra_jax import models, train
from petra_jax.engine import timing
from petra_jax.training import assembly, distributed
from petra_jax.engine import observers
from petra_jax.engine.arrays import quantize
from petra_jax.engine import schedules as schedule
from petra_jax.engine.transport import transfers as transport
from petra_jax.engine.pipeline import Pipeline
from petra_jax.engine.stages.stage import Stage

WIDTH, MICRO_BATCH, NUM_MICRO_BATCHES, NUM_TEST = 4, 8, 8, 40
PROBE_EVERY = 3  # micro-batches 0, 3, 6


def tiny_revnet(width: int = WIDTH) -> list:
  """stem -> reversible -> reversible -> downsample -> head (5 stages)."""
  return [Stage("stem", models.Stem(width, imagenet=False, two_streams=True), False),
          Stage("rev1", models.BasicResidual(width), True),
          Stage("rev2", models.BasicResidual(width), True),
          Stage("down", models.BasicDownsample(2 * width, 2), False),
          Stage("head", models.Head(10), False)]


def check_balance() -> list:
  """The time-balanced grouping, from per-process fake timings (see above)."""
  costs = [9.0, 1.0, 1.0, 1.0, 1.0] if jax.process_index() == 0 else [1.0, 1.0, 1.0, 1.0, 9.0]
  timing.measure_stage_costs = lambda *a, **k: list(costs)
  c = config_lib.get_config()
  c.model.num_stages, c.model.balance_by = 2, "time"
  return assembly.stage_sizes(c, tiny_revnet(), (MICRO_BATCH, 32, 32, 3), 10, "")


def _received_dtypes(pipe, state) -> set:
  """Dtypes of the leaves of messages waiting at this process's stages that
  came from a stage of another process."""
  out = set()
  for j in range(pipe.num_stages):
    if not pipe.owned[j]:
      continue
    if j > 0 and not pipe.owned[j - 1]:
      out |= {str(l.dtype) for p in state.inbox[j].values() for l in jax.tree.leaves(p)}
    if j + 1 < pipe.num_stages and not pipe.owned[j + 1]:
      out |= {str(l.dtype) for p in state.grad_inbox[j].values() for l in jax.tree.leaves(p)}
  return out


def run(data_dir: str, die_after: int, fmt: str = "none", data_parallel: int = 1) -> dict:
  config = config_lib.get_config()
  train.initialize_distributed(config)  # from $JAX_* when launched by local.sh
  print(f"BALANCE {check_balance()}", flush=True)
  devices = jax.devices()
  probe = observers.GradientProbe(PROBE_EVERY)
  pipe = Pipeline(tiny_revnet(), optax.sgd(0.05, momentum=0.9), devices, observers=[probe],
                  formats=quantize.MessageFormats(forward=fmt, backward=fmt),
                  data_parallel=data_parallel)
  info = data_lib.get_dataset_info("cifar10")
  open_fn = data_lib.load_split if pipe.owned[0] else data_lib.open_labels
  n_train = MICRO_BATCH * NUM_MICRO_BATCHES
  train_split = open_fn("cifar10", "train", data_dir, limit=n_train)
  test_split = open_fn("cifar10", "test", data_dir, limit=NUM_TEST)
  state = pipe.init(0, jnp.zeros((MICRO_BATCH,) + info.image_shape))
  batch_fn = data_lib.make_train_batch_fn(info, pipe.placements[0].batch)
  key = jax.random.key(1)
  losses, received = {}, set()

  def batches(m):
    idx = data_lib.batch_indices(n_train, MICRO_BATCH, seed=0, epoch=0)[m]
    if pipe.owned[0]:
      return batch_fn(train_split, idx, jax.random.fold_in(key, m))
    return None, data_lib.read_labels(train_split, idx)

  table = pipe.schedule(NUM_MICRO_BATCHES)
  for tick in table:
    m = schedule.fed(tick)
    if die_after and m == die_after and jax.process_index() == jax.process_count() - 1:
      print(f"DYING at {time.time()}", flush=True)
      os.kill(os.getpid(), signal.SIGKILL)
    state, outs = pipe.run_tick(state, tick, batches)
    losses.update({o.micro_batch: o.loss for o in outs if o.loss is not None})
    received |= _received_dtypes(pipe, state)
  if fmt != "none":
    print(f"RECEIVED {sorted(received)}", flush=True)
  test = evaluate_lib.evaluate(pipe, state, test_split, info, batch_size=16)
  return {"losses": [float(losses[m]).hex() for m in sorted(losses)], "test": test,
          "grad_quality": _grad_quality(probe), "num_processes": jax.process_count()}


def _grad_quality(probe) -> dict:
  """``{micro_batch: {name: [float.hex per stage]}}`` (empty off stage 0's
  process)."""
  return {str(m): {name: [float(v).hex() for v in jax.device_get(values)]
                   for name, values in quality.items()}
          for m, quality in probe.pop_results(wait=True)}


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--data_dir", required=True)
  parser.add_argument("--die_after", type=int, default=0)
  parser.add_argument("--quantize", default="none", choices=quantize.FORMATS)
  parser.add_argument("--data_parallel", type=int, default=1)
  args = parser.parse_args()
  try:
    result = run(args.data_dir, args.die_after, args.quantize, args.data_parallel)
  except transport.PeerError as e:
    distributed.exit_now(f"error: process {jax.process_index()}: {e}")
  if jax.process_index() == 0:
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
  sys.exit(main())
