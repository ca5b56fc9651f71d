"""Micro-batches prepared ahead in threads (data.prefetch.Prefetcher)."""

import threading

import numpy as np
import pytest

from petra_jax.data import prefetch


def _recording_batches():
  calls = []

  def batches(m):
    calls.append((m, threading.current_thread().name))
    return np.full(3, m, np.float32), np.int32(m)
  return batches, calls


def test_prefetched_batches_equal_the_direct_ones_in_any_order():
  batches, calls = _recording_batches()
  fetch = prefetch.Prefetcher(batches, depth=3)
  try:
    for m in [0, 1, 2, 3, 7, 8, 2, 3]:  # in order, a jump ahead, a jump back (a resume)
      images, labels = fetch(m)
      np.testing.assert_array_equal(images, np.full(3, m, np.float32))
      assert int(labels) == m
  finally:
    fetch.close()
  # The micro-batches after the first were prepared by the background threads.
  assert any(name.startswith("petra-prefetch") and m == 1 for m, name in calls)


def test_an_error_while_preparing_is_raised_for_its_micro_batch():
  def batches(m):
    if m == 2:
      raise OSError("corrupt JPEG in micro-batch 2")
    return m, m
  fetch = prefetch.Prefetcher(batches, depth=2)
  try:
    assert fetch(0) == (0, 0) and fetch(1) == (1, 1)
    with pytest.raises(OSError, match="micro-batch 2"):
      fetch(2)
  finally:
    fetch.close()


def test_depth_below_one_is_refused():
  with pytest.raises(ValueError, match="prefetch depth must be >= 1"):
    prefetch.Prefetcher(lambda m: m, depth=0)
