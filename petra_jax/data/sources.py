"""The data sets (``DATASETS``), their splits and record reads through ``tfds.data_source``.

Records are array_record files read without TensorFlow; images are decoded with Pillow.
"""

import concurrent.futures
import contextlib
import dataclasses
import functools
import io
import os
import tempfile
from typing import Any, Sequence

import numpy as np
from PIL import Image

from petra_jax.data import errors

# torchvision's ImageNet channel statistics, in [0, 1] units (ImageNet32 too).
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


@dataclasses.dataclass(frozen=True)
class DatasetInfo:
  """Static description of a dataset (image classification, or text).

  Attributes:
    image_shape: ``(H, W, C)`` of every image (of the crop, if ``lazy``).
    mean, std: per-channel ``[C]`` statistics of the training pixels, in [0, 1] units.
    imagenet_stem: the model uses ImageNet's 7x7 stride-2 stem and max-pool.
    lazy: too large for memory; ``open_split`` returns a ``LazySplit``.
    auto_download: tfds downloads it when missing with ``download=None``.
    manual_archives: files tfds needs in ``<data_dir>/downloads/manual``.
    size: download size, for messages.
    objective: the objective's name (``petra_jax.engine.stages.objective``): ``"classification"``, or
      ``"next_token"`` for text (``image_shape`` ``(T,)`` and ``num_classes`` ``V`` are set
      when the text is opened: ``data.text.open_text``).
    eval_prefix: the metrics' prefix of evaluations on ``test_split`` during training.
    final_split: a split evaluated once at the end (metrics ``test_*``); "" for none.
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
  objective: str = "classification"
  eval_prefix: str = "test"
  final_split: str = ""


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
    # image_shape (T,): model.context's default; num_classes: the train split's 65 characters.
    "tiny_shakespeare": DatasetInfo("tiny_shakespeare", 65, (64,), (), (), test_split="validation",
                                    auto_download=True, size="about 1 MB", objective="next_token",
                                    eval_prefix="val", final_split="test"),
}


def get_dataset_info(name: str) -> DatasetInfo:
  """The registry entry for ``name``; DataError listing the known names if unknown."""
  try:
    return DATASETS[name]
  except KeyError:
    raise errors.DataError(
        f"Unknown dataset {name!r}; known datasets: {', '.join(sorted(DATASETS))}."
    ) from None


@dataclasses.dataclass(frozen=True, eq=False)
class Split:
  """A split in host memory, read-only: uint8 ``images`` ``[N, H, W, C]`` (None from
  ``open_labels``), int32 ``labels`` ``[N]``."""

  images: np.ndarray | None
  labels: np.ndarray

  def __len__(self) -> int:
    return len(self.labels)


@dataclasses.dataclass(frozen=True, eq=False)
class LazySplit:
  """A split read and decoded per batch; ``source[i]`` is ``{"image": bytes, "label": int}``."""

  name: str
  source: Any
  num_examples: int
  data_dir: str = ""

  def __len__(self) -> int:
    return self.num_examples

  def read(self, indices: Sequence[int]) -> tuple[list[bytes], np.ndarray]:
    """Encoded images (``len(indices)`` bytes objects) and int32 labels; DataError if unreadable."""
    records = read_records(self.source, indices, self.name, self.data_dir)
    labels = np.array([r["label"] for r in records], np.int32)
    return [r["image"] for r in records], labels


def tfds_builder(info: DatasetInfo, data_dir: str):
  """tfds' builder of a dataset in ``data_dir``; raises whatever tfds raises.

  Built inside :func:`_scratch_tempdir`: for a data set not prepared in ``data_dir``,
  tfds 4.9's ``DatasetInfo.initialize_from_bucket`` makes a temporary folder that it
  leaves behind (empty: tfds reads no bucket here), one per builder.
  """
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top

  with _scratch_tempdir():
    return tfds.builder(info.tfds_name, data_dir=data_dir, file_format="array_record")


@contextlib.contextmanager
def _scratch_tempdir():
  """``tempfile``'s default folder set to a new one, removed with what is in it at exit.

  Process-wide while it lasts (``tempfile.tempdir``): use it around calls that start
  no threads and while none of this process's threads makes temporary files.
  """
  with tempfile.TemporaryDirectory(prefix="petra_jax_tfds_") as scratch:
    previous, tempfile.tempdir = tempfile.tempdir, scratch
    try:
      yield
    finally:
      tempfile.tempdir = previous


def data_source(info: DatasetInfo, split: str, data_dir: str):
  """tfds' data source of a prepared split, images left encoded; raises whatever tfds raises."""
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
  """``source.__getitems__(indices)``; a read failure is a DataError naming how to re-prepare."""
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
  """Decoding threads (Pillow releases the GIL)."""
  return concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 1)
