"""The training CLI end to end on the real CIFAR-10, and its input checks."""

import os
import subprocess
import sys
import types

import jax
import numpy as np
import pytest

import optax

from petra_jax.training import validation
from petra_jax.engine.stages import objective, partition
from petra_jax.training import checkpoint
from petra_jax import models, train
from petra_jax.engine import timing
from petra_jax.training import assembly, console
from petra_jax.training import metrics
from petra_jax.engine.pipeline import Pipeline
from helpers import REPO, SMALL_EVAL, config_file, restored_test_metrics, tiny_config, train_in_process

# Long (CI time): PETRA lowering the loss on the real data, test_examples' custom_linen.py;
# the restored weights' evaluation and the metrics' fields, test_invertible's revnet_fixed run.
@pytest.mark.long
@pytest.mark.slow
def test_petra_run_lowers_loss_and_writes_metrics(cifar10_dir, tmp_path):
  # With delays of up to 18 ticks and no warm-up, a width-4 model needs a
  # small rate (0.01) to learn steadily within 40 steps; it lowers the mean
  # loss by about 0.13 there (measured), against a batch-to-batch noise of
  # the 8-step means of about 0.02.
  # The one tiny run evaluated on the whole test split (eval_examples=0).
  config = tiny_config(cifar10_dir, **{"optim.learning_rate": 0.01, "checkpoint_every": 40,
                                       "eval_examples": 0, "eval_batch_size": 1000})
  result = train.train_and_evaluate(config, str(tmp_path))
  records = metrics.read_metrics(str(tmp_path))
  losses = [r["train_loss"] for r in records if "train_loss" in r]
  assert [r["step"] for r in records if "train_loss" in r] == list(range(1, 41))
  assert all(np.isfinite(losses))
  assert np.mean(losses[-8:]) < np.mean(losses[:8]) - 0.08  # chance level is ln 10 = 2.30
  test = [r for r in records if "test_accuracy" in r]
  assert len(test) == 1 and test[0]["step"] == 40
  assert test[0]["test_accuracy"] == result["test_accuracy"]
  # The final weights and running statistics (the last checkpoint) through
  # the composed model's eval-mode forward, written independently.
  loss, accuracy = restored_test_metrics(config, tmp_path, models.build_model("revnet18", width=4))
  assert result["test_accuracy"] == accuracy
  np.testing.assert_allclose(result["test_loss"], loss, rtol=1e-5)
  assert all({"epoch", "learning_rate"} <= r.keys() for r in records if "train_loss" in r)
  assert os.listdir(tmp_path / "tensorboard")


@pytest.mark.long
@pytest.mark.slow
def test_backprop_and_revprop_give_the_same_per_step_losses(cifar10_dir, tmp_path):
  # The CPU recipe's first 12 steps (inside its warm-up). Gradients agree to
  # ~1e-6 (float32 round-off of the reconstruction and of XLA's fusions; see
  # test_stage); training amplifies that, and at the recipe's rates the
  # losses stay within 1e-4 over 12 steps (2.4e-5 measured), while at a
  # constant rate of 0.01 they drift apart by 1e-3 by step 12.
  losses = {}
  for method in ("backprop", "revprop"):
    c = config_file("configs/cifar10_cpu.py")
    c.data_dir, c.method, c.max_steps, c.log_every, c.eval_every = cifar10_dir, method, 12, 1, 0
    c.eval_batch_size = 1000
    train.train_and_evaluate(c, str(tmp_path / method))
    losses[method] = [r["train_loss"] for r in metrics.read_metrics(str(tmp_path / method))
                      if "train_loss" in r]
  assert len(losses["backprop"]) == 12
  np.testing.assert_allclose(losses["revprop"], losses["backprop"], rtol=1e-4)


@pytest.mark.long
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
    ({"dataset": "mnist"}, "Unknown dataset 'mnist'"),
    ({"optim.name": "rmsprop"}, "Unknown optimizer 'rmsprop'"),
    ({"optim.schedule": "cyclic"}, "Unknown schedule 'cyclic'"),
    ({"model.num_stages": 12}, "only 10 blocks"),
    ({"model.stage_sizes": (4, 4)}, "summing to revnet18's 10 blocks"),
    ({"model.num_stages": 3, "model.balance_by": "ms"}, "Unknown stage-balancing cost 'ms'"),
    ({"platform": "gpu2"}, "Unknown platform 'gpu2'"),
    # Numeric fields out of range: each names its flag and the bound.
    ({"optim.learning_rate": -1.0}, r"optim.learning_rate must be >= 0, got -1.0 .*climbs"),
    ({"num_epochs": 0}, "num_epochs must be >= 1, got 0 .*no training steps"),
    ({"optim.weight_decay": -1e-4}, "optim.weight_decay must be >= 0"),
    ({"optim.momentum": 1.0}, r"optim.momentum must be in \[0, 1\), got 1.0"),
    ({"optim.momentum": -0.5}, r"optim.momentum must be in \[0, 1\)"),
    ({"optim.adam_b2": 1.5}, r"optim.adam_b2 must be in \[0, 1\)"),
    ({"optim.decay_factor": 0.0}, "optim.decay_factor must be > 0"),
    ({"optim.decay_epochs": (-1, 5)}, "optim.decay_epochs=.* negative"),
    ({"optim.warmup_epochs": 2.0}, "optim.warmup_epochs=2 is longer than the run"),
    ({"batch_size": 0}, "batch_size must be >= 1, got 0"),
    ({"eval_batch_size": 0}, "eval_batch_size must be >= 1"),
    ({"eval_examples": -1}, "eval_examples must be >= 0"),
    ({"eval_every": -1}, "eval_every must be >= 0"),
    ({"log_every": 0}, "log_every must be >= 1"),
    ({"steps_per_epoch": -3}, "steps_per_epoch must be >= 0"),
    ({"max_steps": -1}, "max_steps must be >= 0"),
    ({"checkpoint_every": -1}, "checkpoint_every must be >= 0"),
    ({"keep_checkpoints": 0}, "keep_checkpoints must be >= 1"),
    ({"model.width": 0}, "model.width must be >= 1"),
    ({"compensation.lookahead_momentum": 1.0}, "compensation.lookahead_momentum must be in"),
    ({"profile_steps": "5:5"}, "profile_steps must be 'START:STOP'"),
    ({"profile_steps": "100-120"}, "profile_steps must be 'START:STOP'"),
    ({"model.num_stages": 3, "model.stage_sizes": (5, 5)},
     r"model.num_stages=3 disagrees with model.stage_sizes=\(5, 5\)"),
])
def test_bad_config_gives_one_clear_error(overrides, message):
  c = tiny_config("unused", **overrides)
  with pytest.raises(validation.ConfigError, match=message) as error:
    validation.validate_config(c, len(jax.local_devices()))
  assert "\n" not in str(error.value)
  flag = message.split(" ")[0].split("=")[0].replace("\\", "")
  if "_" in flag or "." in flag:  # a field's check names the flag to change
    assert f"--config.{flag}" in str(error.value), str(error.value)


def test_good_edge_values_pass():
  for overrides in ({"optim.learning_rate": 0.0, "optim.momentum": 0.0, "num_epochs": 1,
                     "optim.warmup_epochs": 1.0, "eval_every": 0, "max_steps": 0},
                    {"model.num_stages": 2, "model.stage_sizes": (4, 6)}):
    validation.validate_config(tiny_config("unused", **overrides), len(jax.local_devices()))


def test_num_stages_against_the_cpu_recipes_stage_sizes():
  c = config_file("configs/cifar10_cpu.py")
  c.model.num_stages = 20  # the recipe sets stage_sizes=(1, 2, 2, 5): 4 stages
  with pytest.raises(validation.ConfigError, match="--config.model.stage_sizes='\\(\\)'"):
    validation.validate_config(c, len(jax.local_devices()))
  c.model.num_stages = 4  # agrees
  validation.validate_config(c, len(jax.local_devices()))


def test_runlocal_variant_is_the_cpu_recipe_shrunk():
  full, small = config_file("configs/cifar10_cpu.py"), config_file("configs/cifar10_cpu.py",
                                                                       "runlocal")
  validation.validate_config(small, len(jax.local_devices()))
  assert (small.model.width, small.batch_size, small.num_epochs) == (4, 32, 1)
  assert 0 < small.steps_per_epoch <= 20 and small.log_every == 1
  for same in ("method", "model.stage_sizes", "accumulation_steps", "optim.learning_rate",
               "optim.schedule", "compensation.name"):
    a, b = full, small
    for part in same.split("."):
      a, b = a[part], b[part]
    assert a == b, same
  with pytest.raises(ValueError, match="runlocal"):
    config_file("configs/cifar10_cpu.py", "nope")


def _cli(*args, config="configs/cifar10_cpu.py"):
  return subprocess.run(
      [sys.executable, "-m", "petra_jax.train", f"--config={config}", *args],
      cwd=REPO, capture_output=True, text=True, timeout=300)


def _main(capsys, *args, config="configs/cifar10_cpu.py"):
  """The CLI in this process (no start-up to pay); the real command is run
  by test_default_console_shows_our_lines_only and test_train_signals."""
  return train_in_process(capsys, f"--config={config}", *args)


@pytest.mark.parametrize("flag, message", [
    ("--config.optim.learning_rate=-1", "error: optim.learning_rate must be >= 0, got -1"),
    ("--config.num_epochs=0", "error: num_epochs must be >= 1, got 0"),
    ("--config.model.num_stages=20", "error: model.num_stages=20 disagrees with "
     "model.stage_sizes=(1, 2, 2, 5)"),
])
def test_cli_bad_value_is_one_error_line_naming_the_flag(capsys, tmp_path, flag, message):
  r = _main(capsys, flag, f"--workdir={tmp_path}")
  assert r.returncode == 1, r.stderr[-2000:]
  assert "Traceback" not in r.stderr
  errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
  assert len(errors) == 1 and errors[0].startswith(message), r.stderr[-2000:]
  assert "--config." + flag.split(".", 1)[1].split("=")[0] in errors[0]
  assert not os.path.exists(tmp_path / "metrics.jsonl")  # nothing trained


def test_cli_unknown_config_variant_is_one_line(capsys, tmp_path):
  r = _main(capsys, f"--workdir={tmp_path}", config="configs/cifar10_cpu.py:tiny")
  assert r.returncode != 0
  assert "Traceback" not in r.stderr
  assert "runlocal" in r.stderr.strip().splitlines()[-1]


def test_cli_bad_method_is_one_line_without_traceback(capsys, tmp_path):
  r = _main(capsys, "--config.method=nope", f"--workdir={tmp_path}")
  assert r.returncode != 0
  assert "Traceback" not in r.stderr
  assert "error: Unknown method 'nope'" in r.stderr


def test_cli_missing_data_names_both_fixes(capsys, tmp_path):
  r = _main(capsys, f"--config.data_dir={tmp_path / 'nowhere'}", "--config.download=False",
           f"--workdir={tmp_path}")
  assert r.returncode != 0
  assert "Traceback" not in r.stderr
  assert "--config.data_dir" in r.stderr and "TFDS_DATA_DIR" in r.stderr


def test_cli_unknown_config_field_is_one_line(capsys, tmp_path):
  r = _main(capsys, "--config.modle.width=8", f"--workdir={tmp_path}")
  assert r.returncode != 0
  assert "Traceback" not in r.stderr
  assert "modle" in r.stderr


def _diverged_step(stderr):
  """The step N of the CLI's one-line ``error: train_loss is nan at step N: ...``."""
  import re  # (local: only this test parses the message)
  found = re.search(r"^error: train_loss is (\S+) at step (\d+): training diverged", stderr,
                    re.MULTILINE)
  assert found, stderr[-2000:]
  assert not np.isfinite(float(found.group(1))), found.group(0)
  return int(found.group(2))


@pytest.mark.slow
def test_nan_loss_stops_with_step_and_keeps_last_good_checkpoint(cifar10_dir, tmp_path, capsys):
  # Rate 1e4 without warm-up: the loss is finite on step 1 (computed before
  # any update) and NaN a few steps later, at a step N >= 2 read from the
  # error. A checkpoint every step, the last 2 kept: the good ones
  # are steps 1 .. N-1, and a checkpoint at step >= N holds the micro-batch
  # whose loss is NaN (in flight in the pipeline), so resuming from it would
  # diverge again: none may be left.
  r = _main(capsys, "--config.accumulation_steps=1", "--config.steps_per_epoch=12",
           "--config.checkpoint_every=1", "--config.keep_checkpoints=2",
           "--config.eval_every=0",
           "--config.optim.learning_rate=1e4", "--config.optim.warmup_epochs=0",
           "--config.optim.schedule=constant", f"--config.data_dir={cifar10_dir}",
           f"--workdir={tmp_path}", config="configs/cifar10_cpu.py:runlocal")
  assert r.returncode != 0
  assert "Traceback" not in r.stderr
  bad = _diverged_step(r.stderr)
  assert 2 <= bad <= 12, bad  # diverged mid-run, after a finite first step
  # The log stops before the bad step, every logged loss finite.
  logged = {r_["step"]: r_["train_loss"] for r_ in metrics.read_metrics(str(tmp_path))
            if "train_loss" in r_}
  assert logged and max(logged) < bad, (sorted(logged), bad)
  assert all(np.isfinite(v) for v in logged.values()), logged
  # Checkpoints: at least one kept, every one strictly before the bad step.
  saved = sorted(int(p.name) for p in (tmp_path / "checkpoints").iterdir() if p.name.isdigit())
  assert saved, f"no checkpoint kept (diverged at step {bad})"
  assert max(saved) < bad, f"checkpoints {saved} kept, but the loss is NaN at step {bad}"


# --- stage grouping from the config (model.stage_sizes / num_stages / balance_by)


def _blocks():
  return models.build_model("revnet18", width=4)


def test_stage_sizes_balanced_on_measured_costs(monkeypatch, tmp_path):
  # Fake timings: the stem costs as much as all other blocks together, so
  # the best 2-stage split puts it alone (independent of the FLOPs, which
  # rank the stem among the cheapest blocks).
  costs = [9.0] + [1.0] * 9
  monkeypatch.setattr(timing, "measure_stage_costs", lambda *a, **k: costs)
  c = tiny_config("unused", **{"model.num_stages": 2, "model.balance_by": "time"})
  assert assembly.stage_sizes(c, _blocks(), (2, 16, 16, 3), 10, str(tmp_path)) == [1, 9]
  c.model.balance_by = "flops"
  flops_sizes = assembly.stage_sizes(c, _blocks(), (2, 16, 16, 3), 10, str(tmp_path))
  assert flops_sizes == partition.balanced_stage_sizes(_blocks(), 2, (2, 16, 16, 3))
  assert flops_sizes != [1, 9]
  c.model.stage_sizes = (3, 7)  # explicit sizes win
  assert assembly.stage_sizes(c, _blocks(), (2, 16, 16, 3), 10, str(tmp_path)) == [3, 7]
  c.model.stage_sizes, c.model.num_stages = (), 0  # the paper: one block per stage
  assert assembly.stage_sizes(c, _blocks(), (2, 16, 16, 3), 10, str(tmp_path)) is None


def test_split_cache_decodes_once_under_a_lock_then_reads_the_file(monkeypatch, tmp_path):
  """The test-support split cache: the decoding process holds ``<file>.lock`` (another open
  file cannot take it), a later call reads the file and decodes nothing."""
  import fcntl  # noqa: PLC0415  (the hook's POSIX lock)
  images, labels = np.arange(24, dtype=np.uint8).reshape(2, 2, 2, 3), np.array([3, 7], np.int32)
  calls = []

  def fake_open(dataset, split, data_dir, limit=None, download=False):
    del dataset, split, data_dir, limit, download
    (lock,) = tmp_path.glob("*.lock")
    with open(lock, "w") as f, pytest.raises(BlockingIOError):
      fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    calls.append(1)
    return types.SimpleNamespace(images=images, labels=labels)

  monkeypatch.setenv(assembly.TEST_SPLIT_CACHE, str(tmp_path))
  monkeypatch.setattr(assembly, "_OPEN_SPLIT", fake_open)
  for _ in range(2):
    split = assembly._open_split_test_cached(fake_open, "cifar10", "train", "/d", limit=1)  # pylint: disable=protected-access
    np.testing.assert_array_equal(split.images, images[:1])
    np.testing.assert_array_equal(split.labels, labels[:1])
  assert len(calls) == 1


def test_time_balanced_run_resumes_with_its_saved_grouping(monkeypatch, tmp_path):
  # A resumed run must not re-measure (timings vary): it reads the grouping
  # from its checkpoint's fingerprint.
  blocks = _blocks()
  stages = partition.group_stages(blocks, [4, 6])
  pipe = Pipeline(stages, optax.sgd(0.1), jax.devices()[:1])
  ckpt = checkpoint.Checkpointer(str(tmp_path), keep=1, fingerprint={"stage_sizes": [4, 6]})
  ckpt.save(1, pipe.init(0, np.zeros((2, 16, 16, 3), np.float32)), extra={})
  ckpt.wait()
  ckpt.close()

  def no_timing(*a, **k):
    raise AssertionError("re-measured on resume")
  monkeypatch.setattr(timing, "measure_stage_costs", no_timing)
  c = tiny_config("unused", **{"model.num_stages": 2, "model.balance_by": "time"})
  assert assembly.stage_sizes(c, blocks, (2, 16, 16, 3), 10, str(tmp_path)) == [4, 6]


# --- the console: our lines only at the default verbosity


# Lines of other libraries' INFO logging that a default run must not show.
LIBRARY_INFO = ("CheckpointManager", "_NonBlockingMetadataStore", "differ on disk",
                "Unable to initialize backend", "Load dataset info")


@pytest.mark.slow
def test_default_console_shows_our_lines_only(cifar10_dir, tmp_path):
  r = _cli("--config.max_steps=2", "--config.checkpoint_every=2", *SMALL_EVAL,
           f"--config.data_dir={cifar10_dir}", f"--workdir={tmp_path}",
           config="configs/cifar10_cpu.py:runlocal")
  assert r.returncode == 0, r.stderr[-2000:]
  both = r.stdout + r.stderr
  for text in LIBRARY_INFO:
    assert text not in both, text
  assert not [line for line in both.splitlines() if line[:1] == "I" and line[1:5].isdigit()]
  assert "petra revnet18 (width 4) on cifar10: 4 stages of [1, 2, 2, 5] blocks" in r.stdout
  assert "2 updates of 32 images (2 micro-batches each), 10 per epoch" in r.stdout
  assert "epoch 0.20: train_loss " in r.stdout  # 2 of the epoch's 10 updates
  assert f"metrics: {tmp_path / 'metrics.jsonl'}" in r.stdout
  assert f"checkpoints: {tmp_path / 'checkpoints'}" in r.stdout


def test_platform_mismatch_names_the_install():
  line = console.platform_mismatch("gpu", "", "cpu")
  assert line.startswith("warning: config.platform='gpu' but JAX runs on the CPU")
  assert "pip install -e '.[cuda12]'" in line
  assert "pip install -e '.[tpu]'" in console.platform_mismatch("tpu", "", "cpu")
  assert "JAX_PLATFORMS='cuda'" in console.platform_mismatch("", "cuda,cpu", "cpu")
  assert "\n" not in line
  for wanted, env, backend in (("gpu", "", "gpu"), ("", "", "cpu"), ("cpu", "", "cpu"),
                               ("", "cpu", "cpu"), ("tpu", "", "tpu")):
    assert console.platform_mismatch(wanted, env, backend) is None


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="needs a CPU-only JAX")
def test_cli_says_when_the_configured_gpu_is_not_used(capsys, tmp_path):
  # (num_epochs=0 then stops the run before any data is read.)
  r = _main(capsys, "--config.platform=gpu", "--config.num_epochs=0", f"--workdir={tmp_path}")
  lines = r.stderr.splitlines()
  warnings = [line for line in lines if "but JAX runs on the CPU" in line]
  assert len(warnings) == 1 and "pip install -e '.[cuda12]'" in warnings[0], r.stderr[-2000:]


def test_cli_platform_that_cannot_start_is_one_line(tmp_path):
  env = dict(os.environ, JAX_PLATFORMS="tpu")
  r = subprocess.run([sys.executable, "-m", "petra_jax.train",
                      "--config=configs/cifar10_cpu.py", f"--workdir={tmp_path}"],
                     cwd=REPO, capture_output=True, text=True, timeout=300, env=env)
  assert r.returncode == 1 and "Traceback" not in r.stderr
  errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
  assert len(errors) == 1 and "pip install -e '.[tpu]'" in errors[0], r.stderr[-2000:]


# --- evaluation on the device


def test_eval_sums_match_numpy_log_softmax():
  rng = np.random.default_rng(0)
  logits = rng.normal(0, 3, (8, 10)).astype(np.float32)
  logits[2, [3, 7]] = 50.0  # a tie: the first maximum counts
  labels = rng.integers(0, 10, 8).astype(np.int32)
  labels[2] = 3
  valid = 6
  loss_sum, correct = objective.eval_sums(logits, labels, np.int32(valid))
  x = logits[:valid].astype(np.float64)
  logp = x - x.max(1, keepdims=True)
  logp -= np.log(np.exp(logp).sum(1, keepdims=True))
  want_loss = -logp[np.arange(valid), labels[:valid]].sum()
  want_correct = sum(int(np.argmax(x[i]) == labels[i]) for i in range(valid))
  np.testing.assert_allclose(float(loss_sum), want_loss, rtol=1e-6)
  assert int(correct) == want_correct and want_correct >= 1
