"""Micro-batches prepared ahead in background threads (ImageNet's host decoding)."""

from __future__ import annotations

import concurrent.futures
from typing import Callable


class Prefetcher:
  """``m -> batches(m)``, with ``batches(m + 1) .. batches(m + depth)`` prepared ahead.

  ``batches`` must be a pure, thread-safe function of ``m``; ``workers`` defaults
  to ``depth``. Raises ValueError if ``depth < 1``.
  """

  def __init__(self, batches: Callable[[int], tuple], depth: int, workers: int = 0):
    if depth < 1:
      raise ValueError(f"prefetch depth must be >= 1, got {depth}.")
    self._batches, self._depth = batches, depth
    self._pool = concurrent.futures.ThreadPoolExecutor(workers or depth,
                                                       thread_name_prefix="petra-prefetch")
    self._pending: dict[int, concurrent.futures.Future] = {}

  def __call__(self, m: int) -> tuple:
    """``batches(m)``; a background preparation's error is raised for its own ``m``."""
    future = self._pending.pop(m, None)
    for stale in [n for n in self._pending if n < m]:  # a jump back (resume) or ahead
      self._pending.pop(stale).cancel()
    for n in range(m + 1, m + 1 + self._depth):
      if n not in self._pending:
        self._pending[n] = self._pool.submit(self._batches, n)
    return future.result() if future is not None else self._batches(m)

  def close(self) -> None:
    """Stops the threads (pending preparations are cancelled)."""
    for future in self._pending.values():
      future.cancel()
    self._pending.clear()
    self._pool.shutdown(wait=True)
