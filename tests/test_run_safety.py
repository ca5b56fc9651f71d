"""A run loses no work and says what happened: checkpoints by default, resume
without duplicate metrics, a finished run left alone, config.json, and one
line for each failure."""

import errno
import dataclasses
import io
import json
import os
import signal
import subprocess
import sys
import time
import types

import jax
import optax
import pytest
from ml_collections.config_flags import config_flags
from tqdm import tqdm

from petra_jax.training.checkpoint import blocks as checkpoint_blocks
from petra_jax import config as config_lib
from petra_jax import models, train
from petra_jax.engine.stages import objective
from petra_jax.engine import pipeline
from petra_jax.training import assembly
from petra_jax.training import checkpoint, console, loop, metrics, preemption
from petra_jax.training.checkpoint import orbax_local
from petra_jax.training import run_record, workdir as workdir_lib
from helpers import SMALL_EVAL, random_batch, tensorboard_scalars, train_in_process

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_metric_writer_flushes_and_resumes_without_duplicates(tmp_path):
  w = metrics.MetricWriter(str(tmp_path))
  w.write(1, train_loss=1.0)
  w.write(2, train_loss=2.0)
  offset = w.offset()
  w.write(3, train_loss=3.0)  # after the "checkpoint": rewritten on resume
  # Flushed at each line: on disk before close (what a SIGKILL leaves).
  assert tensorboard_scalars(tmp_path) == [("train_loss", 1), ("train_loss", 2),
                                           ("train_loss", 3)]
  w2 = metrics.MetricWriter(str(tmp_path), truncate_to=offset)
  w2.write(3, train_loss=3.5)
  w2.write(4, train_loss=4.0)
  w2.close()
  assert [r["step"] for r in metrics.read_metrics(str(tmp_path))] == [1, 2, 3, 4]
  assert metrics.read_metrics(str(tmp_path))[2]["train_loss"] == 3.5
  assert sorted(tensorboard_scalars(tmp_path)) == [("train_loss", s) for s in (1, 2, 3, 4)]
  metrics.MetricWriter(str(tmp_path)).close()  # no checkpoint: a fresh run
  assert metrics.read_metrics(str(tmp_path)) == [] and tensorboard_scalars(tmp_path) == []


def test_config_json_round_trips_through_the_config_flag(tmp_path):
  c = config_lib.get_config()
  c.model.stage_sizes = (1, 2, 2, 5)
  c.optim.decay_epochs = (3, 7)
  c.download = False
  c.compensation.name = "pipemare"
  path = run_record.write_config(str(tmp_path), c)
  with open(path, encoding="utf-8") as f:
    assert json.load(f)["model"]["stage_sizes"] == [1, 2, 2, 5]
  # What train.py hands config_flags for --config=WORKDIR/config.json.
  argv = train._checked_config(
      ["train", f"--config={path}"])
  loaded = config_flags.ConfigFileFlagParser("config").parse(argv[1][len("--config="):])
  assert loaded.to_dict() == c.to_dict() and loaded.model.stage_sizes == (1, 2, 2, 5)
  assert loaded.download is False


def test_config_differences_leave_out_run_length_fields():
  c = config_lib.get_config()
  saved = run_record.as_dict(c)
  c.num_epochs, c.log_every, c.checkpoint_minutes = 5, 3, 1.0
  assert run_record.differences(saved, c) == []
  c.optim.learning_rate, c.seed = 0.3, 2
  assert run_record.differences(saved, c) == ["optim.learning_rate 0.0 -> 0.3", "seed 0 -> 2"]


def test_a_run_is_finished_only_at_its_own_last_step():
  c = config_lib.get_config()
  extra = {"run": run_record.run_end(c, 40)}
  assert run_record.finished(40, extra, c)
  assert not run_record.finished(39, extra, c)
  assert not run_record.finished(40, {}, c)  # an older checkpoint: resumed as before
  c.num_epochs += 1  # a longer run of the same workdir
  assert not run_record.finished(40, extra, c)


def test_bad_workdirs_name_the_fix(tmp_path, monkeypatch):
  a_file = tmp_path / "file"
  a_file.write_text("x")
  with pytest.raises(workdir_lib.WorkdirError, match="is a file; pass a directory"):
    workdir_lib.check_workdir(a_file)
  with pytest.raises(workdir_lib.WorkdirError, match=f"lies under {a_file}, which is a file"):
    workdir_lib.check_workdir(a_file / "run")

  def denied(*a, **k):
    raise PermissionError(errno.EACCES, "Permission denied")
  monkeypatch.setattr(workdir_lib.tempfile, "mkstemp", denied)
  with pytest.raises(workdir_lib.WorkdirError, match="cannot write in --workdir .*Permission "
                     "denied.*a directory you can write to"):
    workdir_lib.check_workdir(tmp_path / "new")


def _cli(*args):
  return subprocess.run([sys.executable, "-m", "petra_jax.train", *args], cwd=REPO,
                        capture_output=True, text=True, timeout=300)


def test_cli_missing_config_and_bad_workdir_are_one_line(capsys, tmp_path):
  a_file = tmp_path / "file"
  a_file.write_text("x")
  for args, message in (
      (["--config=configs/nope.py"], "error: config file configs/nope.py does not exist"),
      (["--config=configs/cifar10_cpu.py", f"--workdir={a_file}"], "is a file"),
      (["--config=configs/cifar10_cpu.py", f"--workdir={a_file}/run"], "which is a file"),
      (["--config=configs/cifar10_cpu.py", "--restart", f"--workdir={a_file}"], "is a file")):
    r = train_in_process(capsys, *args)  # in this process: no start-up to pay
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr[-2000:]
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], lines


def _tiny_pipeline():
  stages = models.build_model("revnet18", width=2)
  pipe = pipeline.Pipeline(stages, optax.sgd(0.1), jax.devices()[:1], method="petra")
  return pipe, pipe.init(0, random_batch()[0])


def test_disk_full_while_checkpointing_loses_nothing_saved(tmp_path, monkeypatch):
  pipe, state = _tiny_pipeline()
  ckpt = checkpoint.Checkpointer(str(tmp_path), keep=1, fingerprint={})
  ckpt.save(1, state, extra={"n": 1})
  ckpt.wait()

  async def no_space(*a, **k):
    raise OSError(errno.ENOSPC, "No space left on device")
  monkeypatch.setattr(orbax_local, "_write", no_space)
  with pytest.raises(checkpoint_blocks.CheckpointError) as e:
    ckpt.prune(verified_through=2)
    ckpt.save(2, state, extra={"n": 2})
    ckpt.wait()
  assert str(e.value).startswith(f"disk full while writing checkpoint {tmp_path}/2")
  assert "saved before ([1]) are intact" in str(e.value) and "\n" not in str(e.value)
  monkeypatch.undo()
  step, _, extra, _ = checkpoint.Checkpointer(str(tmp_path), keep=1, fingerprint={}).restore(
      state, pipe.devices)
  assert (step, extra) == (1, {"n": 1})


def test_finished_run_is_left_alone_unless_restarted(tmp_path, capsys):
  c = config_lib.get_config()
  c.max_steps = 7
  pipe, state = _tiny_pipeline()
  ckpt = checkpoint.Checkpointer(str(tmp_path / "checkpoints"), keep=1, fingerprint={})
  ckpt.save(7, state, extra={"run": run_record.run_end(c, 7), "config": run_record.as_dict(c)})
  ckpt.wait()
  ckpt.close()
  (tmp_path / "metrics.jsonl").write_text('{"step": 7, "test_accuracy": 0.5}\n')
  assert loop.train_and_evaluate(c, str(tmp_path)) == {"step": 7, "test_accuracy": 0.5}
  assert capsys.readouterr().out.startswith(f"already finished: {tmp_path} holds the "
                                            "checkpoint of its last step (7)")
  assert not (tmp_path / "config.json").exists()  # nothing written
  assert not loop._begin(c, str(tmp_path), restart=True)  # pylint: disable=protected-access
  assert os.listdir(tmp_path) == []  # config.json is written once the set-up succeeds


def test_disk_full_tracebacks_of_orbax_threads_are_not_shown():
  try:
    raise RuntimeError("commit failed") from OSError(errno.ENOSPC, "No space left on device")
  except RuntimeError:
    record = types.SimpleNamespace(exc_info=sys.exc_info(), getMessage=lambda: "x")
  assert not console._DropHarmless().filter(record)
  other = types.SimpleNamespace(exc_info=(OSError, OSError(errno.EIO, "io"), None),
                                getMessage=lambda: "x")
  assert console._DropHarmless().filter(other)


def test_signal_during_start_up_raises_at_once():
  with preemption.StopOnSignal(announce=False) as stop:
    stop.raising = True
    with pytest.raises(preemption.Interrupted) as e:
      os.kill(os.getpid(), signal.SIGTERM)
      for _ in range(10_000_000):  # the handler runs between bytecodes
        pass
    assert e.value.signal_name == "SIGTERM" and not stop.raising
    os.kill(os.getpid(), signal.SIGTERM)  # training: a flag again
    deadline = 10_000_000
    while not stop.requested and deadline:
      deadline -= 1
    assert stop.requested


def test_preempted_line_is_not_glued_to_the_progress_bar(monkeypatch):
  err = io.StringIO()
  monkeypatch.setattr(sys, "stderr", err)
  bar = tqdm(total=10, file=err, disable=False, mininterval=0)
  bar.update(3)
  with pytest.raises(SystemExit) as e:
    preemption.exit_preempted("preempted by SIGTERM at step 3")
  assert e.value.code == preemption.PREEMPTED_EXIT_CODE
  before = err.getvalue().split("preempted by SIGTERM at step 3")[0]
  assert "3/10" in before and before[-1] in "\r\n", repr(before[-80:])
  bar.close()


def test_the_set_up_is_frozen_and_the_progress_holds_what_changes():
  # Issue 49, item 5: the loop and its hooks change only the run's Progress.
  required = [f.name for f in dataclasses.fields(assembly.Setup)
              if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
  run = assembly.Setup(**dict.fromkeys(required))
  for name in ("total_steps", "schedule", "pipe", "checkpointer", "restored_step", "start"):
    with pytest.raises(dataclasses.FrozenInstanceError):
      setattr(run, name, 3)
  with pytest.raises(dataclasses.FrozenInstanceError):
    del run.config
  assert run.drain_points == {} and not hasattr(run.drain_points, "__setitem__")
  progress = assembly.Progress(state="state")
  assert [f.name for f in dataclasses.fields(progress)] == ["state", "step", "last_save", "result"]
  assert (progress.step, progress.result) == (0, {})
  assert not {f.name for f in dataclasses.fields(run)} & {"state", "step", "last_save", "result"}


def _two_stage_run(c):
  """A stand-in for a run's set-up: ``config`` c, two one-block stages on one device."""
  stage = types.SimpleNamespace(blocks=[1])
  pipe = types.SimpleNamespace(stages=[stage] * 2, devices=jax.devices()[:1], num_stages=2,
                               objective=objective.CLASSIFICATION)
  return types.SimpleNamespace(config=c, pipe=pipe, train=[0] * 10, test=[0] * 5,
                               restored_step=None, total_steps=4, steps_per_epoch=2)


def test_summary_names_the_automatic_learning_rate(capsys):
  c = config_lib.get_config()
  c.batch_size, c.optim.learning_rate = 512, 0.0
  console.setup_summary(_two_stage_run(c))
  out = capsys.readouterr().out
  assert f"learning rate {0.1 * 512 / 256:g} (automatic" in out  # Goyal et al.'s rule
  assert "--config.optim.learning_rate" in out
  assert "at each epoch end and at least every 10 min" in out


def test_summary_names_both_of_muons_rates(capsys):
  c = config_lib.get_config()
  c.optim.name, c.optim.learning_rate, c.optim.muon_learning_rate = "muon", 1e-3, 0.04
  console.setup_summary(_two_stage_run(c))
  out = capsys.readouterr().out
  assert "muon at learning rate 0.04 on the matrices, 0.001 (AdamW) on the rest" in out


def test_an_evaluation_before_the_first_train_loss_line_prints_no_nan(capsys):
  result = {"test_loss": 1.5, "test_accuracy": 0.44, "wall_time": 239.0}
  console.epoch_line(98, 390, float("nan"), result)
  console.epoch_line(390, 390, 1.25, result)
  lines = capsys.readouterr().out.splitlines()
  assert lines == ["epoch 0.25: test_loss 1.5000 test_accuracy 0.4400 (239 s)",
                   "epoch 1: train_loss 1.2500 test_loss 1.5000 test_accuracy 0.4400 (239 s)"]


def _train(data_dir, workdir, *extra):
  return [sys.executable, "-m", "petra_jax.train", "--config=configs/cifar10_cpu.py:runlocal",
          "--config.steps_per_epoch=3", "--config.num_epochs=2", *SMALL_EVAL,
          f"--config.data_dir={data_dir}", f"--workdir={workdir}", *extra]


def _wait_for(path, proc):
  """Waits until ``path`` exists (an event the run writes) or the run ends."""
  while not os.path.exists(path) and proc.poll() is None:
    time.sleep(0.05)
  assert os.path.exists(path), proc.communicate()[1][-2000:]


@pytest.mark.slow
def test_sigterm_during_start_up_is_one_line(cifar10_dir, tmp_path):
  proc = subprocess.Popen(_train(cifar10_dir, tmp_path), cwd=REPO, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True)
  _wait_for(tmp_path / "config.json", proc)  # written just before the set-up
  proc.send_signal(signal.SIGTERM)
  _, err = proc.communicate(timeout=300)
  assert proc.returncode == preemption.PREEMPTED_EXIT_CODE, err[-2000:]
  assert "Traceback" not in err
  lines = [line for line in err.splitlines() if "SIGTERM" in line]
  assert len(lines) == 1 and lines[0].startswith("preempted by SIGTERM"), err[-2000:]


# The CLI with orbax's array writer failing with ENOSPC from update 4 on.
DISK_FULL = """
import errno, sys
from absl import app, flags
from petra_jax import train
from petra_jax.training import checkpoint
from petra_jax.training.checkpoint import orbax_local
real, save, full = orbax_local._write, checkpoint.Checkpointer.save, []
async def write(*a, **k):
  if full:
    raise OSError(errno.ENOSPC, "No space left on device")
  return await real(*a, **k)
def saving(self, step, *a, **k):
  full.extend([1] if step >= 4 else [])
  return save(self, step, *a, **k)
orbax_local._write, checkpoint.Checkpointer.save = write, saving
flags.mark_flags_as_required(["config"])
app.run(train.main, flags_parser=train._parse_flags)
"""


@pytest.mark.slow
@pytest.mark.long  # the in-process disk-full test covers the logic; this one the CLI's stderr
def test_cli_disk_full_is_one_line_and_keeps_the_saved_checkpoint(cifar10_dir, tmp_path):
  r = subprocess.run([sys.executable, "-c", DISK_FULL, *_train(cifar10_dir, tmp_path)[3:],
                      "--config.steps_per_epoch=2"], cwd=REPO, capture_output=True, text=True,
                     timeout=600)
  assert r.returncode == 1
  assert r.stderr.strip().splitlines() == [
      f"error: disk full while writing checkpoint {tmp_path}/checkpoints/4; the checkpoints "
      "saved before ([2]) are intact: free space on that disk, then re-run the same command "
      "to resume."]
  step, meta = checkpoint.newest_meta(str(tmp_path / "checkpoints"))
  assert step == 2 and meta["extra"]["run"]["total_steps"] == 4


@pytest.mark.parametrize("epoch_end, saved_ago, due", [
    (True, None, True),     # the first epoch end of a run always saves
    (True, 10.0, False),    # an epoch of seconds (a GPU) is not saved again so soon
    (True, 61.0, True),
    (False, 61.0, False),   # between epoch ends only checkpoint_minutes (10) counts
    (False, 601.0, True),
    (False, None, False)])  # set up 5 s ago, never saved
def test_epoch_end_checkpoints_a_minute_apart(epoch_end, saved_ago, due):
  now = time.time()
  run = types.SimpleNamespace(config=config_lib.get_config(), began=now - 5.0,
                              pipe=types.SimpleNamespace(multiprocess=False))
  progress = types.SimpleNamespace(step=7, last_save=None if saved_ago is None else now - saved_ago)
  assert run.config.checkpoint_minutes == 10.0
  assert loop._auto_checkpoint_due(run, progress, epoch_end) == due
