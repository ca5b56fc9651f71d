"""``local`` and ``forward_gradient`` (both guesses) through ``python -m
petra_jax.train``: a run stopped cleanly (SIGTERM once step 1 is logged, a
checkpoint at the stop) and re-run logs every step once with the losses
``==`` those of one uninterrupted run (the same CLI arguments run in this
process: the same code without a start-up)."""

import signal
import subprocess
import sys

import pytest

from helpers import REPO, SMALL_EVAL, Paused, train_in_process, train_losses
from petra_jax.training import preemption

STEPS = 10  # the stop lands a few updates after step 1 is logged


def _cmd(data_dir, workdir, method, guess):
  fg = [f"--config.forward_gradient.guess={guess}"] if method == "forward_gradient" else []
  return [sys.executable, "-m", "petra_jax.train", "--config=configs/cifar10_cpu.py:runlocal",
          f"--config.method={method}", *fg, f"--config.steps_per_epoch={STEPS}",
          "--config.eval_every=0", *SMALL_EVAL, f"--config.data_dir={data_dir}",
          f"--workdir={workdir}"]


def _run(cmd):
  r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
  assert r.returncode == 0, r.stderr[-3000:]
  return r.stdout


@pytest.mark.slow
@pytest.mark.parametrize("method, guess", [
    # forward_gradient's local guesses: the local method's auxiliary heads, and its own in-flight
    # messages; every row long (CI time: tests/test_checkpoint.py restores forward_gradient's
    # pipeline mid-flight bit-exactly in the default set, the CLI's stop and resume of PETRA
    # are tests/test_train_signals.py's)
    pytest.param("local", "local", marks=pytest.mark.long),
    pytest.param("forward_gradient", "local", marks=pytest.mark.long),
    pytest.param("forward_gradient", "random", marks=pytest.mark.long)])  # same path as "local"
def test_clean_stop_and_resume_give_the_uninterrupted_losses(cifar10_dir, tmp_path, capsys,
                                                             method, guess):
  full = tmp_path / "full"
  r = train_in_process(capsys, *_cmd(cifar10_dir, full, method, guess)[3:])
  assert r.returncode == 0, r.stderr[-3000:]
  assert sorted(train_losses(full)) == list(range(1, STEPS + 1))

  wd = tmp_path / "run"
  cmd = _cmd(cifar10_dir, wd, method, guess)
  run = Paused(cmd[3:], 1)  # signalled once step 1 is logged
  try:
    rc, err = run.signal_and_go_on(signal.SIGTERM)
  finally:
    run.kill()
  assert rc == preemption.PREEMPTED_EXIT_CODE, err
  stopped = max(train_losses(wd))
  assert stopped < STEPS
  out = _run(cmd)
  assert "resumed at update" in out, out[-2000:]
  lines = (wd / "metrics.jsonl").read_text().splitlines()
  assert sum('"train_loss"' in line for line in lines) == STEPS  # each step once
  assert train_losses(wd) == train_losses(full)
