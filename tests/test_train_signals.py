"""The training CLI under a scheduler and a tired user: SIGTERM / Ctrl-C stop
cleanly with a checkpoint and resume exactly; a busy workdir is refused."""

import signal
import subprocess
import sys

import pytest

from helpers import REPO, train_losses, wait_for
from petra_jax.training import preemption

STEPS = 100  # a run signalled once its first step is logged stops long before its end


def _args(data_dir, workdir, *extra):
  return [sys.executable, "-m", "petra_jax.train", "--config=configs/cifar10_cpu.py:runlocal",
          f"--config.steps_per_epoch={STEPS}", f"--config.data_dir={data_dir}",
          f"--workdir={workdir}", *extra]


def _start_and_signal(data_dir, workdir, sig):
  """Starts a run, sends ``sig`` once a step is logged in metrics.jsonl."""
  proc = subprocess.Popen(_args(data_dir, workdir), cwd=REPO, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True)
  try:
    wait_for(lambda: train_losses(workdir), proc, "a step logged", timeout_s=240)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=240)
  finally:
    proc.kill()
  return proc.returncode, err


def _check_clean_stop(rc, err, workdir, sig):
  """Exit 75, one line naming the signal and the step, a checkpoint there."""
  assert rc == preemption.PREEMPTED_EXIT_CODE, err[-2000:]
  assert "Traceback" not in err
  lines = [line for line in err.splitlines() if line.startswith("preempted by")]
  assert len(lines) == 1 and signal.Signals(sig).name in lines[0]
  step = int(lines[0].split(" at step ")[1].split(":")[0])
  assert 1 <= step < STEPS
  saved = sorted(int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit())
  assert saved[-1] == step
  return step


@pytest.mark.long
@pytest.mark.slow
def test_sigterm_stops_with_a_checkpoint_and_resumes_exactly(cifar10_dir, tmp_path):
  # Resumed for 2 more updates (max_steps), against one run of as many: a
  # max_steps run's losses are those of the longer run up to its end.
  rc, err = _start_and_signal(cifar10_dir, tmp_path / "run", signal.SIGTERM)
  step = _check_clean_stop(rc, err, tmp_path / "run", signal.SIGTERM)
  more = f"--config.max_steps={step + 2}"
  for wd in ("run", "ref"):
    r = subprocess.run(_args(cifar10_dir, tmp_path / wd) + [more], cwd=REPO,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
  assert sorted(train_losses(tmp_path / "ref")) == list(range(1, step + 3))
  assert train_losses(tmp_path / "run") == train_losses(tmp_path / "ref")  # every step, exactly


@pytest.mark.slow
def test_ctrl_c_is_the_same_clean_stop(cifar10_dir, tmp_path):
  rc, err = _start_and_signal(cifar10_dir, tmp_path, signal.SIGINT)
  _check_clean_stop(rc, err, tmp_path, signal.SIGINT)


@pytest.mark.slow
def test_second_run_on_a_busy_workdir_is_refused(cifar10_dir, tmp_path):
  first = subprocess.Popen(_args(cifar10_dir, tmp_path), cwd=REPO, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)
  try:
    wait_for(lambda: (tmp_path / "metrics.jsonl").exists(), first, "metrics.jsonl written",
             timeout_s=120)
    second = subprocess.run(_args(cifar10_dir, tmp_path), cwd=REPO, capture_output=True,
                            text=True, timeout=120)
    assert second.returncode == 1
    assert "Traceback" not in second.stderr
    error = [line for line in second.stderr.splitlines() if line.startswith("error:")]
    assert len(error) == 1 and str(first.pid) in error[0], second.stderr[-1000:]
  finally:
    first.kill()
    first.wait()


def test_processes_agree_to_stop_only_every_n_updates(monkeypatch):
  # Multi-process: the collective runs at the multiples of
  # distributed.preemption_check_every only; one process checks every update.
  import types
  import ml_collections
  from petra_jax.training import distributed, loop
  calls = []
  monkeypatch.setattr(distributed, "any_process", lambda flag: calls.append(flag) or flag)
  config = ml_collections.ConfigDict({"distributed": {"preemption_check_every": 4}})
  run = types.SimpleNamespace(config=config, pipe=types.SimpleNamespace(multiprocess=True))
  stop = preemption.StopOnSignal()
  stop.request()
  stopped = []
  for step in range(1, 13):
    run.step = step
    if loop._stop_requested(run, stop):  # pylint: disable=protected-access
      stopped.append(step)
  assert stopped == [4, 8, 12] and len(calls) == 3
  run.pipe.multiprocess = False
  run.step = 5
  assert loop._stop_requested(run, stop) and len(calls) == 3  # pylint: disable=protected-access


def test_loss_relay_delivers_each_loss_once_per_flush_in_order():
  import jax.numpy as jnp
  import numpy as np
  from petra_jax.training.loss_log import LossRelay

  class Log:
    def __init__(self):
      self.got = []

    def add(self, m, loss):
      self.got.append((m, np.float32(loss)))

  values = np.random.default_rng(0).standard_normal(7).astype(np.float32)
  # One process: straight through, None skipped.
  log = Log()
  relay = LossRelay(log)
  relay.add(0, jnp.float32(values[0]))
  relay.add(1, None)
  assert log.got == [(0, values[0])]
  # Multi-process: nothing moves until flush, then one vector of every loss.
  log, moved = Log(), []

  def move(vector, spec):
    moved.append(spec.shape)
    return vector

  relay = LossRelay(log, move)
  for m, v in enumerate(values[:5]):
    relay.add(m, jnp.float32(v))
  assert log.got == [] and moved == []
  relay.flush()
  relay.flush()  # nothing pending: no transfer
  for m, v in enumerate(values[5:], 5):
    relay.add(m, jnp.float32(v))
  relay.flush()
  assert moved == [(5,), (2,)]
  assert [m for m, _ in log.got] == list(range(7))
  assert np.array_equal(np.array([v for _, v in log.got]), values)  # bit for bit
  # A process that is neither end: its None losses travel as None.
  relay = LossRelay(log, lambda vector, spec: moved.append(vector) or None)
  relay.add(0, None)
  relay.flush()
  assert moved[-1] is None
