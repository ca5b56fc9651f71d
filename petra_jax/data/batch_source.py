"""Where a run's micro-batches come from: ``m -> (images, labels)`` (text: ``(inputs, targets)``).

Update ``s = m // k`` is row ``s % steps_per_epoch`` of its epoch's seeded
permutation; micro-batch ``m``'s augmentation draws from ``fold_in(key(seed +
1), m)``. The position is ``m`` alone, so a resumed run reads the same
batches. In-memory data sets prepare a whole update at once; lazy ones
decode ``config.prefetch`` micro-batches ahead in threads; in-memory ones prepare
``ceil(prefetch / k)`` updates ahead in one background thread.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import numpy as np

from petra_jax.data import batches as batches_lib
from petra_jax.data import prefetch
from petra_jax.data import splits
from petra_jax.data import text
from petra_jax.data.batches import host_fold_in


def batch_source(config, info, train, pipe, steps_per_epoch: int) -> Callable:
  """``m -> (images float32[B, H, W, C] or None, labels int32[B])`` of a run."""
  k = config.accumulation_steps
  rows = _update_rows(config, len(train), steps_per_epoch)
  data_key = np.asarray(jax.random.key_data(jax.random.key(config.seed + 1, impl="threefry2x32")))
  if isinstance(train, text.TextSplit):
    return _TextBatches(train, pipe, rows, k)
  if not pipe.owns_input:
    return lambda m: (None, splits.read_labels(train, _micro_rows(rows, m, k)))
  if info.lazy:
    batch_fn = batches_lib.make_train_batch_fn(info, pipe.placements[0].batch)
    batches = lambda m: batch_fn(train, _micro_rows(rows, m, k), host_fold_in(data_key, m))
    return prefetch.Prefetcher(batches, config.prefetch) if config.prefetch else batches
  prepare = _UpdateBatches(info, train, pipe, rows, data_key, k).prepare
  if config.prefetch:  # updates prepared ahead in one background thread
    prepare = prefetch.Prefetcher(prepare, depth=-(-config.prefetch // k), workers=1)
  return _ByUpdate(prepare, k)


def _update_rows(config, num_examples: int, steps_per_epoch: int) -> Callable:
  """``s -> int [batch_size]``, the example indices of update ``s``."""
  epoch_rows = functools.lru_cache(maxsize=2)(lambda epoch: batches_lib.batch_indices(
      num_examples, config.batch_size, config.seed, epoch, steps_per_epoch))

  def rows(s: int) -> np.ndarray:
    epoch, row = divmod(s, steps_per_epoch)
    return epoch_rows(epoch)[row]
  return rows


def _micro_rows(rows: Callable, m: int, k: int) -> np.ndarray:
  """Micro-batch ``m``'s rows of its update ``m // k``."""
  update = rows(m // k)
  micro = len(update) // k
  return update[(m % k) * micro:(m % k + 1) * micro]


class _UpdateBatches:
  """In-memory micro-batches, prepared one update at a time (module docstring)."""

  def __init__(self, info, train, pipe, rows: Callable, data_key: np.ndarray, k: int):
    self._fn = batches_lib.make_update_batch_fn(info, pipe.placements[0].batch, k)
    self._labels_to = pipe.placements[-1].batch if pipe.owns_output else None
    self._train, self._rows, self._key, self._k = train, rows, data_key, k

  def prepare(self, s: int) -> list:
    """Update ``s``'s ``k`` micro-batches ``(images, labels)`` on their devices (thread-safe)."""
    k = self._k
    indices = self._rows(s)
    keys = np.stack([host_fold_in(self._key, s * k + i) for i in range(k)])
    labels = np.split(self._train.labels[indices], k)
    if self._labels_to is not None:
      labels = jax.device_put(labels, self._labels_to)
    return list(zip(self._fn(self._train, indices, keys), labels))


class _ByUpdate:
  """``m ->`` micro-batch ``m`` of ``prepare(m // k)`` (each update prepared once, in order)."""

  def __init__(self, prepare: Callable[[int], list], k: int):
    self._prepare, self._k = prepare, k
    self._update, self._batches = -1, None

  def __call__(self, m: int) -> tuple:
    s = m // self._k
    if s != self._update:
      self._update, self._batches = s, self._prepare(s)
    return self._batches[m % self._k]


class _TextBatches:
  """Text micro-batches ``m -> (inputs int32 [B, T] on stage 0, targets int32 [B, T] on the
  last stage)``: the windows starting at micro-batch ``m``'s rows (module docstring)."""

  def __init__(self, train, pipe, rows: Callable, k: int):
    self._train, self._rows, self._k = train, rows, k
    self._inputs_to = pipe.placements[0].batch if pipe.owns_input else None
    self._targets_to = pipe.placements[-1].batch if pipe.owns_output else None

  def __call__(self, m: int) -> tuple:
    inputs, targets = self._train.windows(_micro_rows(self._rows, m, self._k))
    inputs = None if self._inputs_to is None else jax.device_put(inputs, self._inputs_to)
    if self._targets_to is not None:
      targets = jax.device_put(targets, self._targets_to)
    return inputs, targets
