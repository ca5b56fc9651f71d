"""Batches: the epoch order, training batches and evaluation batches."""

import functools
from typing import Any, Callable, Iterator, Sequence

import jax
import numpy as np

from petra_jax.data import sources
from petra_jax.data.augment import augment, imagenet_eval_image, imagenet_train_image, normalize
from petra_jax.data.sources import DatasetInfo, LazySplit, Split


def epoch_permutation(num_examples: int, seed: int, epoch: int) -> np.ndarray:
  """int64 ``[N]``, the example order of one epoch, a function of ``(seed, epoch)`` only."""
  return np.random.default_rng((seed, epoch)).permutation(num_examples)


def batch_indices(
    num_examples: int,
    batch_size: int,
    seed: int,
    epoch: int,
    steps_per_epoch: int = 0,
) -> np.ndarray:
  """int64 ``[S, B]``: the epoch's order in ``S = min(N // B, steps_per_epoch or N // B)`` batches.

  Raises:
    ValueError: ``batch_size < 1`` or the dataset is smaller than one batch.
  """
  if batch_size < 1:
    raise ValueError(f"batch_size must be >= 1, got {batch_size}.")
  num_batches = num_examples // batch_size
  if num_batches == 0:
    raise ValueError(
        f"Dataset of {num_examples} examples is smaller than one batch of "
        f"{batch_size}."
    )
  if steps_per_epoch > 0:
    num_batches = min(num_batches, steps_per_epoch)
  perm = epoch_permutation(num_examples, seed, epoch)
  return perm[: num_batches * batch_size].reshape(num_batches, batch_size)


def _decode_lazy_batch(
    split: LazySplit, indices: Sequence[int], transform: Callable[..., np.ndarray],
    *per_image_args: Sequence[Any],
) -> tuple[np.ndarray, np.ndarray]:
  """Reads ``indices`` and maps ``transform`` over them on the thread pool."""
  encoded, labels = split.read(indices)
  images = list(sources.thread_pool().map(transform, encoded, *per_image_args))
  return np.stack(images), labels


TrainBatchFn = Callable[[Any, np.ndarray, Any], tuple[jax.Array, np.ndarray]]

_MASK32 = 0xFFFFFFFF
_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))


def host_fold_in(key_data: np.ndarray, data: int) -> np.ndarray:
  """``jax.random.fold_in`` on uint32 ``[2]`` threefry key data, on the host, bit for bit.

  Threefry-2x32 (20 rounds; Salmon et al., 2011) of the counter ``(0, data)``.
  Returns uint32 ``[2]``; raises ValueError for ``data`` outside ``[0, 2**32)``.
  """
  if not 0 <= data <= _MASK32:
    raise ValueError(f"fold_in data must be in [0, 2**32), got {data}.")
  k0, k1 = int(key_data[0]), int(key_data[1])
  ks = (k0, k1, k0 ^ k1 ^ 0x1BD11BDA)
  x0, x1 = ks[0], (data + ks[1]) & _MASK32
  for i in range(5):
    for r in _ROTATIONS[i % 2]:
      x0 = (x0 + x1) & _MASK32
      x1 = (((x1 << r) | (x1 >> (32 - r))) & _MASK32) ^ x0
    x0 = (x0 + ks[(i + 1) % 3]) & _MASK32
    x1 = (x1 + ks[(i + 2) % 3] + i + 1) & _MASK32
  return np.array([x0, x1], np.uint32)


def _augment_key_data(key_data, images, mean, std):
  """``augment`` keyed by threefry key data (uint32 ``[2]``), jittable."""
  return augment(jax.random.wrap_key_data(key_data, impl="threefry2x32"), images, mean, std)


def make_train_batch_fn(info: DatasetInfo, device) -> TrainBatchFn:
  """``fn(split, indices, key) -> (images, labels)`` with paper Sec. 4 augmentation.

  ``indices`` int ``[B]``; ``key`` a threefry key or its NumPy uint32 ``[2]`` data;
  ``images`` float32 ``[B, H, W, C]`` on ``device`` (a device or a sharding);
  ``labels`` int32 ``[B]`` (NumPy). Lazy splits are decoded and cropped on the host.
  """
  normalize_fn = jax.jit(functools.partial(normalize, mean=info.mean, std=info.std))
  if not info.lazy:
    augment_fn = jax.jit(functools.partial(augment, mean=info.mean, std=info.std))
    augment_data_fn = jax.jit(functools.partial(_augment_key_data, mean=info.mean, std=info.std))

    def in_memory_fn(split: Split, indices: np.ndarray, key):
      images = jax.device_put(split.images[indices], device)
      if isinstance(key, np.ndarray):  # key data: shipped with the images, to their devices
        return augment_data_fn(key, images), split.labels[indices]
      return augment_fn(key, images), split.labels[indices]

    return in_memory_fn

  size = info.image_shape[0]

  def lazy_fn(split: LazySplit, indices: np.ndarray, key):
    data = key if isinstance(key, np.ndarray) else np.asarray(jax.random.key_data(key))
    seeds = np.random.default_rng(data.ravel()).integers(0, 2**63, len(indices))
    transform = functools.partial(imagenet_train_image, size=size)
    images, labels = _decode_lazy_batch(split, indices, transform, seeds.tolist())
    return normalize_fn(jax.device_put(images, device)), labels

  return lazy_fn


def make_update_batch_fn(info: DatasetInfo, device, k: int) -> Callable:
  """``fn(split, indices, key_data)`` -> an update's ``k`` float32 ``[B, H, W, C]`` micro-batches.

  ``indices`` int ``[k * B]``, ``key_data`` uint32 ``[k, 2]``; the same images as
  ``k`` calls of ``make_train_batch_fn``'s function. Raises ValueError for a lazy dataset.
  """
  if info.lazy:
    raise ValueError(f"{info.tfds_name}: a lazy dataset is decoded per micro-batch on the host; "
                     "use make_train_batch_fn (with data.prefetch).")

  def augment_update(key_data, images):
    parts = images.reshape(k, -1, *images.shape[1:])
    return tuple(_augment_key_data(key_data[i], parts[i], info.mean, info.std)
                 for i in range(k))
  augment_fn = jax.jit(augment_update)

  def update_fn(split: Split, indices: np.ndarray, key_data: np.ndarray) -> tuple:
    return augment_fn(key_data, jax.device_put(split.images[indices], device))
  return update_fn


def eval_batches(
    split: Split | LazySplit,
    info: DatasetInfo,
    batch_size: int,
    device: jax.Device | None = None,
) -> Iterator[tuple[jax.Array, np.ndarray, int]]:
  """Yields the split in order as ``(images, labels, valid)``.

  ``images`` float32 ``[B, H, W, C]`` on ``device``, rows past ``valid`` black
  padding (last batch); labels int32 ``[valid]``. Raises ValueError if ``batch_size < 1``.
  """
  if batch_size < 1:
    raise ValueError(f"batch_size must be >= 1, got {batch_size}.")
  normalize_fn = jax.jit(functools.partial(normalize, mean=info.mean, std=info.std))
  transform = functools.partial(imagenet_eval_image, size=info.image_shape[0])
  n = len(split)
  for start in range(0, n, batch_size):
    indices = np.arange(start, min(start + batch_size, n))
    if info.lazy:
      images, labels = _decode_lazy_batch(split, indices, transform)
    else:
      images, labels = split.images[indices], split.labels[indices]
    valid = len(indices)
    if valid < batch_size:  # pad to one shape: no recompilation
      pad = np.zeros((batch_size - valid,) + images.shape[1:], images.dtype)
      images = np.concatenate([images, pad])
    yield normalize_fn(jax.device_put(images, device)), labels, valid
