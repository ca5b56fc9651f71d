"""The training CLI end to end on the real CIFAR-10, and its input checks."""

import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from petra_jax import config as config_lib
from petra_jax import metrics, train

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def tiny_config(data_dir, **overrides):
  c = config_lib.get_config()
  c.data_dir = data_dir
  c.model.width = 4
  c.batch_size = 32
  c.accumulation_steps = 1
  c.num_epochs = 1
  c.steps_per_epoch = 40
  c.log_every = 1
  c.num_devices = 1
  c.eval_batch_size = 1000
  c.optim.learning_rate = 0.05
  c.optim.schedule = "constant"
  c.optim.warmup_epochs = 0
  for k, v in overrides.items():
    target = c
    *path, last = k.split(".")
    for p in path:
      target = target[p]
    target[last] = v
  return c


@pytest.mark.slow
def test_petra_run_lowers_loss_and_writes_metrics(cifar10_dir, tmp_path):
  result = train.train_and_evaluate(tiny_config(cifar10_dir), str(tmp_path))
  records = metrics.read_metrics(str(tmp_path))
  losses = [r["train_loss"] for r in records if "train_loss" in r]
  assert [r["step"] for r in records if "train_loss" in r] == list(range(1, 41))
  assert all(np.isfinite(losses))
  assert np.mean(losses[-8:]) < np.mean(losses[:8]) - 0.1  # chance level is ln 10 = 2.30
  test = [r for r in records if "test_accuracy" in r]
  assert len(test) == 1 and test[0]["step"] == 40
  assert test[0]["test_accuracy"] == result["test_accuracy"] > 0.15  # above chance (0.10)
  assert all({"epoch", "learning_rate"} <= r.keys() for r in records if "train_loss" in r)
  assert os.listdir(tmp_path / "tensorboard")


@pytest.mark.slow
def test_backprop_and_revprop_give_the_same_per_step_losses(cifar10_dir, tmp_path):
  # A small learning rate keeps the training dynamics from amplifying the
  # reconstruction's float32 round-off (~1e-7) beyond 1e-4 in 12 steps.
  losses = {}
  for method in ("backprop", "revprop"):
    c = tiny_config(cifar10_dir, method=method, max_steps=12, **{"optim.learning_rate": 0.01})
    train.train_and_evaluate(c, str(tmp_path / method))
    losses[method] = [r["train_loss"] for r in metrics.read_metrics(str(tmp_path / method))
                      if "train_loss" in r]
  assert len(losses["backprop"]) == 12
  np.testing.assert_allclose(losses["revprop"], losses["backprop"], rtol=1e-4)


@pytest.mark.slow
def test_petra_per_step_losses_do_not_depend_on_device_count(cifar10_dir, tmp_path):
  losses = {}
  for n in (1, 4):
    c = tiny_config(cifar10_dir, num_devices=n, max_steps=15)
    train.train_and_evaluate(c, str(tmp_path / str(n)))
    losses[n] = [r["train_loss"] for r in metrics.read_metrics(str(tmp_path / str(n)))
                 if "train_loss" in r]
  assert len(losses[1]) == 15
  assert losses[1] == losses[4]


@pytest.mark.parametrize("overrides, message", [
    ({"method": "sgd"}, "Unknown method 'sgd'"),
    ({"model.name": "vgg"}, "Unknown model 'vgg'"),
    ({"model.name": "resnet18"}, "needs a reversible model"),
    ({"accumulation_steps": 0}, "accumulation_steps must be >= 1"),
    ({"batch_size": 30, "accumulation_steps": 4}, "multiple of 4"),
    ({"num_devices": 99}, "num_devices=99"),
])
def test_bad_config_gives_one_clear_error(overrides, message):
  c = tiny_config("unused", **overrides)
  with pytest.raises(train.ConfigError, match=message):
    train.validate_config(c, len(jax.local_devices()))


def _cli(*args):
  return subprocess.run(
      [sys.executable, "-m", "petra_jax.train", "--config=configs/cifar10_cpu.py", *args],
      cwd=REPO, capture_output=True, text=True, timeout=300)


def test_cli_bad_method_is_one_line_without_traceback(tmp_path):
  r = _cli("--config.method=nope", f"--workdir={tmp_path}")
  assert r.returncode != 0
  assert "Traceback" not in r.stderr
  assert "error: Unknown method 'nope'" in r.stderr


def test_cli_missing_data_names_both_fixes(tmp_path):
  r = _cli(f"--config.data_dir={tmp_path / 'nowhere'}", f"--workdir={tmp_path}")
  assert r.returncode != 0
  assert "Traceback" not in r.stderr
  assert "--config.data_dir" in r.stderr and "TFDS_DATA_DIR" in r.stderr
