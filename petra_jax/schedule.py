"""The PETRA tick schedule: when each stage runs which micro-batch.

Stages are numbered ``j = 0 .. J-1``. Micro-batch ``m`` enters stage 0 on tick
``m``; it runs its forward at stage ``j`` on tick ``m + j`` and its backward
there on tick ``m + 2(J-1) - j``. The last stage runs forward, loss and
backward on the same tick. The gradient of stage ``j`` is therefore
``tau_j = 2(J-1-j)`` ticks late (the paper's ``tau_j = 2(J-j)`` with stages
numbered from 1; Appendix B), and a non-reversible stage holds ``tau_j``
buffered inputs.
"""


def delay(j: int, num_stages: int) -> int:
  """Delay ``tau_j = 2(J-1-j)`` in ticks of 0-indexed stage ``j`` of ``J``.

  Raises:
    ValueError: ``j`` outside ``[0, J)``.
  """
  if not 0 <= j < num_stages:
    raise ValueError(f"stage {j} outside [0, {num_stages})")
  return 2 * (num_stages - 1 - j)


def forward_tick(m: int, j: int, num_stages: int) -> int:
  """Tick on which micro-batch ``m`` runs its forward at stage ``j``."""
  del num_stages
  return m + j


def backward_tick(m: int, j: int, num_stages: int) -> int:
  """Tick on which micro-batch ``m`` runs its backward at stage ``j``."""
  return m + j + delay(j, num_stages)


def drain_ticks(num_stages: int) -> int:
  """Ticks without new input after which the pipeline is empty: ``2(J-1)``."""
  return 2 * (num_stages - 1)
