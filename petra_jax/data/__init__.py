"""Image-classification data: tfds splits, batching and augmentation.

Data sets (paper Sec. 4): CIFAR-10, CIFAR-100, ImageNet32 and ImageNet. The
small ones are decoded once into host memory (``load_split``); their random
crop / flip / normalisation runs on the accelerator as a jittable pure function
(``augment``). ImageNet (1.28M images) cannot be held in memory: its split is a
``LazySplit`` whose records are read and decoded per batch on the host, with
the standard random-resized crop for training and resize 256 / center crop 224
for evaluation. Either way the training loop sees index batches
(``batch_indices``) and one uniform API:

* ``open_split(name, split, data_dir, download=False)`` -> ``Split`` or
  ``LazySplit``;
* ``make_train_batch_fn(info, device)(split, indices, key)`` -> augmented,
  normalised float32 images on ``device`` and their int32 labels;
* ``eval_batches(split, info, batch_size)`` -> normalised batches of one shape
  (the last one padded) with their labels and valid counts.

Data is read with ``tfds.data_source`` (array_record files, no TensorFlow) and
the images are decoded with Pillow, so the pixels do not depend on whether
OpenCV happens to be installed.

Opening a split checks the data first and fails with one ``DataError`` line
that names the fix: a data set that is not prepared in the data dir (point to
one, or pass ``download=True`` to let tfds download and prepare it,
``ensure_prepared``), and a shard file that is missing, truncated or holds
another number of records than the data set's metadata says (re-prepare it).
Only the shards' footers are read for that, not their records.

Example:
  info = get_dataset_info("cifar100")
  train = open_split("cifar100", info.train_split)
  batch_fn = make_train_batch_fn(info, jax.devices()[0])
  for step, idx in enumerate(batch_indices(len(train), 128, seed=0, epoch=0)):
    x, y = batch_fn(train, idx, jax.random.fold_in(key, step))
    # x: f32 [128, 32, 32, 3] on the device; y: int32 [128] (numpy)
"""

import concurrent.futures
import dataclasses
import functools
import io
import math
import os
import pathlib
from typing import Any, Callable, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from PIL import Image

# A tfds data dir next to the repository (``<repo>/../shared/data/...``).
_REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
_SHARED_DATA_DIR = _REPO_ROOT.parent / "shared" / "data" / "tensorflow_datasets"
# tfds' own default.
_TFDS_DEFAULT_DATA_DIR = "~/tensorflow_datasets"
# Records read and decoded per ``__getitems__`` call in ``load_split``.
_READ_CHUNK = 4096
# The usual ImageNet channel statistics (torchvision), in [0, 1] units; also
# used for ImageNet32, whose pixels come from the same images.
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
# ImageNet crops (paper Sec. 4, "standard data augmentation"): torchvision's
# RandomResizedCrop(224) for training, Resize(256) + CenterCrop(224) to eval.
CROP_SCALE = (0.08, 1.0)
CROP_RATIO = (3 / 4, 4 / 3)
EVAL_RESIZE = 256


class DataError(Exception):
  """A dataset cannot be found, read or is used with invalid arguments."""


@dataclasses.dataclass(frozen=True)
class DatasetInfo:
  """Static description of an image-classification dataset.

  Attributes:
    tfds_name: name for ``tfds.data_source``, e.g. ``"cifar10"`` or
      ``"imagenet_resized/32x32"``.
    num_classes: number of labels; labels are ``0 .. num_classes - 1``.
    image_shape: ``(H, W, C)`` of every image.
    mean: per-channel mean of the training pixels, in [0, 1] units, ``[C]``.
    std: per-channel standard deviation, in [0, 1] units, ``[C]``.
    train_split: tfds split name used for training.
    test_split: tfds split name used for evaluation.
    imagenet_stem: the model's stem for this input size: ImageNet's 7x7
      stride-2 convolution and max-pool (True) or the CIFAR 3x3 one (False).
    lazy: if True the split is too large for memory: ``open_split`` returns a
      ``LazySplit`` decoded per batch with ImageNet crops (the images may have
      any size; ``image_shape`` is the crop). If False the split is decoded
      once (``load_split``) and augmented with ``augment``.
  """

  tfds_name: str
  num_classes: int
  image_shape: tuple[int, int, int]
  mean: tuple[float, ...]
  std: tuple[float, ...]
  train_split: str = "train"
  test_split: str = "test"
  imagenet_stem: bool = False
  lazy: bool = False


DATASETS: dict[str, DatasetInfo] = {
    "cifar10": DatasetInfo(
        tfds_name="cifar10",
        num_classes=10,
        image_shape=(32, 32, 3),
        mean=(0.4914, 0.4822, 0.4465),
        std=(0.2470, 0.2435, 0.2616),
    ),
    "cifar100": DatasetInfo(
        tfds_name="cifar100",
        num_classes=100,
        image_shape=(32, 32, 3),
        mean=(0.5071, 0.4865, 0.4409),
        std=(0.2673, 0.2564, 0.2762),
    ),
    "imagenet32": DatasetInfo(
        tfds_name="imagenet_resized/32x32",
        num_classes=1000,
        image_shape=(32, 32, 3),
        mean=IMAGENET_MEAN,
        std=IMAGENET_STD,
        test_split="validation",
    ),
    "imagenet": DatasetInfo(
        tfds_name="imagenet2012",
        num_classes=1000,
        image_shape=(224, 224, 3),
        mean=IMAGENET_MEAN,
        std=IMAGENET_STD,
        test_split="validation",
        imagenet_stem=True,
        lazy=True,
    ),
}


@dataclasses.dataclass(frozen=True, eq=False)
class Split:
  """A whole dataset split in host memory (arrays are read-only).

  Attributes:
    images: uint8 ``[N, H, W, C]``, pixel values 0..255; None in a
      labels-only split (``open_labels``).
    labels: int32 ``[N]``, values in ``[0, num_classes)``.
  """

  images: np.ndarray | None
  labels: np.ndarray

  def __len__(self) -> int:
    return len(self.labels)


@dataclasses.dataclass(frozen=True, eq=False)
class LazySplit:
  """A split read and decoded per batch (ImageNet: too large for memory).

  Attributes:
    name: registry name of the dataset.
    source: the tfds data source; ``source[i]`` is a dict with the encoded
      image bytes under ``"image"`` and an int ``"label"``.
    num_examples: examples used, ``len(source)`` or fewer (``limit``).
  """

  name: str
  source: Any
  num_examples: int

  def __len__(self) -> int:
    return self.num_examples

  def read(self, indices: Sequence[int]) -> tuple[list[bytes], np.ndarray]:
    """Encoded images (a list of ``len(indices)`` bytes) and int32 labels.

    Raises:
      DataError: a record cannot be read (corrupted shard file).
    """
    records = _read_records(self.source, indices, self.name)
    labels = np.array([r["label"] for r in records], np.int32)
    return [r["image"] for r in records], labels


def get_dataset_info(name: str) -> DatasetInfo:
  """Returns the registry entry for ``name``.

  Raises:
    DataError: ``name`` is not in ``DATASETS``; the message lists known names.
  """
  try:
    return DATASETS[name]
  except KeyError:
    raise DataError(
        f"Unknown dataset {name!r}; known datasets: {', '.join(sorted(DATASETS))}."
    ) from None


def resolve_data_dir(data_dir: str | None) -> str:
  """Chooses the tfds data dir.

  Precedence: ``data_dir`` (the config value) > ``$TFDS_DATA_DIR`` >
  ``<repo root>/../shared/data/tensorflow_datasets`` when that folder exists >
  tfds' default ``~/tensorflow_datasets``. Empty strings count as unset.

  Args:
    data_dir: explicit data dir, or ``None``/``""`` to fall back.

  Returns:
    The data dir (not checked for existence, except for the shared folder).
  """
  if data_dir:
    return str(data_dir)
  env = os.environ.get("TFDS_DATA_DIR")
  if env:
    return env
  if _SHARED_DATA_DIR.is_dir():
    return str(_SHARED_DATA_DIR)
  return os.path.expanduser(_TFDS_DEFAULT_DATA_DIR)


def _missing_data_error(
    name: str, data_dir: str, reason: str, download_hint: bool = False
) -> DataError:
  hint = ""
  if download_hint:
    hint = (" Or set --config.download=True to download and prepare it there "
            "with tfds (needs network access; ImageNet needs its archives "
            "downloaded by hand first).")
  return DataError(
      f"Cannot load dataset {name!r} from data dir {data_dir!r}: {reason}. "
      "Point to a tfds data dir that holds it with "
      "--config.data_dir=/path/to/tensorflow_datasets or by setting "
      f"TFDS_DATA_DIR=/path/to/tensorflow_datasets.{hint}"
  )


def _one_line(e: BaseException, limit: int = 300) -> str:
  """``Type: message`` of an exception on one line, at most ``limit`` chars."""
  text = " ".join(str(e).split())
  if len(text) > limit:
    text = text[: limit - 3] + "..."
  return f"{type(e).__name__}: {text}" if text else type(e).__name__


def _tfds_builder(info: DatasetInfo, data_dir: str):
  """tfds' builder of a dataset in ``data_dir`` (reads no records)."""
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top

  return tfds.builder(info.tfds_name, data_dir=data_dir, file_format="array_record")


def _rebuild_command(info: DatasetInfo, data_dir: str) -> str:
  return (f"tfds build {info.tfds_name} --data_dir={data_dir} "
          "--file_format=array_record")


def ensure_prepared(
    name: str, data_dir: str | None = None, download: bool = False
) -> str:
  """Makes sure a dataset is prepared (tfds format) in its data dir.

  If it is, nothing happens (only its ``dataset_info.json`` is read). If it is
  not and ``download`` is True, tfds downloads and prepares it there
  (``DatasetBuilder.download_and_prepare``: archives go to
  ``<data_dir>/downloads``; CIFAR-10 is about 170 MB, ImageNet32 several GB,
  and ImageNet cannot be downloaded: tfds needs its archives in
  ``<data_dir>/downloads/manual``). In a multi-process run call it with
  ``download=True`` in one process only, then synchronise, so that processes
  do not prepare the same data concurrently.

  ``download`` defaults to False (and so should ``config.download``): a
  mistyped data dir then fails at once with an error naming the fixes, rather
  than silently starting a download of gigabytes into the wrong place, or
  hanging on retries on a compute node without network.

  Args:
    name: registry name (a key of ``DATASETS``).
    data_dir: tfds data dir; ``None`` resolves as in ``resolve_data_dir``.
    download: whether to download and prepare a dataset that is missing.

  Returns:
    The resolved data dir (``str``) that holds the prepared dataset.

  Raises:
    DataError: unknown dataset; dataset missing and ``download`` False (the
      message names ``--config.data_dir``, ``TFDS_DATA_DIR`` and
      ``--config.download``); or the download / preparation failed, e.g. no
      network (the message names the error and both fixes: point to a
      prepared copy, or run on a machine with network access).
  """
  info = get_dataset_info(name)
  data_dir = resolve_data_dir(data_dir)
  prepared, where = _is_prepared(name, info, data_dir)
  if prepared:
    return data_dir
  if not download:
    raise _missing_data_error(name, data_dir, f"no prepared copy at {where!r}",
                              download_hint=True)
  _download_and_prepare(name, info, data_dir)
  prepared, where = _is_prepared(name, info, data_dir)
  if not prepared:
    raise DataError(
        f"tfds' download_and_prepare of dataset {name!r} left no prepared copy "
        f"at {where!r}. Prepare it with `{_rebuild_command(info, data_dir)}` "
        "and point --config.data_dir (or TFDS_DATA_DIR) at that data dir."
    )
  return data_dir


def _download_and_prepare(name: str, info: DatasetInfo, data_dir: str) -> None:
  """tfds' ``download_and_prepare``; any failure as one :class:`DataError`."""
  try:
    _tfds_builder(info, data_dir).download_and_prepare()
  except Exception as e:  # pylint: disable=broad-except
    needs = ""
    if isinstance(e, ImportError):
      needs = " The tfds builder of this dataset needs that module: pip install it."
    raise DataError(
        f"Dataset {name!r} is not in data dir {data_dir!r} and tfds could not "
        f"download and prepare it there ({_one_line(e)}).{needs} Either point "
        "--config.data_dir (or TFDS_DATA_DIR) at a tfds data dir that holds a "
        "prepared copy, or run with --config.download=True on a machine with "
        f"network access (or run `{_rebuild_command(info, data_dir)}` there and "
        "copy the data dir over)."
    ) from e


def _is_prepared(name: str, info: DatasetInfo, data_dir: str) -> tuple[bool, str]:
  """Whether tfds finds the dataset prepared in ``data_dir``, and where it
  looked (``<data_dir>/<name>[/<config>]/<version>``).

  Raises:
    DataError: tfds cannot build the dataset's description (e.g. an unreadable
      ``dataset_info.json``).
  """
  try:
    builder = _tfds_builder(info, data_dir)
    return bool(builder.is_prepared()), str(builder.data_dir)
  except Exception as e:  # pylint: disable=broad-except
    reason = f"tfds cannot read its metadata ({_one_line(e)})"
    raise _missing_data_error(name, data_dir, reason) from None


def load_split(
    name: str,
    split: str,
    data_dir: str | None = None,
    limit: int | None = None,
    download: bool = False,
) -> Split:
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
    download: if the dataset is not in the data dir, download and prepare it
      with tfds (``ensure_prepared``); if False, a missing dataset is an error.

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
  if get_dataset_info(name).lazy:
    raise DataError(
        f"Dataset {name!r} is too large to decode into memory; read it per "
        "batch with open_split / make_train_batch_fn / eval_batches."
    )
  _check_limit(limit)
  if download:
    ensure_prepared(name, data_dir, download=True)
  return _load_split_cached(name, split, resolve_data_dir(data_dir), limit)


def open_split(
    name: str,
    split: str,
    data_dir: str | None = None,
    limit: int | None = None,
    download: bool = False,
) -> Split | LazySplit:
  """Opens a split of any dataset: decoded in memory, or lazy for ImageNet.

  Args:
    name: registry name (a key of ``DATASETS``).
    split: tfds split name.
    data_dir: tfds data dir; ``None`` resolves as in ``resolve_data_dir``.
    limit: if set, only the first ``limit`` examples are used.
    download: as ``load_split``.

  Returns:
    ``load_split(...)`` for in-memory datasets, a ``LazySplit`` (cached like
    ``load_split``) for ``DatasetInfo.lazy`` ones.

  Raises:
    DataError: as ``load_split``.
  """
  if not get_dataset_info(name).lazy:
    return load_split(name, split, data_dir, limit, download)
  _check_limit(limit)
  if download:
    ensure_prepared(name, data_dir, download=True)
  return _open_lazy_cached(name, split, resolve_data_dir(data_dir), limit)


def open_labels(
    name: str,
    split: str,
    data_dir: str | None = None,
    limit: int | None = None,
    download: bool = False,
) -> Split | LazySplit:
  """Opens a split for a process that needs only its labels.

  In a multi-process run, the process owning the pipeline's last stage needs
  the labels and not the images (stage 0's process reads those). The records
  are read but no image is decoded.

  Args:
    name, split, data_dir, limit, download: as ``open_split``.

  Returns:
    For in-memory datasets, a ``Split`` whose ``images`` is None and whose
    ``labels`` are int32 ``[N]``; for lazy ones, ``open_split``'s
    ``LazySplit`` (read per batch anyway). Read with :func:`read_labels`.

  Raises:
    DataError: as ``load_split``.
  """
  if get_dataset_info(name).lazy:
    return open_split(name, split, data_dir, limit, download)
  _check_limit(limit)
  if download:
    ensure_prepared(name, data_dir, download=True)
  return _load_labels_cached(name, split, resolve_data_dir(data_dir), limit)


def read_labels(split: Split | LazySplit, indices: np.ndarray) -> np.ndarray:
  """int32 labels ``[len(indices)]`` of a split from ``open_split`` or
  ``open_labels``, without decoding images."""
  if isinstance(split, LazySplit):
    records = _read_records(split.source, indices, split.name)
    return np.array([r["label"] for r in records], np.int32)
  return split.labels[indices]


@functools.lru_cache(maxsize=8)
def _load_labels_cached(
    name: str, split: str, data_dir: str, limit: int | None
) -> Split:
  source = _open_source(name, split, data_dir)
  n = len(source) if limit is None else min(limit, len(source))
  labels = np.empty((n,), np.int32)
  for start in range(0, n, _READ_CHUNK):
    stop = min(start + _READ_CHUNK, n)
    for i, ex in enumerate(_read_records(source, range(start, stop), name), start):
      labels[i] = ex["label"]
  labels.flags.writeable = False
  return Split(images=None, labels=labels)


def _check_limit(limit: int | None) -> None:
  if limit is not None and limit < 0:
    raise DataError(f"limit must be >= 0 or None, got {limit}.")


def _open_source(name: str, split: str, data_dir: str):
  """The tfds data source of a split, images left encoded (bytes).

  Checks that the dataset is prepared and that the split's shard files are
  whole (``_check_shards``) before any record is read.
  """
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top

  info = get_dataset_info(name)
  dataset_dir = pathlib.Path(data_dir).expanduser() / info.tfds_name.split(":")[0]
  if not dataset_dir.is_dir():
    raise _missing_data_error(name, data_dir, f"no folder {str(dataset_dir)!r}",
                              download_hint=True)
  prepared, where = _is_prepared(name, info, data_dir)
  if not prepared:
    raise _missing_data_error(name, data_dir, f"no prepared copy at {where!r}",
                              download_hint=True)
  try:
    source = tfds.data_source(
        info.tfds_name,
        split=split,
        data_dir=data_dir,
        download=False,
        decoders={"image": tfds.decode.SkipDecoding()},
    )
  except Exception as e:  # pylint: disable=broad-except
    reason = f"tfds failed ({type(e).__name__}: {str(e).splitlines()[0]})"
    raise _missing_data_error(name, data_dir, reason) from None
  _check_shards(name, info, split, data_dir, source)
  return source


def _check_shards(name: str, info: DatasetInfo, split: str, data_dir: str,
                  source: Any) -> None:
  """Raises DataError if a shard file of the split is not whole.

  Each array_record file the split reads is opened: that reads its
  postscript and footer (the record index, a few bytes per record), which a
  truncated or partly copied file lacks, and gives its record count, compared
  with the shard length in ``dataset_info.json``. No record is read.
  """
  try:
    instructions = source.dataset_info.splits[split].file_instructions
  except Exception:  # pylint: disable=broad-except
    return  # tfds' internals changed: reads still fail with a DataError.
  expected = {}
  for fi in instructions:
    expected[os.fspath(fi.filename)] = int(fi.examples_in_shard)
  problems = _thread_pool().map(_shard_problem, expected, expected.values())
  for path, problem in zip(expected, problems):
    if problem:
      raise DataError(
          f"Dataset {name!r} in data dir {data_dir!r} is damaged: shard file "
          f"{path!r} {problem}. Re-prepare the dataset: delete "
          f"{os.path.dirname(path)!r}, then run `{_rebuild_command(info, data_dir)}` "
          "or rerun with --config.download=True (or copy it again from a good "
          "copy)."
      )


def _shard_problem(path: str, expected_records: int) -> str | None:
  """What is wrong with one array_record shard file, or None if nothing."""
  from array_record.python import array_record_module  # pylint: disable=g-import-not-at-top

  if not os.path.isfile(path):
    return "is missing"
  size = os.path.getsize(path)
  status, ok, num_records = "", False, 0
  try:
    reader = array_record_module.ArrayRecordReader(
        path, "readahead_buffer_size:0", file_reader_buffer_size=32768)
  except Exception as e:  # pylint: disable=broad-except
    status = _one_line(e)
  else:
    ok = reader.ok()
    num_records = reader.num_records() if ok else 0
    try:
      reader.close()  # raises the reader's error if it failed
    except Exception as e:  # pylint: disable=broad-except
      status = _one_line(e)
  if not ok or status:
    return (f"cannot be read, it is truncated or corrupted ({size} bytes on disk; "
            f"{status or 'array_record reader failed'})")
  if num_records != expected_records:
    return (f"holds {num_records} records where the dataset's metadata "
            f"(dataset_info.json) says {expected_records}")
  return None


def _read_records(source: Any, indices: Sequence[int], name: str) -> Sequence[Any]:
  """``source.__getitems__(indices)``; a read failure becomes a DataError."""
  try:
    return source.__getitems__([int(i) for i in indices])
  except (RuntimeError, OSError) as e:
    where = getattr(getattr(source, "dataset_info", None), "data_dir", None)
    where = f" in {str(where)!r}" if where else ""
    raise DataError(
        f"Dataset {name!r}{where} cannot be read, a shard file is corrupted "
        f"({_one_line(e)}). Re-prepare the dataset: delete that folder, then run "
        f"`tfds build {get_dataset_info(name).tfds_name} --file_format=array_record "
        "--data_dir=...` or rerun with --config.download=True (or copy it again "
        "from a good copy)."
    ) from None


@functools.lru_cache(maxsize=8)
def _open_lazy_cached(
    name: str, split: str, data_dir: str, limit: int | None
) -> LazySplit:
  source = _open_source(name, split, data_dir)
  n = len(source) if limit is None else min(limit, len(source))
  return LazySplit(name=name, source=source, num_examples=n)


@functools.lru_cache(maxsize=8)
def _load_split_cached(
    name: str, split: str, data_dir: str, limit: int | None
) -> Split:
  """``load_split`` with all arguments resolved (the cache key)."""
  info = get_dataset_info(name)
  source = _open_source(name, split, data_dir)
  n = len(source) if limit is None else min(limit, len(source))
  images = np.empty((n, *info.image_shape), np.uint8)
  labels = np.empty((n,), np.int32)
  mode = {1: "L", 3: "RGB"}[info.image_shape[-1]]
  for start in range(0, n, _READ_CHUNK):
    stop = min(start + _READ_CHUNK, n)
    for i, ex in enumerate(_read_records(source, range(start, stop), name), start):
      image = np.asarray(_decode(ex["image"], mode))
      image = image.reshape(image.shape[:2] + (-1,))
      if image.shape != info.image_shape:
        raise DataError(
            f"{name}/{split} example {i}: image shape {image.shape}, expected "
            f"{info.image_shape}."
        )
      images[i] = image
      labels[i] = ex["label"]
  images.flags.writeable = False
  labels.flags.writeable = False
  return Split(images=images, labels=labels)


def _decode(encoded: bytes, mode: str = "RGB") -> Image.Image:
  """Decodes PNG/JPEG bytes with Pillow into ``mode`` ("RGB" or "L")."""
  return Image.open(io.BytesIO(encoded)).convert(mode)


def epoch_permutation(num_examples: int, seed: int, epoch: int) -> np.ndarray:
  """The example order of one epoch, a function of ``(seed, epoch)`` only.

  Args:
    num_examples: dataset size N.
    seed: non-negative run seed.
    epoch: non-negative epoch number.

  Returns:
    int64 ``[N]``, a permutation of ``0 .. N - 1``.
  """
  return np.random.default_rng((seed, epoch)).permutation(num_examples)


def batch_indices(
    num_examples: int,
    batch_size: int,
    seed: int,
    epoch: int,
    steps_per_epoch: int = 0,
) -> np.ndarray:
  """Index batches of one epoch: the shuffled order cut into full batches.

  The last partial batch is dropped.

  Args:
    num_examples: dataset size N.
    batch_size: examples per batch B.
    seed: non-negative run seed.
    epoch: non-negative epoch number.
    steps_per_epoch: if > 0, at most this many batches are returned.

  Returns:
    int64 ``[S, B]``; row ``s`` holds the example indices of step ``s``, with
    ``S = min(N // B, steps_per_epoch or N // B)``. No index repeats.

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


def normalize(
    images: jax.Array, mean: Sequence[float], std: Sequence[float]
) -> jax.Array:
  """Per-channel standardisation ``(x / 255 - mean) / std``.

  Args:
    images: ``[..., C]`` pixels in 0..255 (uint8 or float).
    mean: ``[C]`` channel means in [0, 1] units.
    std: ``[C]`` channel standard deviations in [0, 1] units.

  Returns:
    float32 array of the same shape.
  """
  mean = jnp.asarray(mean, jnp.float32)
  std = jnp.asarray(std, jnp.float32)
  return (images.astype(jnp.float32) / 255.0 - mean) / std


def augment(
    key: jax.Array,
    images: jax.Array,
    mean: Sequence[float],
    std: Sequence[float],
    pad: int = 4,
) -> jax.Array:
  """Random crop (zero padding), random horizontal flip, then ``normalize``.

  The standard CIFAR augmentation: each image is zero-padded by ``pad`` pixels
  on every side, a random ``H x W`` window is cut out (offsets uniform in
  ``0 .. 2 * pad``, independently per image), and it is mirrored left-right
  with probability 0.5. Padding happens before normalisation, so padded pixels
  are black (as in torchvision's ``RandomCrop(padding=4)``). Pure and jittable.

  Args:
    key: PRNG key.
    images: uint8 ``[B, H, W, C]``.
    mean: ``[C]`` channel means in [0, 1] units.
    std: ``[C]`` channel standard deviations in [0, 1] units.
    pad: padding in pixels (a static Python int).

  Returns:
    float32 ``[B, H, W, C]``.
  """
  b, h, w, c = images.shape
  crop_key, flip_key = jax.random.split(key)
  offsets = jax.random.randint(crop_key, (b, 2), 0, 2 * pad + 1)
  flips = jax.random.bernoulli(flip_key, 0.5, (b,))
  padded = jnp.pad(images, ((0, 0), (pad, pad), (pad, pad), (0, 0)))

  def crop_flip(image, offset, flip):
    crop = jax.lax.dynamic_slice(image, (offset[0], offset[1], 0), (h, w, c))
    return jnp.where(flip, crop[:, ::-1], crop)

  return normalize(jax.vmap(crop_flip)(padded, offsets, flips), mean, std)


# ------------------------------------------------ ImageNet crops (host side)


def random_resized_crop_box(
    height: int,
    width: int,
    rng: np.random.Generator,
    scale: tuple[float, float] = CROP_SCALE,
    ratio: tuple[float, float] = CROP_RATIO,
) -> tuple[int, int, int, int]:
  """A random crop box, as torchvision's ``RandomResizedCrop.get_params``.

  Up to 10 tries draw an area fraction uniform in ``scale`` and a log-uniform
  aspect ratio (width / height) in ``ratio``; the first box that fits is
  placed uniformly. If none fits, the central crop of the whole image with
  its aspect ratio clamped to ``ratio`` is returned.

  Args:
    height: image height H in pixels.
    width: image width W in pixels.
    rng: NumPy generator (the only source of randomness).
    scale: bounds of the crop area as a fraction of ``H * W``.
    ratio: bounds of the crop's width / height.

  Returns:
    ``(top, left, crop_height, crop_width)`` in pixels, inside the image.
  """
  area = height * width
  log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
  for _ in range(10):
    target_area = area * rng.uniform(*scale)
    aspect = math.exp(rng.uniform(*log_ratio))
    w = int(round(math.sqrt(target_area * aspect)))
    h = int(round(math.sqrt(target_area / aspect)))
    if 0 < w <= width and 0 < h <= height:
      return int(rng.integers(0, height - h + 1)), int(rng.integers(0, width - w + 1)), h, w
  in_ratio = width / height
  if in_ratio < ratio[0]:
    w, h = width, int(round(width / ratio[0]))
  elif in_ratio > ratio[1]:
    h, w = height, int(round(height * ratio[1]))
  else:
    w, h = width, height
  return (height - h) // 2, (width - w) // 2, h, w


def imagenet_train_image(encoded: bytes, seed: int, size: int = 224) -> np.ndarray:
  """Decodes one image, random-resized-crops it to ``size`` and maybe flips it.

  Bilinear resampling (Pillow), a horizontal flip with probability 0.5.

  Args:
    encoded: JPEG/PNG bytes of an image of any size.
    seed: seed of this image's crop and flip.
    size: output side in pixels.

  Returns:
    uint8 ``[size, size, 3]``.
  """
  rng = np.random.default_rng(seed)
  image = _decode(encoded)
  top, left, h, w = random_resized_crop_box(image.height, image.width, rng)
  image = image.resize((size, size), Image.BILINEAR, box=(left, top, left + w, top + h))
  out = np.asarray(image)
  return out[:, ::-1] if rng.random() < 0.5 else out


def imagenet_eval_image(
    encoded: bytes, size: int = 224, resize: int = EVAL_RESIZE
) -> np.ndarray:
  """Decodes one image, resizes its shorter side to ``resize``, center-crops.

  As torchvision's ``Resize(256)`` + ``CenterCrop(224)``, bilinear.

  Args:
    encoded: JPEG/PNG bytes of an image of any size.
    size: output side in pixels.
    resize: shorter side after resizing, in pixels (>= ``size``).

  Returns:
    uint8 ``[size, size, 3]``.
  """
  image = _decode(encoded)
  w, h = image.size
  if w <= h:
    new_w, new_h = resize, int(resize * h / w)
  else:
    new_w, new_h = int(resize * w / h), resize
  if (new_w, new_h) != (w, h):
    image = image.resize((new_w, new_h), Image.BILINEAR)
  top, left = int(round((new_h - size) / 2)), int(round((new_w - size) / 2))
  return np.asarray(image)[top:top + size, left:left + size]


@functools.lru_cache(maxsize=1)
def _thread_pool() -> concurrent.futures.ThreadPoolExecutor:
  """Decoding threads (Pillow releases the GIL while decoding and resizing)."""
  return concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 1)


def _decode_lazy_batch(
    split: LazySplit, indices: Sequence[int], transform: Callable[..., np.ndarray],
    *per_image_args: Sequence[Any],
) -> tuple[np.ndarray, np.ndarray]:
  """Reads ``indices`` and maps ``transform`` over them on the thread pool."""
  encoded, labels = split.read(indices)
  images = list(_thread_pool().map(transform, encoded, *per_image_args))
  return np.stack(images), labels


# ---------------------------------------------------- uniform batch API


TrainBatchFn = Callable[[Any, np.ndarray, jax.Array], tuple[jax.Array, np.ndarray]]


def make_train_batch_fn(info: DatasetInfo, device: jax.Device) -> TrainBatchFn:
  """The training-batch function of a dataset (paper Sec. 4 augmentation).

  In-memory datasets: gather uint8 images, ship them to ``device``, then
  ``augment`` (pad-4 random crop + flip + normalise) there. Lazy ones
  (ImageNet): read and decode on the host, random-resized crop to
  ``info.image_shape`` + flip (``imagenet_train_image``), ship the uint8 crops,
  normalise on ``device``.

  Args:
    info: the dataset's registry entry.
    device: where the images go (the first stage's device).

  Returns:
    ``fn(split, indices, key) -> (images, labels)``: ``split`` from
    ``open_split``; ``indices`` int ``[B]``; ``key`` a PRNG key (the batch's
    randomness, as a function of the key only); ``images`` float32
    ``[B, H, W, C]`` on ``device``; ``labels`` int32 ``[B]`` (NumPy).
  """
  normalize_fn = jax.jit(functools.partial(normalize, mean=info.mean, std=info.std))
  if not info.lazy:
    augment_fn = jax.jit(functools.partial(augment, mean=info.mean, std=info.std))

    def in_memory_fn(split: Split, indices: np.ndarray, key: jax.Array):
      images = jax.device_put(split.images[indices], device)
      return augment_fn(jax.device_put(key, device), images), split.labels[indices]

    return in_memory_fn

  size = info.image_shape[0]

  def lazy_fn(split: LazySplit, indices: np.ndarray, key: jax.Array):
    seeds = np.random.default_rng(np.asarray(jax.random.key_data(key)).ravel()
                                  ).integers(0, 2**63, len(indices))
    transform = functools.partial(imagenet_train_image, size=size)
    images, labels = _decode_lazy_batch(split, indices, transform, seeds.tolist())
    return normalize_fn(jax.device_put(images, device)), labels

  return lazy_fn


def eval_batches(
    split: Split | LazySplit,
    info: DatasetInfo,
    batch_size: int,
    device: jax.Device | None = None,
) -> Iterator[tuple[jax.Array, np.ndarray, int]]:
  """The split in order, normalised, in batches of one shape.

  Lazy (ImageNet) images are resized to 256 on the shorter side and
  center-cropped to ``info.image_shape`` (``imagenet_eval_image``).

  Args:
    split: from ``open_split``.
    info: the dataset's registry entry.
    batch_size: images per batch B.
    device: where the images go; ``None`` = JAX's default device.

  Yields:
    ``(images, labels, valid)``: float32 ``[B, H, W, C]`` on ``device``, whose
    rows past ``valid`` (last batch only) are padding, black images before
    normalisation; int32 labels ``[valid]`` (NumPy); ``valid`` in ``1 .. B``.

  Raises:
    ValueError: ``batch_size < 1``.
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
