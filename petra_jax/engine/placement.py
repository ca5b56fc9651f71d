"""Where a stage lives: one device, or ``D`` devices along a ``data`` axis.

With data parallelism within a stage (``config.data_parallel = D``) each
stage runs on a group of ``D`` devices: its state (parameters, optimizer
state, BatchNorm statistics) is replicated over the group and every batched
array it receives (images, labels, activations, cotangents) is sharded
along the batch axis over a one-axis mesh ``Mesh(group, ("data",))``. The
stage's jitted steps then run SPMD over the group (computation follows the
data's ``NamedSharding``): XLA inserts the all-reduces, so BatchNorm
statistics and gradients are those of the whole micro-batch, as with
``D = 1``.

With ``D = 1`` a placement is its device itself: every ``jax.device_put``
goes to the ``jax.Device``, as a pipeline without data parallelism does.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

DATA_AXIS = "data"


@dataclasses.dataclass(frozen=True, eq=False)
class Placement:
  """One stage's devices and the two ways its arrays lie on them.

  Attributes:
    devices: the stage's ``D`` devices (a tuple; ``D >= 1``).
    replicated: where the state goes: the device itself when ``D = 1``,
      else ``NamedSharding(mesh, P())``.
    batch: where batched arrays ``[B, ...]`` go: the device when ``D = 1``,
      else ``NamedSharding(mesh, P("data"))`` (``B`` must divide by ``D``).
    batch_sharding: ``batch`` as a ``jax.sharding.Sharding`` (what an array
      already in place has: ``transport.send_if_elsewhere`` compares it).
  """
  devices: tuple
  replicated: Any
  batch: Any
  batch_sharding: jax.sharding.Sharding

  @property
  def device(self) -> jax.Device:
    """The group's first device (the stage's device when ``D = 1``)."""
    return self.devices[0]

  @property
  def size(self) -> int:
    """``D``, the devices of the group."""
    return len(self.devices)

  @property
  def state_sharding(self) -> jax.sharding.Sharding:
    """The state's sharding (what a restore asks orbax for)."""
    if self.size == 1:
      return jax.sharding.SingleDeviceSharding(self.device)
    return self.replicated

  def __eq__(self, other) -> bool:
    return isinstance(other, Placement) and self.devices == other.devices

  def __hash__(self) -> int:
    return hash(self.devices)


def place(devices: Sequence[jax.Device]) -> Placement:
  """The placement of a stage on ``devices`` (one device, or a group)."""
  devices = tuple(devices)
  if len(devices) == 1:
    d = devices[0]
    return Placement(devices, d, d, jax.sharding.SingleDeviceSharding(d))
  mesh = Mesh(np.array(devices), (DATA_AXIS,))
  batch = NamedSharding(mesh, P(DATA_AXIS))
  return Placement(devices, NamedSharding(mesh, P()), batch, batch)


def assign(num_stages: int, devices: Sequence[jax.Device], data_parallel: int = 1) -> list:
  """Each stage's :class:`Placement`: the devices cut into groups of
  ``data_parallel`` consecutive devices, and stages spread over the groups
  in contiguous blocks (stage ``j`` -> group ``j * G // J``).

  Raises:
    ValueError: the number of devices is not a multiple of ``data_parallel``.
  """
  n, d = len(devices), data_parallel
  if d < 1 or n % d:
    raise ValueError(f"{n} devices do not form groups of data_parallel={d}: give a multiple "
                     f"of {d} devices (--config.num_devices) or another data_parallel.")
  groups = [tuple(devices[g * d:(g + 1) * d]) for g in range(n // d)]
  placements = [place(g) for g in groups]
  return [placements[j * len(groups) // num_stages] for j in range(num_stages)]
