"""Where the data lives, and preparing a missing data set with tfds.

The data dir is ``--config.data_dir``, else ``$TFDS_DATA_DIR``, else
``../shared/data/tensorflow_datasets`` beside the checkout when that folder
exists, else tfds' default ``~/tensorflow_datasets`` (``resolve_data_dir``).

A data set missing there (``ensure_prepared``), by ``download``:

* ``None`` (auto, the default): CIFAR-10 and CIFAR-100 (about 170 MB each) are
  downloaded and prepared there by tfds on first use, with one line saying
  where and tfds' own progress bars; ImageNet32 (about 3.7 GB) and ImageNet
  are an error naming the fix.
* ``True``: any data set tfds can download is downloaded and prepared;
  ImageNet only from its archives put there by hand (tfds cannot download it).
* ``False``: never downloads; a missing data set is an error naming the fixes.

Without network the download fails with one line naming both fixes: point to
a prepared copy (``--config.data_dir`` / ``TFDS_DATA_DIR``), or connect to the
network.
"""

import os
import pathlib
import socket
import urllib.error
import urllib.parse

from petra_jax.data import errors
from petra_jax.data import sources

# A tfds data dir next to the repository (``<repo>/../shared/data/...``).
_REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
_SHARED_DATA_DIR = _REPO_ROOT.parent / "shared" / "data" / "tensorflow_datasets"
# tfds' own default.
_TFDS_DEFAULT_DATA_DIR = "~/tensorflow_datasets"
# Where tfds looks for archives it cannot download (ImageNet's).
_MANUAL_DIR = os.path.join("downloads", "manual")


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


def is_prepared(name: str, info: sources.DatasetInfo, data_dir: str) -> tuple[bool, str]:
  """Whether tfds finds the dataset prepared in ``data_dir``, and where it
  looked (``<data_dir>/<name>[/<config>]/<version>``).

  Only the dataset's ``dataset_info.json`` is read.

  Raises:
    DataError: tfds cannot build the dataset's description (e.g. an unreadable
      ``dataset_info.json``).
  """
  try:
    builder = sources.tfds_builder(info, data_dir)
    return bool(builder.is_prepared()), str(builder.data_dir)
  except Exception as e:  # pylint: disable=broad-except
    reason = f"tfds cannot read its metadata ({errors.one_line(e)})"
    raise errors.missing_data_error(name, data_dir, reason) from None


def ensure_prepared(
    name: str, data_dir: str | None = None, download: bool | None = None
) -> str:
  """Makes sure a dataset is prepared (tfds format) in its data dir.

  If it is, nothing happens (only its ``dataset_info.json`` is read). If it is
  not, ``download`` decides (module docstring): tfds'
  ``DatasetBuilder.download_and_prepare`` puts the archives in
  ``<data_dir>/downloads`` and the prepared data in
  ``<data_dir>/<name>/<version>``. In a multi-process run call it in one
  process only, then synchronise, so that processes do not prepare the same
  data concurrently.

  Args:
    name: registry name (a key of ``DATASETS``).
    data_dir: tfds data dir; ``None`` resolves as in ``resolve_data_dir``.
    download: None (auto: CIFAR only), True (any) or False (never).

  Returns:
    The resolved data dir (``str``) that holds the prepared dataset.

  Raises:
    DataError: unknown dataset; ``download`` not True, False or None; dataset
      missing and not to be downloaded (the message names
      ``--config.data_dir``, ``TFDS_DATA_DIR`` and how to get it); or the
      download / preparation failed, e.g. no network (the message names the
      error and both fixes: point to a prepared copy, or connect to the
      network).
  """
  info = sources.get_dataset_info(name)
  if download not in (None, True, False):
    raise errors.DataError(
        f"download must be True, False or None (auto), got {download!r}.")
  data_dir = resolve_data_dir(data_dir)
  prepared, where = is_prepared(name, info, data_dir)
  if prepared:
    return data_dir
  _refuse_download(name, info, data_dir, where, download)
  _download_and_prepare(name, info, data_dir, where)
  prepared, where = is_prepared(name, info, data_dir)
  if not prepared:
    raise errors.DataError(
        f"tfds' download_and_prepare of dataset {name!r} left no prepared copy "
        f"at {where!r}. Prepare it with `{errors.rebuild_command(info.tfds_name, data_dir)}` "
        "and point --config.data_dir (or TFDS_DATA_DIR) at that data dir."
    )
  return data_dir


def _refuse_download(name: str, info: sources.DatasetInfo, data_dir: str,
                     where: str, download: bool | None) -> None:
  """Raises the missing-data error unless ``download`` lets tfds get it."""
  reason = f"no prepared copy at {where!r}"
  manual_dir = os.path.join(data_dir, _MANUAL_DIR)
  missing = [a for a in info.manual_archives
             if not os.path.isfile(os.path.join(manual_dir, a))]
  if info.manual_archives and (download is None or (download and missing)):
    raise errors.missing_data_error(name, data_dir, reason, (
        f"Or, as tfds cannot download it ({info.size}), put "
        f"{' and '.join(info.manual_archives)} (from https://image-net.org, "
        f"after signing up) in {manual_dir!r} and rerun with "
        "--config.download=True to prepare it there."))
  if download is None and not info.auto_download:
    raise errors.missing_data_error(name, data_dir, reason, (
        f"Or rerun with --config.download=True to let tfds download ({info.size}, "
        "not done unless asked) and prepare it there (needs network)."))
  if download is False:
    raise errors.missing_data_error(name, data_dir, reason, (
        "Or rerun with --config.download=True to let tfds download "
        f"({info.size}) and prepare it there (needs network)."))


def _download_and_prepare(name: str, info: sources.DatasetInfo, data_dir: str,
                          where: str) -> None:
  """tfds' ``download_and_prepare``; any failure as one :class:`DataError`."""
  how = (f"prepares it in {where!r} from the archives in "
         f"{os.path.join(data_dir, _MANUAL_DIR)!r}" if info.manual_archives else
         f"downloads it ({info.size}) into {os.path.join(data_dir, 'downloads')!r} "
         f"and prepares it in {where!r}")
  print(f"Dataset {name!r} is not in data dir {data_dir!r}: tfds {how}.", flush=True)
  try:
    builder = sources.tfds_builder(info, data_dir)
    if not info.manual_archives:
      _resolve_hosts(builder.url_infos or {})
    builder.download_and_prepare()
  except Exception as e:  # pylint: disable=broad-except
    raise _download_error(name, info, data_dir, e) from e


def _resolve_hosts(urls) -> None:
  """Looks up the download hosts, so that no network fails at once (tfds'
  downloader retries for minutes).

  Raises:
    ConnectionError: a host's name cannot be resolved.
  """
  for host in sorted({urllib.parse.urlparse(u).hostname for u in urls} - {None}):
    try:
      socket.getaddrinfo(host, None)
    except OSError as e:
      raise ConnectionError(f"cannot resolve {host!r}: {e}") from e


def _download_error(name: str, info: sources.DatasetInfo, data_dir: str,
                    e: Exception) -> errors.DataError:
  """The one-line error of a failed ``download_and_prepare``."""
  head = f"Dataset {name!r} is not in data dir {data_dir!r} and tfds could not"
  elsewhere = (f"(or run `{errors.rebuild_command(info.tfds_name, data_dir)}` on "
               "a machine with network access and copy the data dir over)")
  network = _in_chain(e, _network_error_types())
  missing_module = _in_chain(e, (ImportError,))
  if network is not None:
    return errors.DataError(
        f"{head} download it: no network access ({errors.one_line(network)}). "
        f"Either point to a tfds data dir that holds a prepared copy with "
        f"{errors.DATA_DIR_FLAGS}, or connect to the network and rerun "
        f"{elsewhere}.")
  if missing_module is not None:
    return errors.DataError(
        f"{head} prepare it: tfds' builder needs a module that is not "
        f"installed ({errors.one_line(missing_module)}). Reinstall petra_jax with "
        "`pip install -e .`, which installs what tfds' builders need, or point to "
        f"a tfds data dir that holds a prepared copy with {errors.DATA_DIR_FLAGS}.")
  return errors.DataError(
      f"{head} download and prepare it there ({errors.one_line(e)}). Either "
      f"point to a tfds data dir that holds a prepared copy with "
      f"{errors.DATA_DIR_FLAGS}, or retry on a machine with network access "
      f"{elsewhere}.")


def _network_error_types() -> tuple[type[BaseException], ...]:
  """The exceptions that say the network is unreachable."""
  kinds = [ConnectionError, TimeoutError, socket.gaierror, urllib.error.URLError]
  try:
    import requests  # pylint: disable=g-import-not-at-top

    kinds += [requests.exceptions.ConnectionError, requests.exceptions.Timeout]
  except ImportError:
    pass
  return tuple(kinds)


def _in_chain(e: BaseException | None, kinds: tuple[type[BaseException], ...]
              ) -> BaseException | None:
  """The first exception of type ``kinds`` in ``e``'s cause/context chain."""
  seen = set()
  while e is not None and id(e) not in seen:
    if isinstance(e, kinds):
      return e
    seen.add(id(e))
    e = e.__cause__ or e.__context__
  return None
