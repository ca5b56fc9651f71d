"""The benchmark commands take a user's MODULE:FUNCTION model as the zoo's."""

import argparse
import os
import subprocess
import sys
import textwrap

import pytest

from petra_jax.benchmarks import cli

from helpers import REPO, without_virtual_devices

USER_MODULE = textwrap.dedent("""
    import flax.linen as nn
    import jax.numpy as jnp
    from petra_jax import Stage

    class F(nn.Module):
      width: int
      @nn.compact
      def __call__(self, x, train=True):
        return nn.Conv(self.width, (3, 3))(nn.relu(x))

    class Stem(nn.Module):
      width: int
      @nn.compact
      def __call__(self, x, train=True):
        h = nn.Conv(2 * self.width, (3, 3))(x)
        return (h[..., :self.width], h[..., self.width:])

    class Head(nn.Module):
      num_classes: int
      @nn.compact
      def __call__(self, x, train=True):
        return nn.Dense(self.num_classes)(jnp.concatenate(x, -1).mean((1, 2)))

    def tiny(num_classes=10, width=4):
      return [Stage("stem", Stem(width), False), Stage("rev", F(width), True),
              Stage("head", Head(num_classes), False)]
    """)


def test_model_flag_takes_zoo_names_and_module_functions():
  assert cli.model_name("revnet18") == "revnet18"
  assert cli.model_name("my_models:tiny") == "my_models:tiny"
  with pytest.raises(argparse.ArgumentTypeError, match="MODULE:FUNCTION"):
    cli.model_name("revnet19")


@pytest.mark.slow
def test_memory_benchmark_runs_on_a_user_model(tmp_path):
  (tmp_path / "user_bench_mod.py").write_text(USER_MODULE)
  env = {"PYTHONPATH": f"{tmp_path}:{REPO}", "PATH": "/usr/bin:/bin", "JAX_PLATFORMS": "cpu"}
  # conftest's compile options (one device) and the session's compilation cache: compile speed
  keep = ("XLA_FLAGS", "JAX_COMPILATION_CACHE_DIR", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS",
          "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES")
  env.update({k: v for k, v in without_virtual_devices(os.environ).items() if k in keep})
  out = subprocess.run(
      [sys.executable, "-m", "petra_jax.benchmarks.memory", "--model=user_bench_mod:tiny",
       "--dataset=cifar10", "--width=4", "--batch-size=4"],
      cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
  assert out.returncode == 0, out.stderr[-2000:]
  # The bytes measured on the device's messages agree with the memory model's count.
  line = next(l for l in out.stdout.splitlines() if l.strip().startswith("none"))
  live, analytic = line.split("live at width 4: ")[1].split(" B/tick (analytic ")
  assert int(live) == int(analytic.split(")")[0])
