"""Multi-process runs: ``jax.distributed`` start-up, device order, the loop's
collectives (every process calls them at the same point), a barrier-free exit.
"""

from __future__ import annotations

import os
import sys

from absl import logging
import jax
from jax.experimental import multihost_utils
import ml_collections
import numpy as np

from petra_jax.engine.transport import transfers as transport
from petra_jax.training.validation import ConfigError


def initialize_distributed(config: ml_collections.ConfigDict) -> bool:
  """Starts ``jax.distributed`` if asked; False for one process.

  Raises:
    ConfigError: the processes did not all join in time.
  """
  d = config.distributed
  address = d.coordinator_address or os.environ.get("JAX_COORDINATOR_ADDRESS", "")
  if not address and not d.auto_detect:
    return False
  num = d.num_processes or int(os.environ.get("JAX_NUM_PROCESSES", "0")) or None
  pid = d.process_id if d.process_id >= 0 else os.environ.get("JAX_PROCESS_ID")
  pid = int(pid) if pid is not None else None
  transport.enable_cpu_collectives()
  try:
    jax.distributed.initialize(
        coordinator_address=address or None, num_processes=num, process_id=pid,
        initialization_timeout=d.initialization_timeout_s,
        heartbeat_timeout_seconds=d.heartbeat_timeout_s,
        shutdown_timeout_seconds=d.shutdown_timeout_s)
  except Exception as e:  # pylint: disable=broad-except
    raise ConfigError(
        f"process {pid} could not join the {num}-process run at {address!r} within "
        f"{d.initialization_timeout_s} s: {str(e).splitlines()[0]}. Start every process "
        "with the same coordinator address (process 0's host:port) and num_processes.") from None
  if transport.skip_cache_if_it_hangs():
    logging.info("persistent compilation cache off: this jaxlib's CPU collectives hang in "
                 "programs loaded from it (docs/multihost.md)")
  logging.info("jax.distributed: process %d of %d, %d local / %d global devices",
               jax.process_index(), jax.process_count(), jax.local_device_count(),
               jax.device_count())
  return True


def devices(config: ml_collections.ConfigDict) -> list:
  """The first ``num_devices x data_parallel`` devices of each process, in
  process order; consecutive groups of ``data_parallel`` form a stage.
  """
  n = config.num_devices * config.data_parallel
  if jax.process_count() == 1:
    local = jax.local_devices()
    return local[:n] if n else local
  by_process = {}
  for d in jax.devices():
    by_process.setdefault(d.process_index, []).append(d)
  return [d for p in sorted(by_process) for d in (by_process[p][:n] if n else by_process[p])]


def broadcast_floats(values) -> list:
  """Process 0's float32 ``values`` on every process (a collective)."""
  return multihost_utils.broadcast_one_to_all(np.asarray(values, np.float32)).tolist()


def broadcast_int(value: int) -> int:
  """Process 0's ``value`` on every process (a collective)."""
  return int(multihost_utils.broadcast_one_to_all(np.int32(value)))


def any_process(flag: bool) -> bool:
  """Whether ``flag`` is True on any process (a collective)."""
  return bool(np.any(multihost_utils.process_allgather(np.int32(flag))))


def barrier(name: str) -> None:
  multihost_utils.sync_global_devices(name)


def exit_now(message: str, status: int = 1):
  """Prints ``message`` and exits now, skipping the shutdown barrier."""
  if message:
    print(message, file=sys.stderr, flush=True)
  sys.stdout.flush()
  os._exit(status)  # pylint: disable=protected-access
