"""Tests for petra_jax.data (data dir, loading, batching, augmentation)."""

import itertools
import tempfile

import jax
import numpy as np
import pytest

from petra_jax import data
from petra_jax.data import prefetch, prepare

CIFAR10 = data.DATASETS["cifar10"]


# ---------------------------------------------------------------- data dir


def test_resolve_data_dir_precedence(monkeypatch, tmp_path):
  monkeypatch.setenv("TFDS_DATA_DIR", str(tmp_path / "env"))
  assert data.resolve_data_dir("/cfg") == "/cfg"
  assert data.resolve_data_dir(None) == str(tmp_path / "env")
  assert data.resolve_data_dir("") == str(tmp_path / "env")

  monkeypatch.delenv("TFDS_DATA_DIR")
  shared = tmp_path / "shared"
  shared.mkdir()
  monkeypatch.setattr(prepare, "_SHARED_DATA_DIR", shared)
  assert data.resolve_data_dir(None) == str(shared)

  monkeypatch.setattr(prepare, "_SHARED_DATA_DIR", tmp_path / "absent")
  assert data.resolve_data_dir(None).endswith("tensorflow_datasets")


def test_missing_data_dir_error_names_both_fixes(tmp_path):
  missing = str(tmp_path / "nowhere")
  with pytest.raises(data.DataError) as e:
    data.load_split("cifar10", "test", data_dir=missing, limit=4, download=False)
  msg = str(e.value)
  for part in ("cifar10", missing, "--config.data_dir", "TFDS_DATA_DIR"):
    assert part in msg


def test_unknown_dataset_lists_known_ones():
  with pytest.raises(data.DataError, match="cifar10"):
    data.get_dataset_info("mnist_typo")
  with pytest.raises(data.DataError, match="mnist_typo"):
    data.load_split("mnist_typo", "test")


def test_unknown_split_is_a_data_error(cifar10_dir):
  with pytest.raises(data.DataError, match="TFDS_DATA_DIR"):
    data.load_split("cifar10", "no_such_split", data_dir=cifar10_dir)


# ---------------------------------------------------------------- loading


@pytest.fixture(scope="module")
def test_subset(cifar10_dir):
  return data.load_split("cifar10", "test", data_dir=cifar10_dir, limit=256)


def test_load_split_shapes_and_values(test_subset, cifar10_dir):
  s = test_subset
  assert len(s) == 256
  assert s.images.shape == (256, 32, 32, 3) and s.images.dtype == np.uint8
  assert s.labels.shape == (256,) and s.labels.dtype == np.int32
  assert s.labels.min() >= 0 and s.labels.max() < 10
  assert len(np.unique(s.labels)) > 5
  assert s.images.std() > 20  # real pictures, not a constant
  assert not np.array_equal(s.images[0], s.images[1])
  # Cached and read-only.
  again = data.load_split("cifar10", "test", data_dir=cifar10_dir, limit=256)
  assert again is s
  with pytest.raises(ValueError):
    s.images[0, 0, 0, 0] = 0


def test_normalize_real_data_is_roughly_standard(test_subset):
  x = np.asarray(data.normalize(test_subset.images, CIFAR10.mean, CIFAR10.std))
  assert x.dtype == np.float32
  assert np.all(np.abs(x.mean(axis=(0, 1, 2))) < 0.15)
  assert np.all(np.abs(x.std(axis=(0, 1, 2)) - 1) < 0.15)


# ---------------------------------------------------------------- batching


def test_epoch_permutation_deterministic_and_epoch_dependent():
  a = data.epoch_permutation(1000, seed=3, epoch=0)
  np.testing.assert_array_equal(a, data.epoch_permutation(1000, 3, 0))
  np.testing.assert_array_equal(np.sort(a), np.arange(1000))
  assert not np.array_equal(a, data.epoch_permutation(1000, 3, 1))
  assert not np.array_equal(a, data.epoch_permutation(1000, 4, 0))


def test_batch_indices():
  b = data.batch_indices(1000, 128, seed=0, epoch=2)
  assert b.shape == (7, 128)  # remainder of 104 dropped
  assert len(np.unique(b)) == b.size and b.max() < 1000
  np.testing.assert_array_equal(b, data.batch_indices(1000, 128, 0, 2))
  assert data.batch_indices(1000, 128, 0, 2, steps_per_epoch=3).shape == (3, 128)
  np.testing.assert_array_equal(
      data.batch_indices(1000, 128, 0, 2, steps_per_epoch=3), b[:3]
  )
  assert data.batch_indices(1000, 128, 0, 2, steps_per_epoch=99).shape == (7, 128)
  with pytest.raises(ValueError, match="smaller than one batch"):
    data.batch_indices(100, 128, 0, 0)


# ---------------------------------------------------------------- augment

MEAN, STD = (0.5, 0.4, 0.3), (0.2, 0.25, 0.3)


def _candidates(image, pad):
  """numpy: every (dy, dx, flip) crop of the zero-padded image, normalized."""
  h, w, _ = image.shape
  padded = np.pad(image, ((pad, pad), (pad, pad), (0, 0)))
  for dy, dx, flip in itertools.product(
      range(2 * pad + 1), range(2 * pad + 1), (False, True)
  ):
    crop = padded[dy : dy + h, dx : dx + w]
    if flip:
      crop = crop[:, ::-1]
    expected = (crop / 255.0 - np.array(MEAN)) / np.array(STD)
    yield (dy, dx, flip), expected


def test_augment_is_a_normalized_padded_crop_and_flip():
  rng = np.random.default_rng(0)
  images = rng.integers(1, 256, size=(64, 8, 8, 3), dtype=np.uint8)
  out = np.asarray(
      jax.jit(data.augment)(jax.random.key(1), images, MEAN, STD)
  )
  assert out.shape == images.shape and out.dtype == np.float32

  chosen = []
  for image, got in zip(images, out):
    matches = [p for p, want in _candidates(image, 4)
               if np.allclose(got, want, atol=1e-5)]
    assert len(matches) == 1, "output is not a padded crop (+flip) of input"
    chosen.append(matches[0])
  # Per-image randomness: both flip states and several offsets occur.
  assert {flip for _, _, flip in chosen} == {False, True}
  assert len({(dy, dx) for dy, dx, _ in chosen}) > 10
  assert any((dy, dx) != (4, 4) for dy, dx, _ in chosen)


def test_host_fold_in_is_jax_fold_in_bit_for_bit():
  for seed in (0, 1, 7, 2**31 - 1):
    base = np.asarray(jax.random.key_data(jax.random.key(seed, impl="threefry2x32")))
    for m in (0, 1, 2, 63, 12345, 2**31, 2**32 - 1):
      want = jax.random.key_data(jax.random.fold_in(
          jax.random.key(seed, impl="threefry2x32"), m))
      np.testing.assert_array_equal(data.batches.host_fold_in(base, m), want)
  with pytest.raises(ValueError, match=r"\[0, 2\*\*32\)"):
    data.batches.host_fold_in(base, 2**32)


def test_augment_deterministic_per_key():
  images = np.random.default_rng(0).integers(0, 256, (16, 32, 32, 3), np.uint8)
  f = jax.jit(data.augment)
  a = f(jax.random.key(0), images, MEAN, STD)
  np.testing.assert_array_equal(a, f(jax.random.key(0), images, MEAN, STD))
  assert not np.array_equal(a, f(jax.random.key(1), images, MEAN, STD))
  assert not np.allclose(a, data.normalize(images, MEAN, STD))


# ------------------------------------------- tiny tfds data sets on disk


def write_tiny_tfds(data_dir, name, splits, image_fn, num_classes,
                    fmt="PNG", config=None):
  """Writes a real tfds data set (array_record + metadata) without downloads.

  The registered builder of ``name`` (its features, version, file layout) is
  subclassed with generators of a few synthetic examples, then prepared with
  ``download_and_prepare``; images are passed already encoded (Pillow), so
  TensorFlow is not needed.

  Args:
    data_dir: the tfds data dir to write into.
    name: registered tfds name, e.g. ``"cifar100"``.
    splits: ``{split: num_examples}``.
    image_fn: ``(split, i) -> uint8 [H, W, 3]``.
    num_classes: labels are ``i % num_classes`` scaled to the full range.
    fmt: Pillow format of the encoded images ("PNG" or "JPEG").
    config: builder config name, e.g. ``"32x32"``.
  """
  import io

  import tensorflow_datasets as tfds
  from PIL import Image

  def label(i):
    return (i * 37) % num_classes

  class Tiny(tfds.builder_cls(name), skip_registration=True):

    def _split_generators(self, dl_manager):
      return {s: self._examples(s, n) for s, n in splits.items()}

    def _examples(self, split, n):
      for i in range(n):
        buf = io.BytesIO()
        Image.fromarray(image_fn(split, i)).save(buf, format=fmt)
        ex = {"image": buf.getvalue(), "label": label(i)}
        extra = {"id": f"{split}_{i}", "coarse_label": 0, "file_name": f"{i}.JPEG"}
        ex.update({k: v for k, v in extra.items() if k in self.info.features})
        yield i, ex

  Tiny.name = name
  builder = Tiny(data_dir=str(data_dir), config=config, file_format="array_record")
  builder.download_and_prepare(
      download_config=tfds.download.DownloadConfig(manual_dir=str(data_dir)))


def _random_image(shape):
  def image_fn(split, i):
    seed = ({"train": 0, "test": 1, "validation": 2}[split], i)
    return np.random.default_rng(seed).integers(0, 256, shape, np.uint8)
  return image_fn


def _gradient_image(height, width):
  """Columns brighten left to right: a flip makes rows decrease."""
  row = np.linspace(0, 255, width).astype(np.uint8)
  return lambda split, i: np.broadcast_to(row[None, :, None], (height, width, 3)).copy()


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
  """A tfds data dir with tiny cifar100, imagenet_resized/32x32, imagenet2012."""
  d = tmp_path_factory.mktemp("tfds")
  write_tiny_tfds(d, "cifar100", {"train": 12, "test": 5},
                  _random_image((32, 32, 3)), 100)
  write_tiny_tfds(d, "imagenet_resized", {"train": 12, "validation": 5},
                  _random_image((32, 32, 3)), 1000, config="32x32")
  write_tiny_tfds(d, "imagenet2012", {"train": 16, "validation": 3},
                  _gradient_image(60, 90), 1000)
  return str(d)


@pytest.fixture(scope="module")
def eval_image_dir(tmp_path_factory):
  """imagenet2012 whose validation images are 256 x 320 random pixels (PNG)."""
  d = tmp_path_factory.mktemp("tfds_eval")
  write_tiny_tfds(d, "imagenet2012", {"train": 1, "validation": 2},
                  _random_image((256, 320, 3)), 1000)
  return str(d)


NEW_DATASETS = ("cifar100", "imagenet32", "imagenet")


def test_asking_tfds_about_an_unprepared_data_set_leaves_no_temporary_folder(tmp_path, monkeypatch):
  temp = tmp_path / "temp"
  temp.mkdir()
  monkeypatch.setattr(tempfile, "tempdir", str(temp))
  prepared, where = prepare.is_prepared("cifar10", CIFAR10, str(tmp_path / "data"))
  assert not prepared and where.startswith(str(tmp_path / "data"))
  assert list(temp.iterdir()) == []  # tfds 4.9 alone leaves an empty tmp*tfds here
  assert tempfile.tempdir == str(temp)


# torchvision's ImageNet channel statistics (in [0, 1] units), which ImageNet
# and ImageNet32 (the same pictures, downsampled) are normalised with.
TORCHVISION_MEAN, TORCHVISION_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


@pytest.mark.parametrize("name", NEW_DATASETS)
def test_missing_data_error_for_each_dataset(name, tmp_path):
  for d in (tmp_path / "nowhere", tmp_path):  # absent dir; dir without it
    info = data.get_dataset_info(name)
    with pytest.raises(data.DataError) as e:
      data.open_split(name, info.train_split, data_dir=str(d), download=False)
    for part in (repr(name), str(d), "--config.data_dir", "TFDS_DATA_DIR"):
      assert part in str(e.value)


def test_load_split_refuses_lazy_dataset(tiny_dir):
  with pytest.raises(data.DataError, match="open_split"):
    data.load_split("imagenet", "train", data_dir=tiny_dir)


@pytest.mark.parametrize("name,num_train,num_test,num_classes,norm", [
    ("cifar100", 12, 5, 100, None),
    ("imagenet32", 12, 5, 1000, (TORCHVISION_MEAN, TORCHVISION_STD))])
def test_in_memory_datasets_read_back(name, num_train, num_test, num_classes, norm, tiny_dir):
  # (tiny_dir holds imagenet32 only as tfds' "imagenet_resized/32x32".)
  info = data.get_dataset_info(name)
  train = data.open_split(name, info.train_split, data_dir=tiny_dir)
  test = data.open_split(name, info.test_split, data_dir=tiny_dir)
  assert isinstance(train, data.Split) and len(train) == num_train
  assert len(test) == num_test
  assert train.images.shape == (num_train, 32, 32, 3)
  assert train.images.dtype == np.uint8 and train.labels.dtype == np.int32
  # The pixels are the PNG's, losslessly, each with the label written with it.
  image_fn = _random_image((32, 32, 3))
  written = {image_fn(info.train_split, i).tobytes(): (i * 37) % num_classes
             for i in range(num_train)}
  assert {im.tobytes(): int(y) for im, y in zip(train.images, train.labels)} == written

  batch_fn = data.make_train_batch_fn(info, jax.devices()[0])
  idx = np.array([3, 0, 7, 7])
  x, y = batch_fn(train, idx, jax.random.key(0))
  assert x.shape == (4, 32, 32, 3) and x.dtype == np.float32
  assert x.devices() == {jax.devices()[0]}
  np.testing.assert_array_equal(y, train.labels[idx])
  np.testing.assert_allclose(  # == augment on the gathered images
      x, data.augment(jax.random.key(0), train.images[idx], info.mean, info.std),
      atol=1e-6)
  # The key's data from the host (no device read-back): the same batch.
  key_data = np.asarray(jax.random.key_data(jax.random.key(0)))
  np.testing.assert_array_equal(batch_fn(train, idx, key_data)[0], x)

  batches = list(data.eval_batches(test, info, batch_size=2))
  assert [v for _, _, v in batches] == [2, 2, 1]
  for i, (images, labels, valid) in enumerate(batches):
    assert images.shape == (2, 32, 32, 3) and images.dtype == np.float32
    assert labels.dtype == np.int32 and labels.shape == (valid,)
    mean, std = norm or (info.mean, info.std)
    want = (test.images[2 * i:2 * i + valid] / 255.0 - np.array(mean)) / np.array(std)
    np.testing.assert_allclose(images[:valid], want, atol=1e-5)
    np.testing.assert_array_equal(labels, test.labels[2 * i:2 * i + valid])


def test_a_whole_update_in_one_call_equals_its_micro_batches_one_by_one(tiny_dir):
  info = data.get_dataset_info("cifar100")
  train = data.load_split("cifar100", "train", data_dir=tiny_dir)
  k, micro = 3, 4
  indices = np.random.default_rng(0).permutation(12)
  keys = np.stack([np.asarray(jax.random.key_data(jax.random.key(i))) for i in range(k)])
  whole = data.make_update_batch_fn(info, jax.devices()[0], k)(train, indices, keys)
  one = data.make_train_batch_fn(info, jax.devices()[0])
  assert len(whole) == k
  for i in range(k):
    want, _ = one(train, indices[i * micro:(i + 1) * micro], keys[i])
    np.testing.assert_array_equal(whole[i], want)  # bit for bit
  with pytest.raises(ValueError, match="lazy dataset"):
    data.make_update_batch_fn(data.get_dataset_info("imagenet"), jax.devices()[0], k)


def test_imagenet_batches_decoded_ahead_in_threads_equal_direct_ones(tiny_dir):
  info = data.get_dataset_info("imagenet")
  train = data.open_split("imagenet", "train", data_dir=tiny_dir)
  batch_fn = data.make_train_batch_fn(info, jax.devices()[0])
  direct = lambda m: batch_fn(train, np.arange(4 * m, 4 * m + 4), jax.random.key(m))
  fetch = prefetch.Prefetcher(direct, depth=2)
  try:
    for m in range(4):
      (x, y), (x0, y0) = fetch(m), direct(m)
      np.testing.assert_array_equal(x, x0)
      np.testing.assert_array_equal(y, y0)
  finally:
    fetch.close()


def test_imagenet_lazy_train_batches(tiny_dir):
  info = data.get_dataset_info("imagenet")
  train = data.open_split("imagenet", "train", data_dir=tiny_dir)
  assert isinstance(train, data.LazySplit) and len(train) == 16
  assert data.open_split("imagenet", "train", data_dir=tiny_dir) is train
  assert len(data.open_split("imagenet", "train", data_dir=tiny_dir, limit=5)) == 5
  batch_fn = data.make_train_batch_fn(info, jax.devices()[1])
  idx = np.arange(16)
  x, y = batch_fn(train, idx, jax.random.key(0))
  assert x.shape == (16, 224, 224, 3) and x.dtype == np.float32
  assert x.devices() == {jax.devices()[1]}
  assert y.dtype == np.int32 and y.shape == (16,) and y.max() < 1000
  np.testing.assert_array_equal(y, train.read(idx)[1])
  # Same key, same batch; another key, other crops.
  np.testing.assert_array_equal(x, batch_fn(train, idx, jax.random.key(0))[0])
  np.testing.assert_array_equal(
      x, batch_fn(train, idx, np.asarray(jax.random.key_data(jax.random.key(0))))[0])
  assert not np.allclose(x, batch_fn(train, idx, jax.random.key(1))[0])
  # Undo torchvision's normalisation: pixels in 0..255, rows rise (no flip) or
  # fall (flip).
  pixels = np.asarray(x) * np.array(TORCHVISION_STD) + np.array(TORCHVISION_MEAN)
  assert pixels.min() > -1e-3 and pixels.max() < 1 + 1e-3
  slope = pixels[:, :, -1].mean(axis=(1, 2)) - pixels[:, :, 0].mean(axis=(1, 2))
  assert (slope > 0.05).any() and (slope < -0.05).any()
  assert np.all(np.abs(slope) > 0.05)


def test_imagenet_eval_is_resize_256_center_crop_224(eval_image_dir):
  info = data.get_dataset_info("imagenet")
  val = data.open_split("imagenet", "validation", data_dir=eval_image_dir)
  (images, labels, valid), = data.eval_batches(val, info, batch_size=4)
  assert images.shape == (4, 224, 224, 3) and valid == 2 and labels.shape == (2,)
  # Shorter side already 256: no resize; the crop is rows 16:240, cols 48:272.
  originals = [_random_image((256, 320, 3))("validation", i) for i in range(2)]
  # Undo torchvision's normalisation: the pixels come back exactly.
  crops = (np.asarray(images[:2]) * np.array(TORCHVISION_STD) + np.array(TORCHVISION_MEAN)) * 255
  got = {np.rint(c).astype(np.uint8).tobytes() for c in crops}
  assert got == {o[16:240, 48:272].tobytes() for o in originals}


def test_imagenet_eval_image_resizes_shorter_side():
  import io

  from PIL import Image
  buf = io.BytesIO()
  Image.fromarray(np.full((100, 150, 3), 77, np.uint8)).save(buf, format="PNG")
  out = data.imagenet_eval_image(buf.getvalue())
  assert out.shape == (224, 224, 3) and out.dtype == np.uint8
  assert np.all(out == 77)


def test_random_resized_crop_box_bounds():
  rng = np.random.default_rng(0)
  for h, w in [(60, 90), (375, 500), (500, 333), (20, 400)]:
    for _ in range(200):
      top, left, ch, cw = data.random_resized_crop_box(h, w, rng)
      assert 0 <= top and top + ch <= h and 0 <= left and left + cw <= w
      assert ch > 0 and cw > 0
  # A large image always fits on the first try: scale and ratio are honoured.
  for _ in range(200):
    _, _, ch, cw = data.random_resized_crop_box(1000, 1000, rng)
    assert 0.08 * 0.95 <= ch * cw / 1e6 <= 1.0
    assert 3 / 4 * 0.95 <= cw / ch <= 4 / 3 * 1.05
  # Fallback for an extreme aspect ratio: central crop at the ratio bound.
  assert data.random_resized_crop_box(10, 1000, np.random.default_rng(0)) == (
      0, (1000 - 13) // 2, 10, 13)


def test_in_memory_batches_prepared_ahead_equal_the_direct_ones(tiny_dir):
  """The run's batch source with updates prepared in a background thread (``prefetch``) gives
  the same micro-batches, bit for bit, in training order and after a jump (a resume)."""
  import types  # pylint: disable=g-import-not-at-top
  from petra_jax.data import batch_source  # pylint: disable=g-import-not-at-top
  info = data.get_dataset_info("cifar100")
  train = data.load_split("cifar100", "train", data_dir=tiny_dir)
  device = jax.devices()[0]
  pipe = types.SimpleNamespace(owns_input=True, owns_output=True,
                               placements=[types.SimpleNamespace(batch=device)] * 2)
  sources = {}
  for depth in (0, 4):
    config = types.SimpleNamespace(accumulation_steps=2, batch_size=4, seed=3, prefetch=depth)
    sources[depth] = batch_source.batch_source(config, info, train, pipe, steps_per_epoch=3)
  for m in [0, 1, 2, 3, 4, 5, 6, 7, 2, 3, 10, 11]:
    (x0, y0), (x4, y4) = sources[0](m), sources[4](m)
    np.testing.assert_array_equal(x0, x4)
    np.testing.assert_array_equal(y0, y4)
  import threading  # pylint: disable=g-import-not-at-top
  assert any(t.name.startswith("petra-prefetch") for t in threading.enumerate())
