"""The training CLI under a scheduler and a tired user: SIGKILL, SIGTERM and
Ctrl-C (SIGINT) resume with the losses of one uninterrupted run; a busy
workdir is refused; a finished run is left alone.

One uninterrupted reference run (6 updates, 2 epochs of 3, a checkpoint at
each epoch end) serves every check. The interrupted runs are the real CLI
with one test hook (``PAUSE``): it stops the process, as a slow step would,
right after ``metrics.jsonl`` receives the ``train_loss`` of a chosen step
(helpers.Paused), so the test signals it at a known point, waiting for that
event, not a clock.
"""

import os
import signal
import subprocess
import sys

import pytest

from helpers import REPO, Paused, config_file, override, tensorboard_scalars
from helpers import train_in_process, train_losses, wait_for
from petra_jax.training import checkpoint, console, loop, metrics, preemption, run_record

STEPS_PER_EPOCH, EPOCHS = 3, 2
STEPS = STEPS_PER_EPOCH * EPOCHS

def _overrides(data_dir):
  return {"steps_per_epoch": STEPS_PER_EPOCH, "num_epochs": EPOCHS, "data_dir": data_dir,
          "eval_examples": 500, "eval_batch_size": 500}


def _args(data_dir, workdir, *extra):
  """The CLI's arguments (after ``python -m petra_jax.train``)."""
  return ["--config=configs/cifar10_cpu.py:runlocal",
          *(f"--config.{k}={v}" for k, v in _overrides(data_dir).items()),
          f"--workdir={workdir}", *extra]


def _cli(data_dir, workdir, *extra):
  return subprocess.run([sys.executable, "-m", "petra_jax.train",
                         *_args(data_dir, workdir, *extra)],
                        cwd=REPO, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def reference(cifar10_dir, tmp_path_factory):
  """``{step: train_loss}`` and the metrics of one uninterrupted run of the
  CLI's config (run in this process: the same code without a start-up)."""
  c = override(config_file("configs/cifar10_cpu.py", "runlocal"), **_overrides(cifar10_dir))
  workdir = str(tmp_path_factory.mktemp("reference"))
  loop.train_and_evaluate(c, workdir)
  losses = train_losses(workdir)
  assert sorted(losses) == list(range(1, STEPS + 1))
  return losses, metrics.read_metrics(workdir)


def _check_clean_stop(rc, err, workdir, sig):
  """Exit 75, one line naming the signal and the step, a checkpoint there."""
  assert rc == preemption.PREEMPTED_EXIT_CODE, err
  assert "Traceback" not in err
  lines = [line for line in err.splitlines() if line.startswith("preempted by")]
  assert len(lines) == 1 and signal.Signals(sig).name in lines[0], err
  step = int(lines[0].split(" at step ")[1].split(":")[0])
  assert 1 <= step < STEPS
  saved = sorted(int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit())
  assert saved[-1] == step
  return step


def _resume(data_dir, workdir, *extra):
  r = _cli(data_dir, workdir, *extra)
  assert r.returncode == 0, r.stderr[-3000:]
  assert "resumed at update" in r.stdout, r.stdout[-2000:]
  lines = (workdir / "metrics.jsonl").read_text().splitlines()
  return sum('"train_loss"' in line for line in lines)  # lines, not steps: each once


@pytest.mark.slow
def test_busy_workdir_is_refused_then_ctrl_c_stops_and_resumes_exactly(cifar10_dir, tmp_path,
                                                                       reference):
  wd = tmp_path / "run"
  run = Paused(_args(cifar10_dir, wd), 1)
  try:
    second = _cli(cifar10_dir, wd)  # the real command, while the first holds the workdir
    assert second.returncode == 1
    assert "Traceback" not in second.stderr
    error = [line for line in second.stderr.splitlines() if line.startswith("error:")]
    assert len(error) == 1 and str(run.proc.pid) in error[0], second.stderr[-1000:]
    rc, err = run.signal_and_go_on(signal.SIGINT)
  finally:
    run.kill()
  _check_clean_stop(rc, err, wd, signal.SIGINT)
  assert _resume(cifar10_dir, wd) == STEPS
  assert train_losses(wd) == reference[0]  # every step, exactly


@pytest.mark.long  # the Ctrl-C test's stop and resume; test_train_resume's SIGTERM (CI time)
@pytest.mark.slow
def test_sigterm_stops_with_a_checkpoint_and_resumes_exactly(cifar10_dir, tmp_path, reference):
  # Resumed for 1 more update (max_steps): a max_steps run's losses are those
  # of the longer run up to its end.
  wd = tmp_path / "run"
  run = Paused(_args(cifar10_dir, wd), 2)
  try:
    rc, err = run.signal_and_go_on(signal.SIGTERM)
  finally:
    run.kill()
  step = _check_clean_stop(rc, err, wd, signal.SIGTERM)
  assert _resume(cifar10_dir, wd, f"--config.max_steps={step + 1}") == step + 1
  losses = reference[0]
  assert train_losses(wd) == {s: losses[s] for s in range(1, step + 2)}


@pytest.mark.slow
def test_sigkill_after_an_unsaved_step_resumes_exactly_then_is_left_alone(
    cifar10_dir, tmp_path, reference, monkeypatch, capsys):
  # Killed once update 4's loss is logged: the checkpoint of update 3 (the
  # end of epoch 1) holds metrics.jsonl up to a point before it, so the
  # resumed run rewrites what follows, each step once in metrics.jsonl and
  # TensorBoard, with the uninterrupted run's losses.
  wd = tmp_path / "run"
  run = Paused(_args(cifar10_dir, wd), 4)
  try:
    wait_for(lambda: checkpoint.newest_meta(str(wd / "checkpoints")) is not None, run.proc,
             "the checkpoint of update 3")
    run.signal_and_go_on(signal.SIGKILL)
  finally:
    run.kill()
  step, meta = checkpoint.newest_meta(str(wd / "checkpoints"))
  assert step == 3
  held = (wd / "metrics.jsonl").read_bytes()[:meta["extra"]["metrics_offset"]]
  assert b'"step": 4' not in held and 4 in train_losses(wd)  # logged, not checkpointed
  r = _cli(cifar10_dir, wd)
  assert r.returncode == 0, r.stderr[-2000:]
  assert "resumed at update 3" in r.stdout
  records = metrics.read_metrics(str(wd))
  train_steps = [x["step"] for x in records if "train_loss" in x]
  assert train_steps == list(range(1, STEPS + 1))
  assert train_losses(wd) == reference[0]
  assert [x["step"] for x in records if "test_loss" in x] == [3, 6]
  want = [(x["step"], x["test_loss"]) for x in reference[1] if "test_loss" in x]
  assert [(x["step"], x["test_loss"]) for x in records if "test_loss" in x] == want
  tb = tensorboard_scalars(wd)
  assert sorted(s for t, s in tb if t == "train_loss") == train_steps
  assert sorted(s for t, s in tb if t == "test_loss") == [3, 6]
  saved = run_record.get_config(str(wd / "config.json"))
  assert saved.steps_per_epoch == 3 and saved.model.width == 4

  # Finished: the same command (the real one) and WORKDIR/config.json (in
  # this process) say so and change nothing.
  size = os.path.getsize(wd / "metrics.jsonl")
  finished = [f"already finished: {wd} holds the checkpoint of its last step (6); nothing to "
              "do (pass --restart to train it again from scratch)."]
  again = _cli(cifar10_dir, wd)
  assert again.returncode == 0 and not again.stderr.strip(), again.stderr[-2000:]
  assert again.stdout.strip().splitlines() == finished
  again = train_in_process(capsys, f"--config={wd / 'config.json'}", f"--workdir={wd}")
  assert again.returncode == 0 and not again.stderr.strip(), again.stderr[-2000:]
  assert again.stdout.strip().splitlines() == finished
  assert os.path.getsize(wd / "metrics.jsonl") == size

  # A longer run with another rate: one note naming the rate, not the length.
  c = run_record.get_config(str(wd / "config.json"))
  c.num_epochs, c.optim.learning_rate = 3, 0.01
  notes = []

  def stop(*a):
    raise _Stop()
  monkeypatch.setattr(console, "warn", notes.append)
  monkeypatch.setattr(loop, "setup", stop)
  with pytest.raises(_Stop):
    loop.train_and_evaluate(c, str(wd))
  assert notes == [f"warning: resuming {wd} (step 6) with a config that differs from "
                   "its checkpoint's: optim.learning_rate 0.05 -> 0.01."]


class _Stop(Exception):
  pass


def test_processes_agree_to_stop_only_every_n_updates(monkeypatch):
  # Multi-process: the collective runs at the multiples of
  # distributed.preemption_check_every only; one process checks every update.
  import types
  import ml_collections
  from petra_jax.training import distributed
  calls = []
  monkeypatch.setattr(distributed, "any_process", lambda flag: calls.append(flag) or flag)
  config = ml_collections.ConfigDict({"distributed": {"preemption_check_every": 4}})
  run = types.SimpleNamespace(config=config, pipe=types.SimpleNamespace(multiprocess=True))
  stop = preemption.StopOnSignal()
  stop.request()
  stopped = []
  for step in range(1, 13):
    if loop._stop_requested(run, step, stop):  # pylint: disable=protected-access
      stopped.append(step)
  assert stopped == [4, 8, 12] and len(calls) == 3
  run.pipe.multiprocess = False
  assert loop._stop_requested(run, 5, stop) and len(calls) == 3  # pylint: disable=protected-access


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
