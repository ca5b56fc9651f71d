"""Tests for petra_jax.data (data dir, loading, batching, augmentation)."""

import itertools

import jax
import numpy as np
import pytest

from petra_jax import data

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
  monkeypatch.setattr(data, "_SHARED_DATA_DIR", shared)
  assert data.resolve_data_dir(None) == str(shared)

  monkeypatch.setattr(data, "_SHARED_DATA_DIR", tmp_path / "absent")
  assert data.resolve_data_dir(None).endswith("tensorflow_datasets")


def test_missing_data_dir_error_names_both_fixes(tmp_path):
  missing = str(tmp_path / "nowhere")
  with pytest.raises(data.DataError) as e:
    data.load_split("cifar10", "test", data_dir=missing, limit=4)
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


def test_augment_deterministic_per_key():
  images = np.random.default_rng(0).integers(0, 256, (16, 32, 32, 3), np.uint8)
  f = jax.jit(data.augment)
  a = f(jax.random.key(0), images, MEAN, STD)
  np.testing.assert_array_equal(a, f(jax.random.key(0), images, MEAN, STD))
  assert not np.array_equal(a, f(jax.random.key(1), images, MEAN, STD))
  assert not np.allclose(a, data.normalize(images, MEAN, STD))
