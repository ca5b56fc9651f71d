"""Where a stage lives: one device, or ``D`` devices along a ``data`` axis.

With ``D > 1`` the state is replicated over ``Mesh(group, ("data",))`` and
batched arrays ``[B, ...]`` sharded along the batch; XLA inserts the
all-reduces. With ``D = 1`` a placement is its device.
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
    replicated: the state's target (device, or ``NamedSharding(mesh, P())``).
    batch: ``[B, ...]`` arrays' target (device, or ``P("data")``; ``D | B``).
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
    """The state's sharding (for orbax restore)."""
    if self.size == 1:
      return jax.sharding.make_single_device_sharding(self.device)
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
    return Placement(devices, d, d, jax.sharding.make_single_device_sharding(d))
  mesh = Mesh(np.array(devices), (DATA_AXIS,))
  batch = NamedSharding(mesh, P(DATA_AXIS))
  return Placement(devices, NamedSharding(mesh, P()), batch, batch)


def assign(num_stages: int, devices: Sequence[jax.Device], data_parallel: int = 1) -> list:
  """Each stage's :class:`Placement`: stage ``j`` -> group ``j * G // J`` of ``data_parallel``.

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
