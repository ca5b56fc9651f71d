"""The data sets and their tfds data sources: registry, splits, record reads.

Data sets (paper Sec. 4): CIFAR-10, CIFAR-100, ImageNet32 and ImageNet, each a
``DatasetInfo`` in ``DATASETS``. Records are read with ``tfds.data_source``
(array_record files, no TensorFlow) and images decoded with Pillow, so the
pixels do not depend on whether OpenCV happens to be installed.
"""

import concurrent.futures
import dataclasses
import functools
import io
import os
from typing import Any, Sequence

import numpy as np
from PIL import Image

from petra_jax.data import errors

# The usual ImageNet channel statistics (torchvision), in [0, 1] units; also
# used for ImageNet32, whose pixels come from the same images.
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


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
    auto_download: small enough (a few hundred MB) for tfds to download and
      prepare on first use when it is missing (``download=None``, the
      default); the others download only when asked (``download=True``).
    manual_archives: files tfds needs in ``<data_dir>/downloads/manual``
      because it cannot download them (ImageNet); () when tfds downloads the
      data itself.
    size: download size, for messages.
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
  auto_download: bool = False
  manual_archives: tuple[str, ...] = ()
  size: str = ""


DATASETS: dict[str, DatasetInfo] = {
    "cifar10": DatasetInfo("cifar10", 10, (32, 32, 3), mean=(0.4914, 0.4822, 0.4465),
                           std=(0.2470, 0.2435, 0.2616), auto_download=True,
                           size="about 170 MB"),
    "cifar100": DatasetInfo("cifar100", 100, (32, 32, 3), mean=(0.5071, 0.4865, 0.4409),
                            std=(0.2673, 0.2564, 0.2762), auto_download=True,
                            size="about 170 MB"),
    "imagenet32": DatasetInfo("imagenet_resized/32x32", 1000, (32, 32, 3), IMAGENET_MEAN,
                              IMAGENET_STD, test_split="validation", size="about 3.7 GB"),
    "imagenet": DatasetInfo("imagenet2012", 1000, (224, 224, 3), IMAGENET_MEAN, IMAGENET_STD,
                            test_split="validation", imagenet_stem=True, lazy=True,
                            manual_archives=("ILSVRC2012_img_train.tar",
                                             "ILSVRC2012_img_val.tar"),
                            size="about 150 GB"),
}


def get_dataset_info(name: str) -> DatasetInfo:
  """Returns the registry entry for ``name``.

  Raises:
    DataError: ``name`` is not in ``DATASETS``; the message lists known names.
  """
  try:
    return DATASETS[name]
  except KeyError:
    raise errors.DataError(
        f"Unknown dataset {name!r}; known datasets: {', '.join(sorted(DATASETS))}."
    ) from None


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
    data_dir: the tfds data dir it was opened from (for error messages).
  """

  name: str
  source: Any
  num_examples: int
  data_dir: str = ""

  def __len__(self) -> int:
    return self.num_examples

  def read(self, indices: Sequence[int]) -> tuple[list[bytes], np.ndarray]:
    """Encoded images (a list of ``len(indices)`` bytes) and int32 labels.

    Raises:
      DataError: a record cannot be read (corrupted shard file).
    """
    records = read_records(self.source, indices, self.name, self.data_dir)
    labels = np.array([r["label"] for r in records], np.int32)
    return [r["image"] for r in records], labels


def tfds_builder(info: DatasetInfo, data_dir: str):
  """tfds' builder of a dataset in ``data_dir`` (reads no records).

  Raises:
    Exception: whatever tfds raises (callers turn it into a ``DataError``).
  """
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top

  return tfds.builder(info.tfds_name, data_dir=data_dir, file_format="array_record")


def data_source(info: DatasetInfo, split: str, data_dir: str):
  """tfds' data source of a prepared split, images left encoded (bytes).

  Raises:
    Exception: whatever tfds raises (callers turn it into a ``DataError``).
  """
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top

  return tfds.data_source(
      info.tfds_name,
      split=split,
      data_dir=data_dir,
      download=False,
      decoders={"image": tfds.decode.SkipDecoding()},
  )


def read_records(source: Any, indices: Sequence[int], name: str,
                 data_dir: str) -> Sequence[Any]:
  """``source.__getitems__(indices)``; a read failure becomes a DataError.

  Args:
    source: a tfds data source (``data_source``).
    indices: record indices.
    name: registry name of the dataset (for the message).
    data_dir: the tfds data dir it was opened from (for the message).

  Returns:
    The records, dicts with ``"image"`` (bytes) and ``"label"`` (int).

  Raises:
    DataError: a record cannot be read, a shard file is corrupted; the message
      names the folder and how to re-prepare the dataset.
  """
  try:
    return source.__getitems__([int(i) for i in indices])
  except (RuntimeError, OSError) as e:
    folder = getattr(getattr(source, "dataset_info", None), "data_dir", None)
    folder = str(folder) if folder else data_dir
    raise errors.damaged_data_error(
        name, f" in {folder!r}", f"a shard file is corrupted ({errors.one_line(e)})",
        folder, get_dataset_info(name).tfds_name, data_dir or "...") from None


def decode(encoded: bytes, mode: str = "RGB") -> Image.Image:
  """Decodes PNG/JPEG bytes with Pillow into ``mode`` ("RGB" or "L")."""
  return Image.open(io.BytesIO(encoded)).convert(mode)


@functools.lru_cache(maxsize=1)
def thread_pool() -> concurrent.futures.ThreadPoolExecutor:
  """Decoding threads (Pillow releases the GIL while decoding and resizing)."""
  return concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 1)
