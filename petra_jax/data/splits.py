"""Opening a split: decoded into memory, labels only, or lazy (ImageNet).

The three entry points (``load_split``, ``open_split``, ``open_labels``)
share one signature and one body (``_open``): check the limit, make sure the
data set is prepared (``prepare.ensure_prepared``: this may download CIFAR),
check the split's shard files, then read it once per process (cached).
"""

import functools
from typing import Literal

import numpy as np

from petra_jax.data import errors
from petra_jax.data import prepare
from petra_jax.data import shards
from petra_jax.data import sources
from petra_jax.data.sources import LazySplit, Split

# Records read and decoded per ``__getitems__`` call.
_READ_CHUNK = 4096


def load_split(name: str, split: str, data_dir: str | None = None,
               limit: int | None = None, download: bool | None = None) -> Split:
  """Decodes a whole split into memory, once per process.

  Results are cached (keyed on the dataset, split, resolved data dir and
  limit); the returned arrays are read-only so the cache cannot be corrupted.
  The full CIFAR-10 train split takes about 10 s to decode and 150 MB; the
  ImageNet32 one about 3.9 GB.

  Args:
    name: registry name (a key of ``DATASETS``) of a non-lazy dataset.
    split: tfds split, e.g. ``"train"``, ``"test"`` or ``"train[:10%]"``.
    data_dir: tfds data dir; ``None`` resolves as in ``resolve_data_dir``.
    limit: if set, only the first ``limit`` examples are decoded.
    download: what to do if the dataset is not in the data dir
      (``ensure_prepared``): None (auto) downloads and prepares CIFAR with
      tfds, True any dataset tfds can download, False none.

  Returns:
    A ``Split`` with uint8 images ``[N, H, W, C]`` and int32 labels ``[N]``.

  Raises:
    DataError: unknown or lazy dataset (use ``open_split``); data not found or
      not downloadable (the message names the dataset, the directory tried and
      how to point to the data or download it); a shard file of the split
      missing, truncated, corrupted or with another record count than its
      metadata says (the message names the file and how to re-prepare the
      dataset); or an image of the wrong shape.
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
  """Opens a split of any dataset: decoded in memory, or lazy for ImageNet.

  Args:
    name, split, data_dir, limit, download: as ``load_split``.

  Returns:
    ``load_split(...)`` for in-memory datasets, a ``LazySplit`` (cached like
    ``load_split``) for ``DatasetInfo.lazy`` ones.

  Raises:
    DataError: as ``load_split`` (bar the lazy dataset).
  """
  return _open(name, split, data_dir, limit, download, "images")


def open_labels(name: str, split: str, data_dir: str | None = None,
                limit: int | None = None, download: bool | None = None
                ) -> Split | LazySplit:
  """Opens a split for a process that needs only its labels.

  In a multi-process run, the process owning the pipeline's last stage needs
  the labels and not the images (stage 0's process reads those). The records
  are read but no image is decoded.

  Args:
    name, split, data_dir, limit, download: as ``load_split``.

  Returns:
    For in-memory datasets, a ``Split`` whose ``images`` is None and whose
    ``labels`` are int32 ``[N]``; for lazy ones, ``open_split``'s
    ``LazySplit`` (read per batch anyway). Read with :func:`read_labels`.

  Raises:
    DataError: as ``open_split``.
  """
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
  """The one body of the entry points: check, prepare, read (cached)."""
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
  """The tfds data source of a prepared split, images left encoded (bytes).

  Checks that the split's shard files are whole (``shards.check_shards``)
  before any record is read.
  """
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
