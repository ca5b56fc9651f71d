"""``local`` and ``forward_gradient`` (both guesses) through ``python -m
petra_jax.train``: a run stopped cleanly at ``max_steps`` with its checkpoint,
re-run for the whole epoch, logs every step once with the losses ``==`` those
of one uninterrupted run."""

import subprocess
import sys

import pytest

from helpers import REPO, train_losses

STEPS = 6


def _train(data_dir, workdir, method, guess, *extra):
  fg = [f"--config.forward_gradient.guess={guess}"] if method == "forward_gradient" else []
  r = subprocess.run(
      [sys.executable, "-m", "petra_jax.train", "--config=configs/cifar10_cpu.py:runlocal",
       f"--config.method={method}", *fg, f"--config.steps_per_epoch={STEPS}",
       "--config.checkpoint_every=2", "--config.eval_every=0", f"--config.data_dir={data_dir}",
       f"--workdir={workdir}", *extra],
      cwd=REPO, capture_output=True, text=True, timeout=300)
  assert r.returncode == 0, r.stderr[-3000:]
  return r.stdout


@pytest.mark.slow
@pytest.mark.parametrize("method, guess", [("local", "local"), ("forward_gradient", "local"),
                                           ("forward_gradient", "random")])
def test_stop_at_max_steps_then_resume_gives_the_uninterrupted_losses(cifar10_dir, tmp_path,
                                                                      method, guess):
  _train(cifar10_dir, tmp_path / "full", method, guess)
  _train(cifar10_dir, tmp_path / "run", method, guess, "--config.max_steps=3")
  assert sorted(train_losses(tmp_path / "run")) == [1, 2, 3]
  out = _train(cifar10_dir, tmp_path / "run", method, guess)
  assert "resumed at update 3" in out, out[-2000:]
  lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
  steps = [line for line in lines if '"train_loss"' in line]
  assert len(steps) == STEPS  # each step logged once
  full = train_losses(tmp_path / "full")
  assert sorted(full) == list(range(1, STEPS + 1))
  assert train_losses(tmp_path / "run") == full
