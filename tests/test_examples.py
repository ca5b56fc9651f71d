"""docs/examples/ run on the real CIFAR-10 for a few steps."""

import os
import pathlib
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "docs" / "examples"


def _run(script, *args, tmp_path):
  env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
             TMPDIR=str(tmp_path))  # custom_linen.py's tempfile.mkdtemp workdir: removed with tmp_path
  env.pop("XLA_FLAGS", None)  # one CPU device, as a user's machine
  r = subprocess.run([sys.executable, str(EXAMPLES / script), *args], cwd=tmp_path, env=env,
                     capture_output=True, text=True, timeout=600)
  assert r.returncode == 0, r.stderr[-3000:]
  return r.stdout


@pytest.mark.slow
@pytest.mark.parametrize("script", ["custom_linen.py", "custom_nnx.py"])
def test_custom_model_example_trains(script, cifar10_dir, tmp_path):
  out = _run(script, "--steps", "2", "--width", "2", "--data_dir", cifar10_dir, tmp_path=tmp_path)
  assert "'test_accuracy'" in out.splitlines()[-1]


@pytest.mark.slow
def test_own_loop_example_reads_back_variables(cifar10_dir, tmp_path):
  out = _run("own_loop.py", "--steps", "2", "--data_dir", cifar10_dir, tmp_path=tmp_path)
  lines = out.splitlines()
  assert [line.split(":")[0] for line in lines[:2]] == ["micro-batch 0", "micro-batch 1"]
  assert "test accuracy (500 images)" in out
  assert lines[-1] == "same logits: True"


@pytest.mark.slow
def test_my_models_example_runs_the_cli(cifar10_dir, tmp_path):
  _run("my_models.py", "--steps", "2", "--data_dir", cifar10_dir,
       "--workdir", str(tmp_path / "run"), tmp_path=tmp_path)
  assert (tmp_path / "run" / "metrics.jsonl").exists()


def test_every_example_has_steps_and_a_docstring():
  for path in EXAMPLES.glob("*.py"):
    text = path.read_text()
    assert text.startswith('"""') and "--steps" in text, path.name
