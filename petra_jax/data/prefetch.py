"""Micro-batches prepared ahead, in background threads.

A training run asks for micro-batch ``m`` on the tick stage 0 takes it
(``batches(m)``, a pure function of ``m``: see ``training.assembly``).
Where preparing one is slow host work (ImageNet: JPEG decoding and the
random-resized crop, in NumPy/PIL, which release the GIL), :class:`Prefetcher`
runs ``batches(m + 1) .. batches(m + depth)`` in a thread pool while the
tick's stages compute, so the loop finds each micro-batch ready. Results are
those of ``batches`` itself, in any order of requests.
"""

from __future__ import annotations

import concurrent.futures
from typing import Callable


class Prefetcher:
  """``m -> batches(m)``, with the next ``depth`` micro-batches prepared ahead.

  Args:
    batches: ``m -> (images, labels)``; must be a pure function of ``m`` and
      safe to call from other threads (JAX's dispatch and ``device_put`` are).
    depth: micro-batches prepared ahead (>= 1).
    workers: threads preparing them (default ``depth``).

  Raises:
    ValueError: ``depth < 1``.
  """

  def __init__(self, batches: Callable[[int], tuple], depth: int, workers: int = 0):
    if depth < 1:
      raise ValueError(f"prefetch depth must be >= 1, got {depth}.")
    self._batches, self._depth = batches, depth
    self._pool = concurrent.futures.ThreadPoolExecutor(workers or depth,
                                                       thread_name_prefix="petra-prefetch")
    self._pending: dict[int, concurrent.futures.Future] = {}

  def __call__(self, m: int) -> tuple:
    """``batches(m)``; starts ``m + 1 .. m + depth``. Errors of a background
    preparation are raised here, for the micro-batch that caused them."""
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
