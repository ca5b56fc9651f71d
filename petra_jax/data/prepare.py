"""Where the data lives, and preparing a missing data set with tfds.

``download``: None (default) lets tfds fetch CIFAR-10/100 on first use, True any data set tfds
can download (ImageNet from archives put in ``downloads/manual``), False none. A missing data
set or a failed download is one ``DataError`` line naming the fixes.
"""

import os
import pathlib
import socket
import urllib.error
import urllib.parse

from petra_jax.data import errors
from petra_jax.data import sources

_REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
_SHARED_DATA_DIR = _REPO_ROOT.parent / "shared" / "data" / "tensorflow_datasets"
_TFDS_DEFAULT_DATA_DIR = "~/tensorflow_datasets"
_MANUAL_DIR = os.path.join("downloads", "manual")


def resolve_data_dir(data_dir: str | None) -> str:
  """The tfds data dir: ``data_dir`` > ``$TFDS_DATA_DIR`` > ``<repo>/../shared/data/
  tensorflow_datasets`` if it exists > ``~/tensorflow_datasets``; "" counts as unset."""
  if data_dir:
    return str(data_dir)
  env = os.environ.get("TFDS_DATA_DIR")
  if env:
    return env
  if _SHARED_DATA_DIR.is_dir():
    return str(_SHARED_DATA_DIR)
  return os.path.expanduser(_TFDS_DEFAULT_DATA_DIR)


def is_prepared(name: str, info: sources.DatasetInfo, data_dir: str) -> tuple[bool, str]:
  """``(prepared, where tfds looked)``; DataError if tfds cannot read its metadata."""
  try:
    builder = sources.tfds_builder(info, data_dir)
    return bool(builder.is_prepared()), str(builder.data_dir)
  except Exception as e:  # pylint: disable=broad-except
    reason = f"tfds cannot read its metadata ({errors.one_line(e)})"
    raise errors.missing_data_error(name, data_dir, reason) from None


def ensure_prepared(
    name: str, data_dir: str | None = None, download: bool | None = None
) -> str:
  """The resolved data dir, after preparing the dataset there if ``download`` allows it.

  Call it in one process of a multi-process run, then synchronise.

  Raises:
    DataError: unknown dataset, bad ``download``, dataset missing and not to be
      downloaded, or the download failed (e.g. no network); the message names the fix.
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
  """Resolves the download hosts: no network fails at once, not after tfds' retries.

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
