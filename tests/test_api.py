"""The public API: top-level names, docs/api.md, and a user's model through the CLI."""

import dataclasses
import hashlib
import importlib
import os
import pathlib
import re
import subprocess
import sys
import warnings

import jax
import numpy as np
import pytest

import petra_jax
from petra_jax import config as config_lib
from petra_jax import models, train
from petra_jax.training import checkpoint, metrics, validation
from helpers import SMALL_EVAL, USER_MODULE, train_in_process, zero_delay_update_errors

REPO = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture
def user_module(tmp_path, monkeypatch):
  d = tmp_path / "user_code"
  d.mkdir()
  (d / "user_mod.py").write_text(USER_MODULE)
  monkeypatch.syspath_prepend(str(d))
  monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(d), str(REPO)]))
  return d / "user_mod.py"


def test_import_is_cheap_and_names_resolve():
  code = "import sys, petra_jax; print('jax' in sys.modules, 'flax' in sys.modules)"
  r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                     env=dict(os.environ, PYTHONPATH=str(REPO)), timeout=120)
  assert r.stdout.split() == ["False", "False"], r.stderr
  doc = (REPO / "docs" / "api.md").read_text()
  for name in petra_jax.__all__:
    assert getattr(petra_jax, name) is not None
    assert f"`petra_jax.{name}" in doc, name


def _cli(*args, workdir):
  return subprocess.run(
      [sys.executable, "-m", "petra_jax.train", "--config=configs/cifar10.py",
       f"--workdir={workdir}", *args], cwd=REPO, capture_output=True, text=True, timeout=600)


def _tiny(cifar10_dir, method, **overrides):
  c = config_lib.get_config()
  c.model.name, c.model.width, c.method, c.data_dir = "user_mod:tiny", 2, method, cifar10_dir
  c.batch_size, c.accumulation_steps, c.max_steps, c.log_every = 16, 2, 3, 1
  c.eval_every, c.eval_batch_size, c.eval_examples, c.num_devices = 0, 500, 500, 1
  c.optim.warmup_epochs, c.compensation.name = 0, "none"
  for k, v in overrides.items():
    target, *path = c, *k.split(".")
    for p in path[:-1]:
      target = target[p]
    target[path[-1]] = v
  return c


def _losses(workdir):
  return [r["train_loss"] for r in metrics.read_metrics(str(workdir)) if "train_loss" in r]


@pytest.mark.slow
def test_user_model_trains_through_the_cli_and_fingerprints_its_source(user_module, cifar10_dir,
                                                                        tmp_path):
  args = ["--config.model.name=user_mod:tiny", "--config.model.width=2",
          "--config.batch_size=16", "--config.max_steps=2", "--config.eval_every=0",
          *SMALL_EVAL, "--config.log_every=1", "--config.checkpoint_every=1",
          "--config.model.stage_sizes=(2,3)", f"--config.data_dir={cifar10_dir}"]
  r = _cli(*args, workdir=tmp_path / "run")
  assert r.returncode == 0, r.stderr[-3000:]
  assert len(_losses(tmp_path / "run")) == 2
  saved = checkpoint.saved_fingerprint(str(tmp_path / "run" / "checkpoints"))
  assert saved["model"] == "user_mod:tiny"
  assert saved["model_source"] == hashlib.sha256(user_module.read_bytes()).hexdigest()
  user_module.write_text(USER_MODULE.replace("(3, 3)", "(1, 1)"))  # another model, same name
  r = _cli(*args, "--config.max_steps=3", workdir=tmp_path / "run")
  errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
  assert r.returncode == 1 and "Traceback" not in r.stderr
  assert len(errors) == 1 and "model_source" in errors[0], r.stderr[-2000:]


@pytest.mark.long  # CI time: the CLI test above trains the user model, the zero-delay test below
@pytest.mark.slow  # checks its PETRA update, test_reference_methods its delayed methods
def test_user_model_trains_with_every_method(user_module, cifar10_dir, tmp_path):
  losses = {}
  for method, extra in (("backprop", {}), ("revprop", {}), ("petra", {"model.num_stages": 3}),
                        ("delayed", {"data_parallel": 2}), ("1f1b", {})):
    train.train_and_evaluate(_tiny(cifar10_dir, method, **extra), str(tmp_path / method))
    losses[method] = _losses(tmp_path / method)
    assert len(losses[method]) == 3 and np.all(np.isfinite(losses[method])), method
  # Exact gradients all: equal up to float32 round-off (of the reconstruction for
  # revprop), measured 8e-8 for both.
  np.testing.assert_allclose(losses["revprop"], losses["backprop"], rtol=1e-6)
  np.testing.assert_allclose(losses["1f1b"], losses["backprop"], rtol=1e-6)
  # delayed (stale weights, another trajectory) against the reference loop with real
  # delays, and gpipe against jax.grad: tests/test_reference_methods.py (a user model too).
  assert losses["delayed"] != losses["backprop"]


def test_user_model_zero_delay_petra_update_is_jax_grad(user_module):
  stages = models.build_model("user_mod:tiny", width=2, num_classes=10)
  # float32 round-off of the reconstruction, amplified by 2-channel BatchNorm: 1.2e-5 measured.
  assert max(zero_delay_update_errors(stages, "petra")) < 1e-4


@pytest.mark.parametrize("name, message", [
    ("no_such_module_xyz:fn", "cannot import 'no_such_module_xyz'"),
    ("user_mod:nope", "has no function 'nope'"),
])
def test_bad_user_model_is_one_line_naming_the_fix(user_module, name, message):
  c = config_lib.get_config()
  c.model.name = name
  with pytest.raises(validation.ConfigError) as e:
    validation.validate_config(c, len(jax.local_devices()))
  assert message in str(e.value) and "--config.model.name=MODULE:FUNCTION" in str(e.value)
  assert "\n" not in str(e.value)


def test_cli_unimportable_user_model_is_one_line(capsys, tmp_path):
  r = train_in_process(capsys, "--config=configs/cifar10.py", f"--workdir={tmp_path}",
                       "--config.model.name=no_such_module_xyz:fn")  # no start-up to pay
  assert r.returncode == 1 and "Traceback" not in r.stderr
  errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
  assert len(errors) == 1 and "PYTHONPATH" in errors[0], r.stderr[-2000:]


def test_user_model_with_wrong_head_is_refused_at_validation(user_module):
  c = config_lib.get_config()
  c.model.name, c.dataset = "user_bad_head:tiny", "cifar100"
  (user_module.parent / "user_bad_head.py").write_text(
      USER_MODULE.replace("Head(num_classes)", "Head(10)"))
  with pytest.raises(validation.ConfigError, match=r"logits \[B, num_classes\] = \[2, 100\]"):
    validation.validate_config(c, len(jax.local_devices()))


def test_task_is_the_deprecated_name_of_objective():
  from petra_jax.engine.stages import objective  # pylint: disable=g-import-not-at-top
  with pytest.warns(DeprecationWarning, match="Objective"):
    assert petra_jax.Task is petra_jax.Objective
  with pytest.warns(DeprecationWarning, match="Objective"):
    assert objective.Task is objective.Objective
  with pytest.warns(DeprecationWarning, match="objective="):
    petra_jax.check_stages(petra_jax.build_model("revnet18", width=2), task=petra_jax.CLASSIFICATION)


# docs/api.md names only what exists: every `petra_jax.a.b.C`, every `obj.attr` read on an object
# the page introduces (`pipe.run_tick`, `data.open_split`, ...), every file and every link.

def _api_code() -> tuple:
  """docs/api.md's text and its code: the fenced blocks and the inline spans (headings included)."""
  doc = (REPO / "docs" / "api.md").read_text()
  fenced = re.findall(r"```.*?```", doc, flags=re.S)
  prose = re.sub(r"```.*?```", "", doc, flags=re.S)
  return doc, fenced + re.findall(r"`([^`]+)`", prose)


def _resolve(dotted: str):
  parts = dotted.split(".")
  for i in range(len(parts), 0, -1):
    module = ".".join(parts[:i])
    try:
      obj = importlib.import_module(module)
      break
    except ModuleNotFoundError as e:
      if e.name != module:
        raise
  for attr in parts[i:]:
    obj = getattr(obj, attr)
  return obj


def _has(cls, attr: str) -> bool:
  fields = {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set()
  return hasattr(cls, attr) or attr in fields


def test_every_name_docs_api_md_documents_exists():
  from petra_jax.engine import compiled  # pylint: disable=g-import-not-at-top
  doc, code = _api_code()
  dotted = {m for c in code for m in re.findall(r"(?<![\w./])petra_jax(?:\.\w+)+", c)}
  assert len(dotted) >= 20, sorted(dotted)
  missing = []
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)  # petra_jax.Task, documented as such
    for name in sorted(dotted):
      try:
        _resolve(name)
      except (ImportError, AttributeError):
        missing.append(name)
  # The objects the page reads attributes of, and what each is.
  receivers = {"data": [petra_jax.data], "compiled": [compiled], "pipe": [petra_jax.Pipeline],
               "ex": [compiled.CompiledExecutor, compiled.HostExecutor],
               "objective": [petra_jax.Objective], "stage": [petra_jax.Stage],
               "state": [petra_jax.PipelineState]}
  pattern = r"(?<![\w./])(%s)\.(\w+)" % "|".join(receivers)
  read = {m for c in code for m in re.findall(pattern, c)}
  assert len(read) >= 20, sorted(read)
  missing += [f"{r}.{a}" for r, a in sorted(read) if not all(_has(o, a) for o in receivers[r])]
  files = set(re.findall(r"(?<![\w/])((?:petra_jax|docs|tests)/[\w/]+\.py)", doc))
  missing += sorted(f for f in files if not (REPO / f).is_file())
  links = set(re.findall(r"\]\(([^)#:]+)\)", doc))
  missing += sorted(f for f in links if not (REPO / "docs" / f).exists())
  assert missing == [], "docs/api.md names what does not exist"


def test_docs_api_md_signatures_match_the_code():
  """A documented call's keywords are the function's; in a heading or a list item's opening span
  (the page's signatures), so are its positional names, in order."""
  import inspect  # pylint: disable=g-import-not-at-top
  from petra_jax.engine import compiled  # pylint: disable=g-import-not-at-top
  doc = (REPO / "docs" / "api.md").read_text()
  _, code = _api_code()
  signatures = set(re.findall(r"^(?:###|-) `([^`]+)`", doc, flags=re.M))
  owners = {"data": [petra_jax.data], "compiled": [compiled], "pipe": [petra_jax.Pipeline],
            "ex": [compiled.CompiledExecutor, compiled.HostExecutor],
            "objective": [petra_jax.CLASSIFICATION], "petra_jax": [petra_jax]}
  call = r"(?<![\w./])(%s)((?:\.\w+)+)\(([^()]*)\)" % "|".join(owners)
  checked, wrong = 0, []
  for span in code:
    for owner, path, args in re.findall(call, span):
      args = [a.strip() for a in args.split(",") if a.strip() not in ("", "*", "...")]
      for obj in owners[owner]:
        for attr in path.strip(".").split("."):
          obj = getattr(obj, attr)
        params = [p for p in inspect.signature(obj).parameters if p != "self"]
        keywords = [a.split("=")[0] for a in args if re.fullmatch(r"\w+=.*", a)]
        wrong += [f"{owner}{path}: {k}" for k in keywords if k not in params]
        if span in signatures:
          positional = [a for a in args if "=" not in a]
          if params[:len(positional)] != positional:
            wrong.append(f"{owner}{path}({', '.join(positional)}): the code has {params}")
        checked += 1
  assert checked >= 25, checked
  assert wrong == [], "docs/api.md's signatures differ from the code"
