"""Tests for petra_jax.data on damaged data: truncated, miscounted, missing or
corrupted shard files of the real CIFAR-10 are one DataError naming the fix."""

import numpy as np
import pytest

from petra_jax import data
from petra_jax.data import sources


def _cifar10_copy(real_data_dir, data_dir, copies=()):
  """A tfds data dir holding CIFAR-10 as symlinks to the real files, except
  the file names in ``copies``, which are real copies (to be damaged).

  Returns:
    The copy's version folder (``<data_dir>/cifar10/<version>``).
  """
  import pathlib
  import shutil

  real, = pathlib.Path(real_data_dir).glob("cifar10/*/dataset_info.json")
  version_dir = pathlib.Path(data_dir) / "cifar10" / real.parent.name
  version_dir.mkdir(parents=True)
  for f in real.parent.iterdir():
    if f.name in copies:
      shutil.copyfile(f, version_dir / f.name)
    else:
      (version_dir / f.name).symlink_to(f)
  return version_dir


TRAIN_SHARD = "cifar10-train.array_record-00000-of-00001"
TEST_SHARD = "cifar10-test.array_record-00000-of-00001"


def _no_record_reads(monkeypatch):
  """Makes any record read fail the test: errors must come at open time."""
  def fail(*args, **kwargs):
    raise AssertionError("a record was read")
  monkeypatch.setattr(sources, "read_records", fail)


def test_truncated_shard_is_one_data_error_at_open(cifar10_dir, tmp_path, monkeypatch):
  version_dir = _cifar10_copy(cifar10_dir, tmp_path)
  shard = version_dir / TRAIN_SHARD
  head = shard.read_bytes()[: 1 << 20]  # the first MiB of 42: a cut-off copy
  shard.unlink()
  shard.write_bytes(head)

  with monkeypatch.context() as m:
    _no_record_reads(m)
    for open_fn in (data.open_labels, data.open_split, data.load_split):
      with pytest.raises(data.DataError) as e:
        open_fn("cifar10", "train", data_dir=str(tmp_path), limit=8)
      msg = str(e.value)
      assert "\n" not in msg
      for part in ("'cifar10'", repr(str(shard)), "truncated", f"{1 << 20} bytes",
                   "Re-prepare", repr(str(version_dir)),
                   f"tfds build cifar10 --data_dir={tmp_path}", "--config.download=True"):
        assert part in msg, (part, msg)

  # The intact test split of the same copy still opens, with CIFAR-10's test
  # labels: 1000 of each of the 10 classes, as in the real data dir.
  labels = data.open_labels("cifar10", "test", data_dir=str(tmp_path)).labels
  np.testing.assert_array_equal(np.bincount(labels), [1000] * 10)
  np.testing.assert_array_equal(
      labels, data.open_labels("cifar10", "test", data_dir=cifar10_dir).labels)


def test_shard_disagreeing_with_metadata_or_missing(cifar10_dir, tmp_path, monkeypatch):
  import json

  _no_record_reads(monkeypatch)
  # dataset_info.json says the test shard holds 10001 records; it holds 10000.
  version_dir = _cifar10_copy(cifar10_dir, tmp_path / "count",
                              copies=("dataset_info.json",))
  path = version_dir / "dataset_info.json"
  info = json.loads(path.read_text())
  test_info, = [s for s in info["splits"] if s["name"] == "test"]
  test_info["shardLengths"] = ["10001"]
  path.write_text(json.dumps(info))
  with pytest.raises(data.DataError) as e:
    data.open_labels("cifar10", "test", data_dir=str(tmp_path / "count"))
  assert "holds 10000 records" in str(e.value) and "says 10001" in str(e.value)
  assert repr(str(version_dir / TEST_SHARD)) in str(e.value)

  version_dir = _cifar10_copy(cifar10_dir, tmp_path / "missing")
  (version_dir / TEST_SHARD).unlink()
  with pytest.raises(data.DataError) as e:
    data.open_labels("cifar10", "test", data_dir=str(tmp_path / "missing"))
  assert f"{str(version_dir / TEST_SHARD)!r} is missing" in str(e.value)
  assert "Re-prepare" in str(e.value)


def test_corrupted_record_is_one_data_error_at_read(cifar10_dir, tmp_path):
  # Bytes changed in the middle of the file: the footer is intact (the split
  # opens), reading the damaged records fails the checksum.
  version_dir = _cifar10_copy(cifar10_dir, tmp_path, copies=(TEST_SHARD,))
  shard = version_dir / TEST_SHARD
  raw = bytearray(shard.read_bytes())
  raw[1_000_000:1_000_400] = bytes(400)
  shard.write_bytes(bytes(raw))
  with pytest.raises(data.DataError) as e:
    data.open_labels("cifar10", "test", data_dir=str(tmp_path))
  msg = str(e.value)
  assert "\n" not in msg
  for part in ("'cifar10'", repr(str(version_dir)), "a shard file is corrupted",
               "Riegeli", "Re-prepare", f"tfds build cifar10 --data_dir={tmp_path} "):
    assert part in msg, (part, msg)
