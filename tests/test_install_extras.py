"""pyproject's accelerator extras: cuda12 and cuda13 name JAX's plugins inside JAX's bounds."""

import os
import re
import tomllib

from packaging.requirements import Requirement

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _project() -> dict:
  with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
    return tomllib.load(f)["project"]


def test_cuda_extras_pin_jax_plugins_within_jax_bounds():
  project = _project()
  jax_req = next(Requirement(r) for r in project["dependencies"] if Requirement(r).name == "jax")
  for cuda in ("cuda12", "cuda13"):
    (req,) = [Requirement(r) for r in project["optional-dependencies"][cuda]]
    assert req.name == "jax" and req.extras == {cuda}
    assert req.specifier == jax_req.specifier


def test_readme_names_the_gpu_install_and_the_main_job_command():
  text = open(os.path.join(ROOT, "README.md")).read()
  assert "pip install -e '.[cuda13]'" in text
  assert re.search(r"python -m petra_jax\.train --config=configs/cifar10\.py --workdir=\S+", text)
