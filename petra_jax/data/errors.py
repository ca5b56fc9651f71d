"""The data errors and the texts of their fixes (one home for each text).

Every problem with the data (unknown data set, data missing or damaged, no
network to download it) ends as one ``DataError`` whose single line names the
data set, the directory and the fix.
"""

DATA_DIR_FLAGS = ("--config.data_dir=/path/to/tensorflow_datasets or by setting "
                  "TFDS_DATA_DIR=/path/to/tensorflow_datasets")


class DataError(Exception):
  """A dataset cannot be found, read or is used with invalid arguments."""


def one_line(e: BaseException, limit: int = 300) -> str:
  """``Type: message`` of an exception on one line, at most ``limit`` chars.

  Args:
    e: any exception.
    limit: the most characters of the message kept (longer ones end in "...").

  Returns:
    ``"Type: message"``, or ``"Type"`` for an exception without a message.
  """
  text = " ".join(str(e).split())
  if len(text) > limit:
    text = text[: limit - 3] + "..."
  return f"{type(e).__name__}: {text}" if text else type(e).__name__


def rebuild_command(tfds_name: str, data_dir: str) -> str:
  """The shell command that prepares a data set with tfds' own CLI.

  Args:
    tfds_name: tfds name, e.g. ``"cifar10"`` or ``"imagenet_resized/32x32"``.
    data_dir: the tfds data dir to prepare it in.

  Returns:
    ``"tfds build <name> --data_dir=<data_dir> --file_format=array_record"``.
  """
  return f"tfds build {tfds_name} --data_dir={data_dir} --file_format=array_record"


def missing_data_error(name: str, data_dir: str, reason: str, fix: str = "") -> DataError:
  """The error of a data set that is not (readably) in its data dir.

  Args:
    name: registry name of the data set.
    data_dir: the tfds data dir that was tried.
    reason: what is missing or failed, e.g. ``"no prepared copy at '...'"``.
    fix: a further way out (a sentence), e.g. how to download it; "" for none.

  Returns:
    A ``DataError`` naming the data set, the directory, ``--config.data_dir``,
    ``TFDS_DATA_DIR`` and ``fix``.
  """
  fix = f" {fix}" if fix else ""
  return DataError(
      f"Cannot load dataset {name!r} from data dir {data_dir!r}: {reason}. "
      f"Point to a tfds data dir that holds it with {DATA_DIR_FLAGS}.{fix}"
  )


def damaged_data_error(name: str, where: str, problem: str, folder: str,
                       tfds_name: str, data_dir: str) -> DataError:
  """The error of a prepared data set whose files are damaged.

  Args:
    name: registry name of the data set.
    where: where it lies, e.g. ``" in data dir '/data'"`` (with its leading
      space) or "".
    problem: what is wrong, e.g. ``"shard file '...' is missing"``.
    folder: the folder to delete before re-preparing it.
    tfds_name: tfds name, for the ``tfds build`` command.
    data_dir: the tfds data dir, for the ``tfds build`` command.

  Returns:
    A ``DataError`` naming the problem and how to re-prepare the data set.
  """
  return DataError(
      f"Dataset {name!r}{where} is damaged: {problem}. Re-prepare the dataset: "
      f"delete {folder!r}, then run `{rebuild_command(tfds_name, data_dir)}` or "
      "rerun with --config.download=True (or copy it again from a good copy)."
  )
