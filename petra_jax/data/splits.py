"""Opening a split: decoded into memory, labels only, or lazy (ImageNet); cached per process."""

import functools
from typing import Literal

import numpy as np

from petra_jax.data import errors
from petra_jax.data import prepare
from petra_jax.data import shards
from petra_jax.data import sources
from petra_jax.data.sources import LazySplit, Split

_READ_CHUNK = 4096


def load_split(name: str, split: str, data_dir: str | None = None,
               limit: int | None = None, download: bool | None = None) -> Split:
  """A read-only ``Split`` (uint8 ``[N, H, W, C]``, int32 ``[N]``) of the first ``limit`` examples.

  ``split`` e.g. ``"train[:10%]"``; ``download`` as in ``ensure_prepared``.

  Raises:
    DataError: unknown or lazy dataset, data missing, a damaged shard file, or
      an image of the wrong shape; the message names the fix.
  """
  if sources.get_dataset_info(name).lazy:
    raise errors.DataError(
        f"Dataset {name!r} is too large to decode into memory; read it per "
        "batch with open_split / make_train_batch_fn / eval_batches."
    )
  return _open(name, split, data_dir, limit, download, "images")


def open_split(name: str, split: str, data_dir: str | None = None,
               limit: int | None = None, download: bool | None = None
               ) -> Split | LazySplit:
  """``load_split(...)``, or a ``LazySplit`` for a lazy dataset; DataError as ``load_split``."""
  return _open(name, split, data_dir, limit, download, "images")


def open_labels(name: str, split: str, data_dir: str | None = None,
                limit: int | None = None, download: bool | None = None
                ) -> Split | LazySplit:
  """``open_split`` without decoding images (``Split.images`` None) for the last stage's process."""
  return _open(name, split, data_dir, limit, download, "labels")


def read_labels(split: Split | LazySplit, indices: np.ndarray) -> np.ndarray:
  """int32 labels ``[len(indices)]`` of a split from ``open_split`` or
  ``open_labels``, without decoding images."""
  if isinstance(split, LazySplit):
    return split.read(indices)[1]
  return split.labels[indices]


def _open(name: str, split: str, data_dir: str | None, limit: int | None,
          download: bool | None, what: Literal["images", "labels"]
          ) -> Split | LazySplit:
  """Check, prepare, read (cached)."""
  info = sources.get_dataset_info(name)
  if limit is not None and limit < 0:
    raise errors.DataError(f"limit must be >= 0 or None, got {limit}.")
  data_dir = prepare.ensure_prepared(name, data_dir, download)
  if info.lazy:
    return _open_lazy_cached(name, split, data_dir, limit)
  if what == "labels":
    return _load_labels_cached(name, split, data_dir, limit)
  return _load_split_cached(name, split, data_dir, limit)


def _open_source(name: str, split: str, data_dir: str):
  """The tfds data source of a prepared split, its shard files checked."""
  info = sources.get_dataset_info(name)
  try:
    source = sources.data_source(info, split, data_dir)
  except Exception as e:  # pylint: disable=broad-except
    reason = f"tfds failed ({type(e).__name__}: {str(e).splitlines()[0]})"
    raise errors.missing_data_error(name, data_dir, reason) from None
  shards.check_shards(name, info, split, data_dir, source)
  return source


def _opened(name: str, split: str, data_dir: str, limit: int | None):
  """The split's checked data source and the number of examples used."""
  source = _open_source(name, split, data_dir)
  return source, (len(source) if limit is None else min(limit, len(source)))


def _records(source, n: int, name: str, data_dir: str):
  """Yields ``(i, record)`` for ``i`` in ``0 .. n - 1``, read in chunks."""
  for start in range(0, n, _READ_CHUNK):
    stop = min(start + _READ_CHUNK, n)
    yield from enumerate(
        sources.read_records(source, range(start, stop), name, data_dir), start)


@functools.lru_cache(maxsize=8)
def _open_lazy_cached(name: str, split: str, data_dir: str, limit: int | None
                      ) -> LazySplit:
  source, n = _opened(name, split, data_dir, limit)
  return LazySplit(name=name, source=source, num_examples=n, data_dir=data_dir)


@functools.lru_cache(maxsize=8)
def _load_labels_cached(name: str, split: str, data_dir: str, limit: int | None
                        ) -> Split:
  source, n = _opened(name, split, data_dir, limit)
  labels = np.empty((n,), np.int32)
  for i, ex in _records(source, n, name, data_dir):
    labels[i] = ex["label"]
  labels.flags.writeable = False
  return Split(images=None, labels=labels)


@functools.lru_cache(maxsize=8)
def _load_split_cached(name: str, split: str, data_dir: str, limit: int | None
                       ) -> Split:
  """``load_split`` with all arguments resolved (the cache key)."""
  info = sources.get_dataset_info(name)
  source, n = _opened(name, split, data_dir, limit)
  images = np.empty((n, *info.image_shape), np.uint8)
  labels = np.empty((n,), np.int32)
  mode = {1: "L", 3: "RGB"}[info.image_shape[-1]]
  for i, ex in _records(source, n, name, data_dir):
    image = np.asarray(sources.decode(ex["image"], mode))
    image = image.reshape(image.shape[:2] + (-1,))
    if image.shape != info.image_shape:
      raise errors.DataError(
          f"{name}/{split} example {i}: image shape {image.shape}, expected "
          f"{info.image_shape}."
      )
    images[i] = image
    labels[i] = ex["label"]
  images.flags.writeable = False
  labels.flags.writeable = False
  return Split(images=images, labels=labels)
