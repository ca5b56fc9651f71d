"""Multi-process checkpoints (launch/local.sh 2 + petra_jax.train, tiny RevNet18).

Against one uninterrupted single-process run of the same config (the losses
of 1 and 2 processes are bit-identical, tests/test_multiprocess.py):

* process 1 killed (SIGKILL) once a checkpoint exists, the launcher restarts
  the job (``LOCAL_RESTARTS=1``), which resumes: the same per-step losses;
* SIGTERM to the launcher: every process checkpoints the same step, one
  ``preempted`` line, exit 75; re-running resumes with the same losses;
* the single-process run's last (drained) checkpoint of 4 stages resumes in
  2 processes with 2 stages and trains on, with the losses of the same
  resharded resume in one process.

Select them with ``-k multiprocess``; the SIGTERM one is in the default run.
"""

import os
import pathlib
import shutil
import signal
import subprocess
import sys
import uuid

import pytest

from helpers import REPO, SMALL_EVAL, train_losses, wait_for, without_virtual_devices

LAUNCH = os.path.join(REPO, "launch", "local.sh")
TIMEOUT_S = 300
STEPS = 8


def _args(data_dir, workdir, *extra):
  # A 4-block RevNet of width 4 (stem, 2 reversible blocks, head), one block per stage
  # (few programs to compile: about half the time of RevNet18's 10 stages).
  return ["--config=configs/cifar10_cpu.py", "--config.model.name=revnet_fixed",
          "--config.model.depth=2", "--config.model.width=4",
          "--config.model.stage_sizes=()", "--config.batch_size=16",
          "--config.accumulation_steps=2", f"--config.steps_per_epoch={STEPS}",
          "--config.num_epochs=1", "--config.log_every=1", "--config.checkpoint_every=2",
          "--config.eval_every=0", *SMALL_EVAL,
          "--config.distributed.preemption_check_every=1",  # a stop at the next update
          f"--config.data_dir={data_dir}", f"--workdir={workdir}", *extra]


@pytest.fixture(scope="module")
def env(tmp_path_factory):
  # conftest's compile options, not its 4 virtual devices (launch/local.sh sets them)
  e = without_virtual_devices(os.environ)
  for k in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID", "PETRA_MODULE"):
    e.pop(k, None)
  e.update(PYTHON=sys.executable, JAX_PLATFORMS="cpu", LOCAL_GRACE_S="30")
  return e


def _start(cmd, env, log: pathlib.Path):
  """Starts ``cmd`` in its own session, output to ``log`` (a pipe could fill)."""
  return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log.open("w"),
                          stderr=subprocess.STDOUT, start_new_session=True)


def _finish(proc, log: pathlib.Path):
  """``(returncode, output)``; kills the session on timeout."""
  try:
    proc.wait(timeout=TIMEOUT_S)
  except subprocess.TimeoutExpired:
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    pytest.fail(f"did not finish in {TIMEOUT_S} s:\n{log.read_text()[-3000:]}")
  return proc.returncode, log.read_text()


def _run(cmd, env, log):
  return _finish(_start(cmd, env, log), log)


def _pid_of_process(tag: str, process: int) -> int:
  """The pid of the training process ``process`` of the job tagged ``tag``."""
  for d in pathlib.Path("/proc").iterdir():
    try:
      environ = (d / "environ").read_bytes().split(b"\0")
    except (OSError, ValueError):
      continue
    if (f"PETRA_TEST_TAG={tag}".encode() in environ
        and f"JAX_PROCESS_ID={process}".encode() in environ
        and b"petra_jax.train" in (d / "cmdline").read_bytes()):
      return int(d.name)
  raise AssertionError(f"process {process} of job {tag} not found")


@pytest.fixture(scope="module")
def reference(env, cifar10_dir, tmp_path_factory):
  """One uninterrupted single-process run: its workdir."""
  wd = tmp_path_factory.mktemp("reference")
  rc, out = _run([sys.executable, "-m", "petra_jax.train", *_args(cifar10_dir, wd)], env,
                 wd.parent / "reference.log")
  assert rc == 0, out[-3000:]
  assert sorted(train_losses(wd)) == list(range(1, STEPS + 1))
  return wd


@pytest.mark.long  # two minutes with its reference run; -m long runs the module
def test_multiprocess_sigkill_restart_resumes_with_the_same_losses(env, cifar10_dir, reference,
                                                                   tmp_path):
  tag = uuid.uuid4().hex
  wd, log = tmp_path / "w", tmp_path / "log"
  proc = _start([LAUNCH, "2", *_args(cifar10_dir, wd)],
                dict(env, LOCAL_RESTARTS="1", PETRA_TEST_TAG=tag), log)
  wait_for(lambda: all((d / "2").exists() for d in (wd / "checkpoints",
                                                       wd / "checkpoints" / "process_1")),
           proc, "checkpoint 2 (both processes)", TIMEOUT_S)
  os.kill(_pid_of_process(tag, 1), signal.SIGKILL)
  rc, out = _finish(proc, log)
  assert rc == 0, out[-3000:]
  assert "launch/local.sh: process 1 was killed by signal 9" in out, out[-3000:]
  assert "launch/local.sh: restarting the job (1 of 1)" in out, out[-3000:]
  assert "resumed from" in out and "checkpoints/2" in out, out[-3000:]
  assert train_losses(wd) == train_losses(reference)


def test_multiprocess_sigterm_checkpoints_every_process_and_resumes(env, cifar10_dir,
                                                                    reference, tmp_path):
  wd, log = tmp_path / "w", tmp_path / "log"
  cmd = [LAUNCH, "2", *_args(cifar10_dir, wd)]
  proc = _start(cmd, env, log)
  # (step 1's line is written J - 1 ticks after its last micro-batch, at the
  # next log flush: by then the run is several updates on, of 8)
  wait_for(lambda: train_losses(wd), proc, "step 1 logged", TIMEOUT_S)
  proc.send_signal(signal.SIGTERM)  # the launcher passes it on
  rc, out = _finish(proc, log)
  assert rc == 75, out[-3000:]
  lines = [l for l in out.splitlines() if "preempted by SIGTERM at step" in l]
  assert len(lines) == 1 and lines[0].startswith("[process 0] "), out[-3000:]
  step = int(lines[0].split(" at step ")[1].split(":")[0])
  assert 1 <= step < STEPS
  for d in (wd / "checkpoints", wd / "checkpoints" / "process_1"):
    assert max(int(p.name) for p in d.iterdir() if p.name.isdigit()) == step
  assert "launch/local.sh: preempted (exit 75)" in out, out[-3000:]
  assert "Traceback" not in out
  rc, out = _run(cmd, env, tmp_path / "log2")
  assert rc == 0, out[-3000:]
  assert train_losses(wd) == train_losses(reference)


@pytest.mark.long
def test_multiprocess_resumes_a_drained_checkpoint_with_two_stages(env, cifar10_dir, reference,
                                                                    tmp_path):
  # The reference's last checkpoint (step 8, 4 stages, drained) trains on
  # for a second epoch with 2 stages: in 2 processes as in one.
  more = ["--config.model.num_stages=2", "--config.num_epochs=2"]
  one, two = tmp_path / "one", tmp_path / "two"
  for wd in (one, two):
    shutil.copytree(reference, wd)
  rc, out = _run([sys.executable, "-m", "petra_jax.train", *_args(cifar10_dir, one, *more)],
                 env, tmp_path / "log1")
  assert rc == 0, out[-3000:]
  rc, out = _run([LAUNCH, "2", *_args(cifar10_dir, two, *more)], env, tmp_path / "log2")
  assert rc == 0, out[-3000:]
  assert "resharding checkpoint 8: stages of [1, 1, 1, 1] blocks" in out
  losses = train_losses(two)
  assert sorted(losses) == list(range(1, 2 * STEPS + 1))
  assert {s: losses[s] for s in range(1, STEPS + 1)} == train_losses(reference)
  assert losses == train_losses(one)
