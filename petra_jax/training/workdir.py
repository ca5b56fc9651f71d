"""One run per workdir: a lock held for a training run's lifetime.

``<workdir>/petra_jax.lock`` is ``fcntl.flock``-ed (exclusive, non-blocking)
for the run's lifetime and holds a JSON record of the holder (``pid``,
``host``, ``started``, ``proc_start``, ``argv``); a second run fails with
one line naming the first. The kernel drops a flock when its process dies,
so a dead run never blocks a new one (its lock is taken over with a
warning). The record is also checked alone, for filesystems without
working flock: a live process on this host refuses the lock; on another
host, liveness is unknown and the lock is refused. Releasing empties the
file (an empty lock file is free). Multi-process: process 0 takes it.
"""

import contextlib
import datetime
import errno
import fcntl
import json
import logging
import os
import shutil
import socket
import sys
import tempfile
from typing import Any

LOCK_FILENAME = "petra_jax.lock"
# What a run adds to its workdir (a refused start takes back those it added).
RUN_ENTRIES = (LOCK_FILENAME, "config.json", "config.json.tmp", "checkpoints", "tensorboard",
               "metrics.jsonl")
_MAX_RECORD_BYTES = 1 << 16
# errno values meaning "this filesystem does not do flock".
_NO_FLOCK_ERRNOS = (errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL)

logger = logging.getLogger(__name__)


class WorkdirBusyError(RuntimeError):
  """The workdir is in use by another run; the message names it and the fix."""


class WorkdirError(ValueError):
  """A workdir that cannot be used; the message names the fix."""


def check_workdir(workdir: str | os.PathLike) -> None:
  """Creates ``workdir`` if missing and checks a file can be written in it.

  Raises:
    WorkdirError: a file, under a file, or not writable.
  """
  path = os.path.abspath(os.fspath(workdir))
  if os.path.exists(path) and not os.path.isdir(path):
    raise WorkdirError(f"--workdir {path} is a file; pass a directory, or a path that does "
                       "not exist yet.")
  parent = path
  while not os.path.exists(parent):
    parent = os.path.dirname(parent)
  if not os.path.isdir(parent):
    raise WorkdirError(f"--workdir {path} lies under {parent}, which is a file; pass a "
                       "path under a directory.")
  try:
    os.makedirs(path, exist_ok=True)
    fd, probe = tempfile.mkstemp(dir=path, prefix=".petra_jax_write_test")
    os.close(fd)
    os.remove(probe)
  except OSError as e:
    raise WorkdirError(f"cannot write in --workdir {path} ({e.strerror or e}); pass a "
                       "directory you can write to.") from None


@contextlib.contextmanager
def kept_as_found(workdir: str | os.PathLike, enabled: bool = True):
  """Yields ``accept()``: until it is called, an exception leaves ``workdir`` as it was found.

  A refused start (bad config, another run's checkpoint, missing data, a
  signal) removes what it added: the workdir itself (and the parents it
  created) if it did not exist, else the :data:`RUN_ENTRIES` that were not
  there. Nothing is removed after ``accept()``, nor when another run holds
  the lock (:class:`WorkdirBusyError`: what is there is that run's).
  """
  path = os.path.abspath(os.fspath(workdir))
  top = path
  while not os.path.exists(os.path.dirname(top)) and os.path.dirname(top) != top:
    top = os.path.dirname(top)
  before = set(os.listdir(path)) if os.path.isdir(path) else None
  enabled = enabled and (before is not None or not os.path.lexists(path))  # (a file: leave it)
  accepted = []
  try:
    yield lambda: accepted.append(True)
  except WorkdirBusyError:
    raise
  except BaseException:
    if enabled and not accepted:
      _take_back(path, top, before)
    raise


def _take_back(path: str, top: str, before: set | None) -> None:
  """Removes what a refused start added under ``path`` (all of ``top`` if new)."""
  if before is None:
    shutil.rmtree(top if os.path.exists(top) else path, ignore_errors=True)
    return
  for name in RUN_ENTRIES:
    added = os.path.join(path, name)
    if name in before or not os.path.lexists(added):
      continue
    if os.path.isdir(added) and not os.path.islink(added):
      shutil.rmtree(added, ignore_errors=True)
    else:
      os.remove(added)


class WorkdirLock:
  """An exclusive lock on ``workdir`` (a context manager, or ``acquire`` /
  ``release``); ``path`` is its lock file.
  """

  def __init__(self, workdir: str | os.PathLike):
    self.workdir = os.fspath(workdir)
    self.path = os.path.join(self.workdir, LOCK_FILENAME)
    self._fd: int | None = None

  @property
  def held(self) -> bool:
    """Whether this object holds the lock."""
    return self._fd is not None

  def acquire(self) -> "WorkdirLock":
    """Takes the lock (creating the workdir) and writes this process's record.

    Raises:
      WorkdirBusyError: another run holds it (names it and the fixes).
      RuntimeError: held already. OSError: the lock file cannot be written.
    """
    if self._fd is not None:
      raise RuntimeError(f"WorkdirLock({self.workdir!r}) is held already.")
    os.makedirs(self.workdir, exist_ok=True)
    fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
      try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        flocked = True
      except BlockingIOError:
        holder = _parse_record(os.pread(fd, _MAX_RECORD_BYTES, 0))
        raise self._busy(holder, flocked=True) from None
      except OSError as e:
        if e.errno not in _NO_FLOCK_ERRNOS:
          raise
        flocked = False
        logger.warning("The filesystem of %s has no flock (%s); the lock relies "
                       "on its holder record only.", self.path, e.strerror)
      previous = _parse_record(os.pread(fd, _MAX_RECORD_BYTES, 0))
      if previous is not None:
        self._check_previous(previous, flocked)
      record = json.dumps(_own_record()).encode() + b"\n"
      os.ftruncate(fd, 0)
      os.pwrite(fd, record, 0)
      os.fsync(fd)
    except BaseException:
      os.close(fd)
      raise
    self._fd = fd
    return self

  def release(self) -> None:
    """Empties the lock file and drops the lock; a no-op if not held."""
    fd, self._fd = self._fd, None
    if fd is None:
      return
    try:
      os.ftruncate(fd, 0)
    finally:
      os.close(fd)

  def __enter__(self) -> "WorkdirLock":
    return self.acquire()

  def __exit__(self, *exc_info) -> None:
    self.release()

  def _check_previous(self, previous: dict[str, Any], flocked: bool) -> None:
    """Raises WorkdirBusyError if the record left in the file is a live run;
    otherwise logs that its lock is taken over."""
    pid, host = previous.get("pid"), previous.get("host")
    if host == socket.gethostname() and isinstance(pid, int):
      if pid != os.getpid() and _is_running(pid, previous.get("proc_start")):
        raise self._busy(previous, flocked=flocked)
      reason = "that process is not running any more"
    elif flocked:
      reason = "its lock is free, so that run has ended"
    else:
      raise self._busy(previous, flocked=False)
    logger.warning("Taking over the lock of workdir %s from %s: %s.",
                   self.workdir, _describe(previous), reason)

  def _busy(self, holder: dict[str, Any] | None, flocked: bool) -> WorkdirBusyError:
    who = _describe(holder) if holder else "another run (its record is not written yet)"
    note, fix = "", "Wait for that run to end or stop it, or pass another --workdir."
    if holder and holder.get("host") == socket.gethostname() and isinstance(
        holder.get("pid"), int) and not _is_running(holder["pid"], holder.get("proc_start")):
      note = (" That process is not running any more, but a process it forked "
              "still holds the lock.")
      fix = "Stop that process, or pass another --workdir."
    elif not flocked:
      fix = (f"If that run is over, delete {self.path}; otherwise wait for it "
             "to end, or pass another --workdir.")
    return WorkdirBusyError(
        f"Workdir {self.workdir} is in use by {who} (lock file {self.path}).{note} {fix}")


def _describe(record: dict[str, Any]) -> str:
  return (f"pid {record.get('pid', '?')} on host {record.get('host', '?')}, "
          f"started {record.get('started', '?')}")


def _parse_record(raw: bytes) -> dict[str, Any] | None:
  try:
    record = json.loads(raw.decode("utf-8"))
  except (UnicodeDecodeError, ValueError):
    return None
  return record if isinstance(record, dict) else None


def _own_record() -> dict[str, Any]:
  pid = os.getpid()
  return {
      "pid": pid,
      "host": socket.gethostname(),
      "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
      "proc_start": _proc_stat(pid)[1],
      "argv": [str(a) for a in sys.argv][:64],
  }


def _proc_stat(pid: int) -> tuple[str | None, int | None]:
  """(state, start time in clock ticks after boot) of a process from
  ``/proc/<pid>/stat``; (None, None) where unavailable (not Linux, gone)."""
  try:
    with open(f"/proc/{pid}/stat", "rb") as f:
      stat = f.read().decode("utf-8", "replace")
    fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) "
    return fields[0], int(fields[19])
  except (OSError, ValueError, IndexError):
    return None, None


def _is_running(pid: int, proc_start: int | None) -> bool:
  """Whether ``pid`` runs on this host, is no zombie, and started at
  ``proc_start`` (None: unknown; a reused pid does not count).
  """
  if pid <= 0:
    return False
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:
    pass  # exists, owned by another user
  state, start = _proc_stat(pid)
  if state == "Z":
    return False
  return proc_start is None or start is None or start == proc_start
