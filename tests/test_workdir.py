"""Tests for petra_jax.training.workdir (one run per workdir)."""

import datetime
import errno
import fcntl
import json
import logging
import os
import pathlib
import socket
import subprocess
import sys

import pytest

from petra_jax.training import workdir as workdir_lib

WORKDIR_PY = pathlib.Path(workdir_lib.__file__)
HOST = socket.gethostname()

# A child process that takes the lock (loading workdir.py by path: no JAX
# import), prints "held" and keeps it until its stdin closes; exit status 3
# and the error on stderr if the workdir is busy.
CHILD = """
import importlib.util, sys
spec = importlib.util.spec_from_file_location("workdir", sys.argv[1])
w = importlib.util.module_from_spec(spec)
spec.loader.exec_module(w)
lock = w.WorkdirLock(sys.argv[2])
try:
  lock.acquire()
except w.WorkdirBusyError as e:
  print(e, file=sys.stderr)
  sys.exit(3)
print("held", flush=True)
sys.stdin.read()
lock.release()
"""



def _holder(workdir):
  """The JSON record in a workdir's lock file, or None (no file or no record)."""
  path = pathlib.Path(workdir) / workdir_lib.LOCK_FILENAME
  try:
    record = json.loads(path.read_bytes().decode("utf-8"))
  except (FileNotFoundError, UnicodeDecodeError, ValueError):
    return None
  return record if isinstance(record, dict) else None

def _child(workdir, **kwargs):
  return subprocess.Popen([sys.executable, "-c", CHILD, str(WORKDIR_PY), str(workdir)],
                          stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, **kwargs)


def _dead_pid():
  p = subprocess.Popen([sys.executable, "-c", ""])
  p.wait()
  return p.pid


def _proc_start(pid):
  """Field 22 of /proc/<pid>/stat (start time, clock ticks after boot)."""
  stat = pathlib.Path(f"/proc/{pid}/stat").read_text()
  return int(stat[stat.rindex(")") + 2:].split()[19])


def _write_record(workdir, **record):
  workdir.mkdir(parents=True, exist_ok=True)
  (workdir / workdir_lib.LOCK_FILENAME).write_text(json.dumps(record))


def test_second_acquire_in_same_process_is_refused(tmp_path, caplog):
  run = tmp_path / "run"  # created by acquire
  t0 = datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0)
  with workdir_lib.WorkdirLock(run) as lock:
    assert lock.held and lock.path == str(run / "petra_jax.lock")
    holder = _holder(run)
    assert holder["pid"] == os.getpid() and holder["host"] == HOST
    assert holder["argv"] == sys.argv
    started = datetime.datetime.fromisoformat(holder["started"])
    assert t0 <= started <= datetime.datetime.now(datetime.timezone.utc)
    with pytest.raises(workdir_lib.WorkdirBusyError) as e:
      workdir_lib.WorkdirLock(run).acquire()
    msg = str(e.value)
    assert "\n" not in msg
    for part in (str(run), f"pid {os.getpid()} on host {HOST}",
                 f"started {holder['started']}", lock.path, "--workdir"):
      assert part in msg, (part, msg)
    with pytest.raises(RuntimeError, match="held already"):
      lock.acquire()
  # Released: the file is empty, the next run takes the lock without warning.
  assert not lock.held
  assert os.path.getsize(run / "petra_jax.lock") == 0
  assert _holder(run) is None
  with caplog.at_level(logging.WARNING):
    with workdir_lib.WorkdirLock(run):
      pass
  assert not caplog.records


def test_another_process_is_refused_and_a_killed_one_taken_over(tmp_path, caplog):
  run = tmp_path / "run"
  # This process holds the lock: a second process is refused, naming us.
  with workdir_lib.WorkdirLock(run):
    child = _child(run)
    _, err = child.communicate(timeout=120)
    assert child.returncode == 3
    assert f"pid {os.getpid()} on host {HOST}" in err and str(run) in err
    assert len(err.strip().splitlines()) == 1

  # Another process holds it: we are refused, naming it ...
  child = _child(run)
  try:
    assert child.stdout.readline() == "held\n"
    with pytest.raises(workdir_lib.WorkdirBusyError, match=f"pid {child.pid} on host {HOST}"):
      workdir_lib.WorkdirLock(run).acquire()
  finally:
    child.kill()  # ... until it is killed without releasing the lock.
    child.wait(timeout=60)
  assert _holder(run)["pid"] == child.pid  # its record stays
  with caplog.at_level(logging.WARNING, logger="petra_jax.training.workdir"):
    with workdir_lib.WorkdirLock(run):
      assert _holder(run)["pid"] == os.getpid()
  warning, = caplog.records
  assert f"pid {child.pid} on host {HOST}" in warning.getMessage()
  assert "not running" in warning.getMessage()


def test_stale_record_of_dead_process_is_taken_over(tmp_path, caplog):
  run = tmp_path / "run"
  dead = _dead_pid()
  _write_record(run, pid=dead, host=HOST, started="2020-01-01T00:00:00+00:00",
                proc_start=None, argv=["x"])
  with caplog.at_level(logging.WARNING, logger="petra_jax.training.workdir"):
    with workdir_lib.WorkdirLock(run):
      assert _holder(run)["pid"] == os.getpid()
  warning, = caplog.records
  assert f"pid {dead} on host {HOST}, started 2020-01-01T00:00:00+00:00" in warning.getMessage()


@pytest.mark.skipif(not os.path.exists(f"/proc/{os.getppid()}/stat"), reason="needs /proc")
def test_record_of_live_process_refuses_unless_pid_was_reused(tmp_path, caplog):
  # A live process of this host named by the record refuses the lock even
  # though flock is free (a filesystem whose flock does not work).
  run = tmp_path / "run"
  live = os.getppid()
  _write_record(run, pid=live, host=HOST, started="s", proc_start=_proc_start(live))
  with pytest.raises(workdir_lib.WorkdirBusyError, match=f"pid {live} on host {HOST}"):
    workdir_lib.WorkdirLock(run).acquire()
  # The same pid with another start time is another process: taken over.
  _write_record(run, pid=live, host=HOST, started="s", proc_start=_proc_start(live) + 1)
  with caplog.at_level(logging.WARNING, logger="petra_jax.training.workdir"):
    with workdir_lib.WorkdirLock(run):
      pass
  assert "not running" in caplog.records[-1].getMessage()


def test_record_of_other_host(tmp_path, caplog, monkeypatch):
  run = tmp_path / "run"
  _write_record(run, pid=1, host="elsewhere", started="s")
  # flock free: that run has ended (its host would hold the flock otherwise).
  with caplog.at_level(logging.WARNING, logger="petra_jax.training.workdir"):
    with workdir_lib.WorkdirLock(run):
      pass
  assert "pid 1 on host elsewhere" in caplog.records[-1].getMessage()

  # A filesystem without flock: the record alone decides; another host's run
  # may be alive, so it is refused and the message says how to clear it.
  def no_flock(fd, op):
    raise OSError(errno.ENOLCK, "No locks available")
  monkeypatch.setattr(fcntl, "flock", no_flock)
  _write_record(run, pid=1, host="elsewhere", started="s")
  with pytest.raises(workdir_lib.WorkdirBusyError) as e:
    workdir_lib.WorkdirLock(run).acquire()
  assert "pid 1 on host elsewhere" in str(e.value)
  assert f"delete {run / 'petra_jax.lock'}" in str(e.value)
  # ... and a free one is taken, with a warning that flock is missing.
  (run / "petra_jax.lock").write_text("")
  caplog.clear()
  with caplog.at_level(logging.WARNING, logger="petra_jax.training.workdir"):
    with workdir_lib.WorkdirLock(run):
      assert _holder(run)["pid"] == os.getpid()
  assert "no flock" in caplog.records[-1].getMessage()
