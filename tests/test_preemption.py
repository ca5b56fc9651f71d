"""Tests for petra_jax.training.preemption (SIGTERM / SIGINT as a stop flag)."""

import logging
import os
import pathlib
import signal
import subprocess
import sys
import threading
import time

import pytest

from petra_jax.training import preemption

PREEMPTION_PY = pathlib.Path(preemption.__file__)

# A training loop in miniature (loading preemption.py by path: no JAX import):
# prints "ready", runs ticks until a stop is requested, then "saves a
# checkpoint" (instantly, or for ever with "slow_save") and exits preempted.
CHILD = """
import importlib.util, signal, sys, time
spec = importlib.util.spec_from_file_location("preemption", sys.argv[1])
p = importlib.util.module_from_spec(spec)
spec.loader.exec_module(p)
escalate = [signal.SIGINT] + ([signal.SIGTERM] if sys.argv[2] == "slow_save" else [])
with p.StopOnSignal(escalate=escalate) as stop:
  print("ready", flush=True)
  tick = 0
  while not stop.requested:
    time.sleep(0.01)
    tick += 1
  while sys.argv[2] == "slow_save":
    time.sleep(0.01)
  print(f"checkpoint saved at tick {tick}", flush=True)
  p.exit_preempted(f"preempted by {stop.signal_name} at tick {tick}")
"""


def _child(mode):
  return subprocess.Popen([sys.executable, "-c", CHILD, str(PREEMPTION_PY), mode],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for(predicate, timeout_s=30.0):
  """Polls ``predicate`` (the Python signal handler runs between bytecodes)."""
  deadline = time.monotonic() + timeout_s
  while not predicate():
    assert time.monotonic() < deadline, "signal not handled"
    time.sleep(0.001)


def _handlers():
  return signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)


def test_sigterm_sets_the_flag_and_the_process_lives_on(capfd):
  before = _handlers()
  with preemption.StopOnSignal() as stop:
    assert stop.installed and not stop.requested and stop.signal_name is None
    os.kill(os.getpid(), signal.SIGTERM)
    _wait_for(lambda: stop.requested)
    assert stop.signal_name == "SIGTERM"
    # A second SIGTERM (launchers may repeat it) is ignored: still alive.
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(0.05)
    assert stop.requested and stop.signal_name == "SIGTERM"
  assert _handlers() == before and not stop.installed
  err = capfd.readouterr().err
  assert err.count("SIGTERM received") == 1 and "checkpoint" in err


def test_second_sigint_runs_the_previous_handler():
  calls = []
  original = signal.signal(signal.SIGINT, lambda signum, frame: calls.append(signum))
  try:
    previous = signal.getsignal(signal.SIGINT)
    with preemption.StopOnSignal(announce=False) as stop:
      os.kill(os.getpid(), signal.SIGINT)
      _wait_for(lambda: stop.requested)
      assert stop.signal_name == "SIGINT" and calls == []
      os.kill(os.getpid(), signal.SIGINT)
      _wait_for(lambda: calls)
      assert calls == [signal.SIGINT]
    assert signal.getsignal(signal.SIGINT) is previous
  finally:
    signal.signal(signal.SIGINT, original)


def test_second_ctrl_c_raises_keyboard_interrupt():
  if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
    pytest.skip("SIGINT is not Python's default handler here")
  with pytest.raises(KeyboardInterrupt):
    with preemption.StopOnSignal(announce=False) as stop:
      os.kill(os.getpid(), signal.SIGINT)
      _wait_for(lambda: stop.requested)
      os.kill(os.getpid(), signal.SIGINT)
      _wait_for(lambda: False)  # interrupted by the KeyboardInterrupt
  assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_preempted_run_finishes_its_tick_and_exits_75():
  child = _child("fast_save")
  try:
    assert child.stdout.readline() == "ready\n"
    time.sleep(0.05)
    child.send_signal(signal.SIGTERM)
    out, err = child.communicate(timeout=60)
  finally:
    child.kill()
  assert child.returncode == preemption.PREEMPTED_EXIT_CODE == 75
  assert out.startswith("checkpoint saved at tick ")
  tick = out.split()[-1]
  assert err.splitlines() == [
      "SIGTERM received: stopping after the current step and saving a checkpoint.",
      f"preempted by SIGTERM at tick {tick}"]


def test_escalating_signal_kills_a_slow_save():
  child = _child("slow_save")
  try:
    assert child.stdout.readline() == "ready\n"
    child.send_signal(signal.SIGTERM)
    assert "again to stop at once" in child.stderr.readline()
    child.send_signal(signal.SIGTERM)  # default action of SIGTERM: death
    out, err = child.communicate(timeout=60)
  finally:
    child.kill()
  assert child.returncode == -signal.SIGTERM
  assert "checkpoint saved" not in out and "stopping now" in err


def test_request_without_signal_and_bad_arguments():
  stop = preemption.StopOnSignal()
  stop.request()
  assert stop.requested and stop.signal_name == "request"
  with pytest.raises(ValueError, match="subset"):
    preemption.StopOnSignal(signals=(signal.SIGTERM,), escalate=(signal.SIGINT,))
  with pytest.raises(ValueError, match="SIGKILL"):
    preemption.StopOnSignal(signals=(signal.SIGKILL,), escalate=())
  with pytest.raises(SystemExit) as e:
    preemption.exit_preempted("bye")
  assert e.value.code == 75


def test_off_the_main_thread_installs_nothing(caplog):
  before, result = _handlers(), {}

  def body():
    with preemption.StopOnSignal() as stop:
      result["installed"] = stop.installed
      result["handlers"] = _handlers()

  with caplog.at_level(logging.WARNING, logger="petra_jax.training.preemption"):
    thread = threading.Thread(target=body)
    thread.start()
    thread.join()
  assert result == {"installed": False, "handlers": before}
  assert "main thread" in caplog.records[-1].getMessage()
