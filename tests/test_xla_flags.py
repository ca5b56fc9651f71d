"""Regression guard for the XLA-CPU YNN-fusion hazard (see petra_jax/_xla_flags.py)."""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from petra_jax import _xla_flags

_PROBE = """
import os, sys
import petra_jax
import jax, jax.numpy as jnp
f = jax.jit(lambda a: jax.nn.relu(a @ jnp.ones((256, 256))).sum())
print(os.environ["XLA_FLAGS"])
print(float(f(jnp.ones((256, 256)))))
"""


_CPU = dict(jaxlib_version="0.10.2", plugins=())


def test_appends_to_user_flags_without_overriding():
  env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
  _xla_flags.apply_cpu_workaround(env, **_CPU)
  assert env["XLA_FLAGS"] == ("--xla_force_host_platform_device_count=2 "
                              "--xla_cpu_experimental_ynn_fusion_type=")
  env = {"XLA_FLAGS": "--xla_cpu_experimental_ynn_fusion_type=default"}
  _xla_flags.apply_cpu_workaround(env, **_CPU)  # a user's own choice is kept
  assert env["XLA_FLAGS"] == "--xla_cpu_experimental_ynn_fusion_type=default"
  env = {}
  _xla_flags.apply_cpu_workaround(env, **_CPU)
  assert env["XLA_FLAGS"] == "--xla_cpu_experimental_ynn_fusion_type="


@pytest.mark.parametrize("environ, plugins", [
    ({"JAX_PLATFORMS": "cuda"}, ()),               # a GPU run asked for
    ({"JAX_PLATFORMS": "tpu,cpu"}, ()),            # a TPU run with CPU fallback
    ({}, ("jax_cuda12_plugin",)),                  # JAX would pick the GPU plugin
    ({}, ("libtpu",)),
])
def test_gpu_and_tpu_starts_never_see_the_cpu_flag(environ, plugins):
  env = dict(environ, XLA_FLAGS="--xla_dump_to=/tmp/x")
  _xla_flags.apply_cpu_workaround(env, jaxlib_version="0.12.0.1", plugins=plugins)
  assert env["XLA_FLAGS"] == "--xla_dump_to=/tmp/x"


def test_cpu_platform_forced_over_installed_plugin_gets_the_flag():
  env = {"JAX_PLATFORMS": "cpu"}
  _xla_flags.apply_cpu_workaround(env, jaxlib_version="0.12.0.1", plugins=("libtpu",))
  assert env["XLA_FLAGS"] == "--xla_cpu_experimental_ynn_fusion_type="


@pytest.mark.parametrize("version", ["0.9.2", "0.13.0", "1.0.0", "garbage"])
def test_jaxlib_outside_the_known_range_never_gets_the_flag(version):
  # XLA aborts on a flag it does not know: only versions known to have it get it.
  env = {}
  _xla_flags.apply_cpu_workaround(env, jaxlib_version=version, plugins=())
  assert "XLA_FLAGS" not in env
  assert not _xla_flags.knows_cpu_flags(version)


@pytest.mark.parametrize("version, inside", [("0.10.0", True), ("0.10.2", True), ("0.12.0.1", True),
                                             ("0.9.9", False), ("0.13.0", False), ("x", False)])
def test_jaxlib_in_reads_major_and_minor(version, inside):
  assert _xla_flags.jaxlib_in(((0, 10), (0, 13)), version) is inside
  assert _xla_flags.knows_cpu_flags(version) is inside


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
