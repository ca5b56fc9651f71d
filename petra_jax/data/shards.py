"""Integrity of a split's array_record shard files: footers and record counts, no record read."""

import os
from typing import Any

from petra_jax.data import errors
from petra_jax.data import sources


def check_shards(name: str, info: sources.DatasetInfo, split: str, data_dir: str,
                 source: Any) -> None:
  """Raises DataError if a shard file of ``source`` is missing, truncated or
  holds another record count than ``dataset_info.json`` says."""
  try:
    instructions = source.dataset_info.splits[split].file_instructions
  except Exception:  # pylint: disable=broad-except
    return  # tfds' internals changed: reads still fail with a DataError.
  expected = {}
  for fi in instructions:
    expected[os.fspath(fi.filename)] = int(fi.examples_in_shard)
  problems = sources.thread_pool().map(shard_problem, expected, expected.values())
  for path, problem in zip(expected, problems):
    if problem:
      raise errors.damaged_data_error(
          name, f" in data dir {data_dir!r}", f"shard file {path!r} {problem}",
          os.path.dirname(path), info.tfds_name, data_dir)


def shard_problem(path: str, expected_records: int) -> str | None:
  """A phrase completing "shard file <path> ..." for a damaged file, else None."""
  from array_record.python import array_record_module  # pylint: disable=g-import-not-at-top

  if not os.path.isfile(path):
    return "is missing"
  size = os.path.getsize(path)
  status, ok, num_records = "", False, 0
  try:
    reader = array_record_module.ArrayRecordReader(
        path, "readahead_buffer_size:0", file_reader_buffer_size=32768)
  except Exception as e:  # pylint: disable=broad-except
    status = errors.one_line(e)
  else:
    ok = reader.ok()
    num_records = reader.num_records() if ok else 0
    try:
      reader.close()  # raises the reader's error if it failed
    except Exception as e:  # pylint: disable=broad-except
      status = errors.one_line(e)
  if not ok or status:
    return (f"cannot be read, it is truncated or corrupted ({size} bytes on disk; "
            f"{status or 'array_record reader failed'})")
  if num_records != expected_records:
    return (f"holds {num_records} records where the dataset's metadata "
            f"(dataset_info.json) says {expected_records}")
  return None
