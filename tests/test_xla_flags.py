"""Regression guard for the XLA-CPU YNN-fusion hazard (see petra_jax/_xla_flags.py)."""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np

from petra_jax import _xla_flags

_PROBE = """
import os, sys
import petra_jax
import jax, jax.numpy as jnp
f = jax.jit(lambda a: jax.nn.relu(a @ jnp.ones((256, 256))).sum())
print(os.environ["XLA_FLAGS"])
print(float(f(jnp.ones((256, 256)))))
"""


def test_appends_to_user_flags_without_overriding():
  env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
  _xla_flags.apply_cpu_workaround(env)
  assert env["XLA_FLAGS"] == ("--xla_force_host_platform_device_count=2 "
                              "--xla_cpu_experimental_ynn_fusion_type=")
  env = {"XLA_FLAGS": "--xla_cpu_experimental_ynn_fusion_type=default"}
  _xla_flags.apply_cpu_workaround(env)  # a user's own choice is kept
  assert env["XLA_FLAGS"] == "--xla_cpu_experimental_ynn_fusion_type=default"
  env = {}
  _xla_flags.apply_cpu_workaround(env)
  assert env["XLA_FLAGS"] == "--xla_cpu_experimental_ynn_fusion_type="


def test_import_applies_flag_before_backend_in_fresh_process():
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=3")
  out = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True,
                       text=True, check=True, timeout=120).stdout.split("\n")
  assert out[0] == ("--xla_force_host_platform_device_count=3 "
                    "--xla_cpu_experimental_ynn_fusion_type=")
  # relu(ones @ ones) = 256 everywhere: the sum is 256**3 (YNN fusion gave 0).
  assert float(out[1]) == 256.0 ** 3


def test_matmul_with_constant_operand_is_right_in_this_process():
  assert "--xla_cpu_experimental_ynn_fusion_type=" in os.environ["XLA_FLAGS"]
  a = np.random.default_rng(0).normal(size=(256, 256)).astype(np.float32)
  got = jax.jit(lambda a: jax.nn.relu(a @ jnp.ones((256, 256))).sum())(a)
  want = np.maximum(a.astype(np.float64) @ np.ones((256, 256)), 0).sum()
  np.testing.assert_allclose(float(got), want, rtol=1e-4)
