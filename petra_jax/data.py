"""Image-classification data: in-memory tfds splits, batching and augmentation.

A split is decoded once into host memory (``load_split``) and then served as
index batches (``batch_indices``) that the training loop gathers from; the
random crop / flip / normalisation runs on the accelerator as a jittable pure
function (``augment``). Evaluation uses ``normalize`` only.

Data is read with ``tfds.data_source`` (array_record files, no TensorFlow) and
the images are decoded with Pillow, so the pixels do not depend on whether
OpenCV happens to be installed.

Example:
  info = get_dataset_info("cifar10")
  train = load_split("cifar10", info.train_split)
  for idx in batch_indices(len(train), 128, seed=0, epoch=0):
    x = augment(key, train.images[idx], info.mean, info.std)  # f32 [128,32,32,3]
"""

import dataclasses
import functools
import io
import os
import pathlib
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from PIL import Image

# A tfds data dir next to the repository (``<repo>/../shared/data/...``).
_REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
_SHARED_DATA_DIR = _REPO_ROOT.parent / "shared" / "data" / "tensorflow_datasets"
# tfds' own default.
_TFDS_DEFAULT_DATA_DIR = "~/tensorflow_datasets"
# Records read and decoded per ``__getitems__`` call in ``load_split``.
_READ_CHUNK = 4096


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
  """

  tfds_name: str
  num_classes: int
  image_shape: tuple[int, int, int]
  mean: tuple[float, ...]
  std: tuple[float, ...]
  train_split: str = "train"
  test_split: str = "test"


DATASETS: dict[str, DatasetInfo] = {
    "cifar10": DatasetInfo(
        tfds_name="cifar10",
        num_classes=10,
        image_shape=(32, 32, 3),
        mean=(0.4914, 0.4822, 0.4465),
        std=(0.2470, 0.2435, 0.2616),
    ),
}


@dataclasses.dataclass(frozen=True, eq=False)
class Split:
  """A whole dataset split in host memory (arrays are read-only).

  Attributes:
    images: uint8 ``[N, H, W, C]``, pixel values 0..255.
    labels: int32 ``[N]``, values in ``[0, num_classes)``.
  """

  images: np.ndarray
  labels: np.ndarray

  def __len__(self) -> int:
    return len(self.labels)


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


def _missing_data_error(name: str, data_dir: str, reason: str) -> DataError:
  return DataError(
      f"Cannot load dataset {name!r} from data dir {data_dir!r}: {reason}. "
      "Point to a tfds data dir that holds it with "
      "--config.data_dir=/path/to/tensorflow_datasets or by setting "
      "TFDS_DATA_DIR=/path/to/tensorflow_datasets."
  )


def load_split(
    name: str,
    split: str,
    data_dir: str | None = None,
    limit: int | None = None,
) -> Split:
  """Decodes a whole split into memory, once per process.

  Results are cached (keyed on the dataset, split, resolved data dir and
  limit); the returned arrays are read-only so the cache cannot be corrupted.
  The full CIFAR-10 train split takes about 10 s to decode and 150 MB.

  Args:
    name: registry name (a key of ``DATASETS``).
    split: tfds split, e.g. ``"train"``, ``"test"`` or ``"train[:10%]"``.
    data_dir: tfds data dir; ``None`` resolves as in ``resolve_data_dir``.
    limit: if set, only the first ``limit`` examples are decoded.

  Returns:
    A ``Split`` with uint8 images ``[N, H, W, C]`` and int32 labels ``[N]``.

  Raises:
    DataError: unknown dataset, data not found or unreadable (the message names
      the dataset, the directory tried and how to point to the data), or an
      image of the wrong shape.
  """
  get_dataset_info(name)  # Fails early on an unknown name.
  if limit is not None and limit < 0:
    raise DataError(f"limit must be >= 0 or None, got {limit}.")
  return _load_split_cached(name, split, resolve_data_dir(data_dir), limit)


@functools.lru_cache(maxsize=8)
def _load_split_cached(
    name: str, split: str, data_dir: str, limit: int | None
) -> Split:
  """``load_split`` with all arguments resolved (the cache key)."""
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top

  info = get_dataset_info(name)
  dataset_dir = pathlib.Path(data_dir).expanduser() / info.tfds_name.split(":")[0]
  if not dataset_dir.is_dir():
    raise _missing_data_error(name, data_dir, f"no folder {str(dataset_dir)!r}")
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

  n = len(source) if limit is None else min(limit, len(source))
  images = np.empty((n, *info.image_shape), np.uint8)
  labels = np.empty((n,), np.int32)
  mode = {1: "L", 3: "RGB"}[info.image_shape[-1]]
  for start in range(0, n, _READ_CHUNK):
    stop = min(start + _READ_CHUNK, n)
    for i, ex in enumerate(source.__getitems__(list(range(start, stop))), start):
      image = np.asarray(Image.open(io.BytesIO(ex["image"])).convert(mode))
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
