"""``DataError`` and the texts of its fixes: one line naming the data set, directory and fix."""

DATA_DIR_FLAGS = ("--config.data_dir=/path/to/tensorflow_datasets or by setting "
                  "TFDS_DATA_DIR=/path/to/tensorflow_datasets")


class DataError(Exception):
  """A dataset cannot be found, read or is used with invalid arguments."""


def one_line(e: BaseException, limit: int = 300) -> str:
  """``"Type: message"`` of ``e`` on one line, at most ``limit`` characters of message."""
  text = " ".join(str(e).split())
  if len(text) > limit:
    text = text[: limit - 3] + "..."
  return f"{type(e).__name__}: {text}" if text else type(e).__name__


def rebuild_command(tfds_name: str, data_dir: str) -> str:
  """The ``tfds build`` shell command that prepares ``tfds_name`` in ``data_dir``."""
  return f"tfds build {tfds_name} --data_dir={data_dir} --file_format=array_record"


def missing_data_error(name: str, data_dir: str, reason: str, fix: str = "") -> DataError:
  """The error of a data set not (readably) in ``data_dir``; ``fix``: a further sentence or ""."""
  fix = f" {fix}" if fix else ""
  return DataError(
      f"Cannot load dataset {name!r} from data dir {data_dir!r}: {reason}. "
      f"Point to a tfds data dir that holds it with {DATA_DIR_FLAGS}.{fix}"
  )


def damaged_data_error(name: str, where: str, problem: str, folder: str,
                       tfds_name: str, data_dir: str) -> DataError:
  """The error of a prepared data set with damaged files.

  ``where`` is e.g. ``" in data dir '/data'"`` (leading space) or ""; ``folder``
  is the folder to delete before re-preparing it.
  """
  return DataError(
      f"Dataset {name!r}{where} is damaged: {problem}. Re-prepare the dataset: "
      f"delete {folder!r}, then run `{rebuild_command(tfds_name, data_dir)}` or "
      "rerun with --config.download=True (or copy it again from a good copy)."
  )
