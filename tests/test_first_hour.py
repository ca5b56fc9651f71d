"""A new user's first hour (issue 39): each rough edge, reproduced by its command.

The CLIs run in-process (``train.main`` after ``train._parse_flags``, as absl's
``app.run`` does), their output read with capsys.
"""

import functools
import json
import os
import sys

from absl import flags
from flax import nnx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import petra_jax
from petra_jax import train
from helpers import REPO, SMALL_EVAL


def _listing(path):
  """Every file under ``path`` with its bytes (None: ``path`` is missing)."""
  if not os.path.exists(path):
    return None
  out = {}
  for root, _, files in os.walk(path):
    for name in files:
      full = os.path.join(root, name)
      with open(full, "rb") as f:
        out[os.path.relpath(full, path)] = f.read()
  return out


def _forget_overrides():
  """Unparses the flags and drops the ``--config.*`` ones a parse defined."""
  flags.FLAGS.unparse_flags()
  for name in [n for n in flags.FLAGS if n.startswith("config.")]:
    delattr(flags.FLAGS, name)


def cli(*args) -> int:
  """``python -m petra_jax.train ARGS`` in this process; its exit status."""
  _forget_overrides()
  saved, sys.argv = sys.argv, ["petra_jax.train", *args]  # (config_flags reads sys.argv)
  try:
    argv = train._parse_flags(list(sys.argv))  # pylint: disable=protected-access
    train.main(argv)
  except SystemExit as e:
    if isinstance(e.code, str):  # (the interpreter prints it)
      print(e.code, file=sys.stderr)
    return e.code if isinstance(e.code, int) else 1 if e.code else 0
  finally:
    sys.argv = saved
    _forget_overrides()
  return 0


CPU = os.path.join(REPO, "configs", "cifar10_cpu.py")


# 1. A refused run never touches the workdir: config.json, lock and all.

def test_refused_config_leaves_a_missing_workdir_missing(tmp_path, capsys):
  workdir = tmp_path / "new" / "run"
  assert cli(f"--config={CPU}", f"--workdir={workdir}", "--config.batch_size=-1") == 1
  assert "batch_size must be >= 1" in capsys.readouterr().err
  assert not (tmp_path / "new").exists()


def test_refused_config_leaves_another_runs_record_alone(tmp_path, capsys):
  (tmp_path / "config.json").write_text('{"method": "petra"}\n')
  before = _listing(tmp_path)
  assert cli(f"--config={CPU}", f"--workdir={tmp_path}", "--config.method=nope") == 1
  assert "Unknown method 'nope'" in capsys.readouterr().err
  assert _listing(tmp_path) == before  # no lock file, no config.json over the old one


@pytest.mark.slow
def test_refused_resume_keeps_the_runs_config_json(cifar10_dir, tmp_path, capsys):
  # Also item 10: the logs of a run whose output is not a terminal (capsys).
  run = [f"--config={CPU}:runlocal", f"--workdir={tmp_path}", f"--config.data_dir={cifar10_dir}",
         "--config.max_steps=2", *SMALL_EVAL]
  assert cli(*run, "--config.progress_seconds=1e-9") == 0
  out = capsys.readouterr().out.splitlines()
  assert f"data: cifar10 read from {os.path.abspath(cifar10_dir)}" in out
  # runlocal: 10 updates per epoch; the rate counts updates known to have run (line 1 read
  # once line 2 is complete), so the first line comes after update 2's dispatch.
  assert "step 2/2 (0.20 epochs): " in "\n".join(out)
  assert any(line.startswith("epoch 0.20: train_loss") for line in out)  # not "epoch 1"
  before = _listing(tmp_path)
  # Not finished at 3 steps: the set-up restores, and refuses the PETRA checkpoint.
  assert cli(*run, "--config.max_steps=3", "--config.method=backprop") == 1
  assert "comes from a different run" in capsys.readouterr().err
  assert _listing(tmp_path) == before
  # The saved config still resumes the original run (finished: one line, exit 0).
  assert cli(f"--config={tmp_path}/config.json", f"--workdir={tmp_path}") == 0
  assert "already finished" in capsys.readouterr().out


# 4. Config errors in plain text; --help lists the config.

def test_help_exits_0_and_lists_every_config_field_with_default(capsys):
  from petra_jax import config as config_lib
  assert cli("--help") == 0
  out = capsys.readouterr().out
  for field in ("batch_size=128", "model.stage_sizes='()'", "optim.name=sgd", "method=petra",
                "progress_seconds=60.0"):
    assert f"--config.{field}: " in out
  listed = {line.split("=")[0].strip()[len("--config."):] for line in out.splitlines()
            if line.strip().startswith("--config.")}
  assert listed == set(config_lib.fields(config_lib.get_config()))


@pytest.mark.parametrize("override, says", [
    ("--config.max_step=3", "no field 'max_step'; Did you mean \"max_steps\""),
    ("--config.batch_size=abc", "--config.batch_size=abc is not an integer (batch_size: images"),
    ("--config.model=3", "--config.model is a group of fields"),
    ("--config.model.stage_sizes=(1,2", "is not a tuple in quotes, e.g. '(1,2,3)' or '()'"),
    ("--config.checkpoint_drain=maybe", "is not True or False"),
])
def test_bad_override_is_one_plain_line(override, says, tmp_path, capsys):
  assert cli(f"--config={CPU}", f"--workdir={tmp_path}/w", override) == 1
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and says in err and "\\" not in err and "--helpfull" not in err
  assert "python -m petra_jax.train --help" in err
  assert not (tmp_path / "w").exists()


# 3. check_stages calls each stage as training does.

class _Stem(nn.Module):
  @nn.compact
  def __call__(self, x, train: bool = True):
    return tuple(jnp.split(nn.Conv(8, (3, 3))(x), 2, axis=-1))


class _FWithoutTrain(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.relu(nn.Conv(4, (3, 3))(x))


class _Head(nn.Module):
  @nn.compact
  def __call__(self, x, train: bool = True):
    return nn.Dense(10)(jnp.concatenate(x, -1).mean((1, 2)))


def without_train(num_classes=10, width=4):
  """A user model whose reversible ``F`` takes no ``train`` keyword."""
  del num_classes, width
  return [petra_jax.Stage("stem", _Stem(), False), petra_jax.Stage("rev0", _FWithoutTrain(), True),
          petra_jax.Stage("head", _Head(), False)]


def test_check_stages_names_a_stage_without_train_keyword():
  with pytest.raises(ValueError, match=r"stage 'rev0' fails .*unexpected keyword argument "
                                       r"'train'.*give its __call__ a `train: bool = True`"):
    petra_jax.check_stages(without_train(), jnp.zeros((2, 8, 8, 3)))


def test_cli_user_model_without_train_keyword_is_one_line(tmp_path, capsys):
  assert cli(f"--config={CPU}", f"--workdir={tmp_path}/w", "--config.model.stage_sizes=()",
             "--config.model.name=test_first_hour:without_train") == 1
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and "error: stage 'rev0' fails" in err
  assert not (tmp_path / "w").exists()


# 5. update_nnx through the public path: the Stage's module.

class _NNXStem(nnx.Module):
  def __init__(self, rngs):
    self.conv = nnx.Conv(3, 4, (3, 3), rngs=rngs)
    self.bn = nnx.BatchNorm(4, momentum=0.9, rngs=rngs)

  def __call__(self, x, train: bool = True):
    return tuple(jnp.split(nnx.relu(self.bn(self.conv(x), use_running_average=not train)), 2, -1))


class _NNXF(nnx.Module):
  def __init__(self, rngs):
    self.conv = nnx.Conv(2, 2, (3, 3), rngs=rngs)
    self.bn = nnx.BatchNorm(2, momentum=0.9, rngs=rngs)

  def __call__(self, x):  # train()/eval() set the mode
    return nnx.relu(self.bn(self.conv(x)))


class _NNXHead(nnx.Module):
  def __init__(self, rngs):
    self.dense = nnx.Linear(4, 10, rngs=rngs)

  def __call__(self, x, train: bool = True):
    return self.dense(jnp.concatenate(x, -1).mean((1, 2)))


def _nnx_forward(modules, reversible, x):
  """The composed model in plain NNX, eval mode: the coupling ``(x2 + F(x1), x1)``."""
  for m, rev in zip(modules, reversible):
    m.eval()
    call = m if isinstance(m, _NNXF) else functools.partial(m, train=False)
    x = (x[1] + call(x[0]), x[0]) if rev else call(x)
  return x


@pytest.mark.parametrize("grouped", [False, True])
def test_update_nnx_writes_a_trained_stage_back_into_the_users_module(grouped):
  rngs = nnx.Rngs(0)
  modules = [_NNXStem(rngs), _NNXF(rngs), _NNXF(rngs), _NNXHead(rngs)]
  reversible = [False, True, True, False]
  stages = [petra_jax.Stage(f"s{j}", m, r) for j, (m, r) in enumerate(zip(modules, reversible))]
  if grouped:
    stages = petra_jax.group_stages(stages, [1, 2, 1])
  pipe = petra_jax.Pipeline(stages, optax.sgd(0.1, momentum=0.9), jax.devices()[:1],
                            accumulation_steps=2)
  rng = np.random.default_rng(0)
  images = jnp.asarray(rng.normal(size=(4, 8, 8, 3)), jnp.float32)
  labels = jnp.asarray(rng.integers(0, 10, 4), jnp.int32)
  state = pipe.init(0, images)
  for tick in pipe.schedule(4):
    state, _ = pipe.run_tick(state, tick, lambda m: (images, labels))
  logits = pipe.predict(state, images)
  before = _nnx_forward(modules, reversible, images)
  assert float(jnp.abs(before - logits).max()) > 1e-3  # the modules still hold the initial weights
  for stage, v in zip(stages, petra_jax.trained_variables(state)):
    petra_jax.update_nnx(stage.module if not grouped else stage, v)
  np.testing.assert_allclose(_nnx_forward(modules, reversible, images), logits, atol=1e-5)


def test_update_nnx_on_a_linen_stage_is_one_line():
  with pytest.raises(ValueError, match="update_nnx writes into an NNX module"):
    petra_jax.update_nnx(without_train()[0].module, {"params": {}})


# 2. What a user's loop feeds the pipeline, checked against the model's input.

def _tiny_pipe(k=1):
  rngs = nnx.Rngs(0)
  stages = [petra_jax.Stage("stem", _NNXStem(rngs), False), petra_jax.Stage("rev", _NNXF(rngs), True),
            petra_jax.Stage("head", _NNXHead(rngs), False)]
  pipe = petra_jax.Pipeline(stages, optax.sgd(0.1), jax.devices()[:1], accumulation_steps=k)
  rng = np.random.default_rng(0)
  images = rng.normal(size=(4, 8, 8, 3)).astype(np.float32)
  labels = rng.integers(0, 10, 4).astype(np.int32)
  return pipe, pipe.init(0, images), images, labels


@pytest.mark.parametrize("feed, says", [
    (lambda x, y: (x.transpose(0, 3, 1, 2), y),
     r"batches\(0\): images of shape \[4, 3, 8, 8\], but the model takes float \[B, 8, 8, 3\] "
     r".*channels-first \(NCHW\): pass images.transpose\(0, 2, 3, 1\)"),
    (lambda x, y: ((x * 50 + 128).clip(0, 255).astype(np.uint8), y),
     r"images are uint8; the model takes floating, normalised images"),
    (lambda x, y: (x, np.eye(10, dtype=np.float32)[y]),
     r"labels of shape \[4, 10\] look one-hot; pass int32 class indices \[B\]: labels.argmax"),
    (lambda x, y: (x, y.astype(np.float32)), r"labels are float32; pass int32"),
    (lambda x, y: (x, y[:3]), r"labels of shape \[3\], but the model takes int32 class indices "
                              r"\[B\] = \[4\]"),
])
def test_run_tick_refuses_a_batch_unlike_the_models_input(feed, says):
  pipe, state, images, labels = _tiny_pipe()
  tick = pipe.schedule(1)[0]
  with pytest.raises(ValueError, match=says):
    pipe.run_tick(state, tick, lambda m: feed(images, labels))


@pytest.mark.parametrize("bad, says", [
    (lambda x, y: (x, y[:3]), r"batches\(3\): labels of shape \[3\]"),
    (lambda x, y: ((x * 50 + 128).clip(0, 255).astype(np.uint8), y),
     r"batches\(3\): images are uint8"),
])
def test_a_bad_micro_batch_after_good_ones_is_refused(bad, says):
  """The checks remember the shapes and dtypes they accepted, not the micro-batches: a later
  micro-batch unlike the accepted ones is still refused."""
  from petra_jax.engine.stages import input_checks
  pipe, _, images, labels = _tiny_pipe()
  checked = input_checks.checked(
      lambda m: (images, labels) if m < 3 else bad(images, labels), pipe.input_spec)
  for m in range(3):
    checked(m)
  with pytest.raises(ValueError, match=says):
    checked(3)


def test_predict_and_init_refuse_nchw_and_uint8():
  pipe, state, images, _ = _tiny_pipe()
  with pytest.raises(ValueError, match=r"predict: images of shape \[4, 3, 8, 8\].*NCHW"):
    pipe.predict(state, images.transpose(0, 3, 1, 2))
  with pytest.raises(ValueError, match=r"init's sample_input: images are uint8"):
    pipe.init(0, images.astype(np.uint8))


@pytest.mark.slow
def test_wall_time_goes_on_across_a_resume(cifar10_dir, tmp_path):
  run = [f"--config={CPU}:runlocal", f"--workdir={tmp_path}", f"--config.data_dir={cifar10_dir}",
         "--config.eval_every=0", *SMALL_EVAL]
  assert cli(*run, "--config.max_steps=1") == 0
  meta = tmp_path / "checkpoints" / "1" / "meta" / "metadata"
  saved = json.loads(meta.read_text())
  assert saved["extra"]["wall_time"] > 0
  saved["extra"]["wall_time"] = 1e6  # as if the first part had run for 10^6 s
  meta.write_text(json.dumps(saved))
  assert cli(*run, "--config.max_steps=2") == 0
  records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in records if "wall_time" in r] == [1, 2]
  assert records[-1]["wall_time"] > 1e6


# 7. Every command takes user models where it builds one, and has help for every option.

def test_models_summarises_a_user_nnx_model(monkeypatch, capsys):
  from petra_jax.models import summary
  monkeypatch.syspath_prepend(os.path.join(REPO, "docs", "examples"))
  assert summary.main(["custom_nnx:reversible_cnn", "--width", "4"]) == 0
  out = capsys.readouterr().out
  assert out.startswith("custom_nnx:reversible_cnn (your model) on cifar10, width 4: 5 stages")
  assert "rev0           reversible      2 x 32x32x4" in out and "total: " in out


RUNNABLE = ["petra_jax.benchmarks.accelerator", "petra_jax.benchmarks.gpu_check",
            "petra_jax.benchmarks.host", "petra_jax.benchmarks.memory",
            "petra_jax.benchmarks.profile_step", "petra_jax.benchmarks.scaling",
            "petra_jax.benchmarks.throughput", "petra_jax.benchmarks.timeline",
            "petra_jax.benchmarks.torch_side_by_side", "petra_jax.plots",
            "petra_jax.models.summary"]


class _Parsed(Exception):
  pass


@pytest.mark.parametrize("module", RUNNABLE)
def test_every_cli_option_has_help(module, monkeypatch):
  import argparse
  import importlib

  def grab(self, *a, **k):
    raise _Parsed(self)
  monkeypatch.setattr(argparse.ArgumentParser, "parse_args", grab)
  mod = importlib.import_module(module)
  with pytest.raises(_Parsed) as parsed:
    (getattr(mod, "main", None) or mod.parse_args)([])
  parser = parsed.value.args[0]
  assert [a.option_strings or a.dest for a in parser._actions if not a.help] == []


@pytest.mark.parametrize("module", ["simulate", "reversible_backward", "memory.model",
                                    "memory.live", "scaling.processes", "scaling.roles"])
# (run in this process, where the module is already imported: runpy says so; a user's
# `python -m` prints no such warning, the next test)
@pytest.mark.filterwarnings("ignore:.*found in sys.modules after import:RuntimeWarning")
def test_benchmark_libraries_name_their_command(module, monkeypatch, capsys):
  import runpy
  monkeypatch.setattr(sys, "argv", [module, "--help"])
  with pytest.raises(SystemExit) as e:
    runpy.run_module(f"petra_jax.benchmarks.{module}", run_name="__main__")
  assert e.value.code == 0
  assert "it is part of python -m petra_jax.benchmarks." in capsys.readouterr().out


def test_a_package_part_run_as_a_module_prints_no_runpy_warning():
  """``python -m petra_jax.benchmarks.PACKAGE.PART``: its one line, no runpy warning before it
  (the scaling and torch_side_by_side packages filter it the same way)."""
  import subprocess
  out = subprocess.run([sys.executable, "-m", "petra_jax.benchmarks.memory.model", "--help"],
                       capture_output=True, text=True, cwd=REPO, timeout=120)
  assert "found in sys.modules" not in out.stderr, out.stderr


# 6. Every name the examples use is on the API page.

def test_every_name_the_examples_use_is_in_docs_api():
  import pathlib
  import re
  api = (pathlib.Path(REPO) / "docs" / "api.md").read_text()
  missing = set()
  for path in (pathlib.Path(REPO) / "docs" / "examples").glob("*.py"):
    text = path.read_text()
    for obj, name in re.findall(r"\b(petra_jax|data|pipe|info)\.(\w+)", text):
      if obj == "info":
        found = f"`{name}`" in api
      else:
        found = f"{obj}.{name}" in api or (obj == "petra_jax" and f"`{name}" in api)
      if not found:
        missing.add(f"{path.name}: {obj}.{name}")
  assert not missing, sorted(missing)
  assert "over `num_micro_batches`\n  **micro-batches** (not updates" in api


# 9. The own-model recipe, and the stage_sizes clash naming its reset.

def test_cpu_recipe_with_a_user_model_names_the_stage_sizes_reset(tmp_path, monkeypatch, capsys):
  monkeypatch.syspath_prepend(os.path.join(REPO, "docs", "examples"))
  assert cli(f"--config={CPU}", f"--workdir={tmp_path}/w",
             "--config.model.name=my_models:tiny_revnet") == 1
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and "--config.model.stage_sizes='()' to reset it" in err


def test_readme_own_model_command_uses_the_own_model_recipe(monkeypatch):
  import pathlib
  import re
  from petra_jax.training import validation
  from helpers import config_file
  readme = (pathlib.Path(REPO) / "README.md").read_text()
  command = re.search(r"PYTHONPATH=docs/examples python -m petra_jax.train[^`]*", readme).group(0)
  assert "--config=configs/own_model_cpu.py" in command.replace("\n", " ")
  monkeypatch.syspath_prepend(os.path.join(REPO, "docs", "examples"))
  config = config_file("configs/own_model_cpu.py")
  assert config.model.name == "my_models:tiny_revnet" and config.num_devices == 1
  validation.validate_config(config, 1)  # no stage_sizes clash, warm-up within the run


# Further bad inputs: one line each, nothing of a previous run lost.

def test_restart_with_a_refused_config_deletes_nothing(tmp_path, capsys):
  (tmp_path / "config.json").write_text('{"method": "petra"}\n')
  (tmp_path / "metrics.jsonl").write_text('{"step": 1, "train_loss": 2.3}\n')
  (tmp_path / "checkpoints").mkdir()
  before = _listing(tmp_path)
  assert cli(f"--config={CPU}", f"--workdir={tmp_path}", "--restart",
             "--config.optim.warmup_epochs=100") == 1
  assert "optim.warmup_epochs=100 is longer than the run" in capsys.readouterr().err
  assert _listing(tmp_path) == before and (tmp_path / "checkpoints").is_dir()


@pytest.mark.parametrize("args, says", [
    ([f"--config={CPU}", "extra"], "error: unexpected argument(s) extra: flags take the form "
                                   "--name=value"),
    (["--workdir=W"], "error: --config is required: pass --config=configs/<recipe>.py"),
    ([f"--config={CPU}", "--config.progress_seconds=-1"], "progress_seconds must be >= 0"),
])
def test_more_bad_command_lines_are_one_line(args, says, tmp_path, capsys, monkeypatch):
  monkeypatch.chdir(tmp_path)
  assert cli(*args) == 1
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and says in err
  assert os.listdir(tmp_path) == []


def test_a_trailing_partial_update_waits_in_the_accumulator_as_documented():
  # docs/api.md: 5 micro-batches with k = 2 and accumulate(tx, 2): two updates applied, the
  # fifth micro-batch's gradient held in the optimizer's accumulator (not applied, not dropped).
  from petra_jax import optim
  rngs = nnx.Rngs(0)
  stages = [petra_jax.Stage("stem", _NNXStem(rngs), False), petra_jax.Stage("rev", _NNXF(rngs), True),
            petra_jax.Stage("head", _NNXHead(rngs), False)]
  pipe = petra_jax.Pipeline(stages, optim.accumulate(optax.sgd(0.1), 2), jax.devices()[:1],
                            accumulation_steps=2)
  rng = np.random.default_rng(0)
  images = rng.normal(size=(4, 8, 8, 3)).astype(np.float32)
  labels = rng.integers(0, 10, 4).astype(np.int32)
  state = pipe.init(0, images)
  for tick in pipe.schedule(5):
    state, _ = pipe.run_tick(state, tick, lambda m: (images, labels))
  for s in state.train_states:
    assert (int(s.opt_state.mini_step), int(s.opt_state.gradient_step)) == (1, 2)
    assert any(float(jnp.abs(g).sum()) > 0 for g in jax.tree.leaves(s.opt_state.acc_grads))


def test_a_workdir_that_is_a_file_is_one_line_and_kept(tmp_path, capsys):
  (tmp_path / "w").write_text("notes")
  assert cli(f"--config={CPU}", f"--workdir={tmp_path}/w") == 1
  assert "is a file; pass a directory" in capsys.readouterr().err
  assert (tmp_path / "w").read_text() == "notes"


def test_timeline_figure_goes_to_runs_unless_asked(monkeypatch):
  """Like the studies, the timeline never writes into docs/ by default (issue 39 item 8)."""
  import argparse  # pylint: disable=g-import-not-at-top
  from petra_jax.benchmarks import timeline  # pylint: disable=g-import-not-at-top
  seen, real = {}, argparse.ArgumentParser.parse_args

  def parse_then_stop(self, argv=None, namespace=None):
    seen.update(vars(real(self, argv, namespace)))
    raise SystemExit(0)
  monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
  with pytest.raises(SystemExit):
    timeline.main([])
  assert seen and not seen["out"].startswith("docs"), seen
