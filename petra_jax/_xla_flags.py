"""Work-around for wrong results from XLA's experimental YNN fusion on CPU.

With jaxlib 0.10.2 to 0.12.0.1 on x86 CPUs, XLA's experimental YNN fusion
silently returns wrong values (0, inf or NaN) for some jitted matmul graphs with
constant operands, e.g. ``jit(lambda a: relu(a @ jnp.ones((256, 256))).sum())``
gives 0. Turning the fusion off (an empty
``--xla_cpu_experimental_ynn_fusion_type=``) fixes it and is also about 25 %
faster for the conv nets here.

The flag must be in ``XLA_FLAGS`` before JAX initialises its backend, so this
module runs when ``petra_jax`` is imported. XLA aborts the process on an
``XLA_FLAGS`` entry it does not know, so the flag is added only where it cannot
harm a start:

* only for CPU runs: ``JAX_PLATFORMS`` is ``cpu``, or it is unset and no GPU or
  TPU plugin of JAX is installed (a GPU or TPU start never sees the flag);
* only for the jaxlib versions known to have the flag (``KNOWN_JAXLIB``);
* never over a value the user set.
"""

import importlib.metadata
import importlib.util
import os
from typing import Mapping, Optional

YNN_FLAG = "--xla_cpu_experimental_ynn_fusion_type"
# [first, past-last) jaxlib (major, minor) in which the flag exists; the
# project's dependency bounds (pyproject.toml) keep jaxlib inside it.
KNOWN_JAXLIB = ((0, 10), (0, 13))
# Importable modules of JAX's accelerator plugins (pip's jax[cuda12], jax[cuda13], jax[tpu]).
ACCELERATOR_PLUGINS = ("jax_cuda12_plugin", "jax_cuda13_plugin", "libtpu")


def _jaxlib_version() -> Optional[str]:
  try:
    return importlib.metadata.version("jaxlib")
  except importlib.metadata.PackageNotFoundError:
    return None


def _installed_plugins() -> tuple:
  return tuple(p for p in ACCELERATOR_PLUGINS if importlib.util.find_spec(p) is not None)


def _minor(version: str) -> tuple:
  parts = version.split(".")
  try:
    return int(parts[0]), int(parts[1])
  except (IndexError, ValueError):
    return (-1, -1)


def is_cpu_run(environ: Mapping[str, str], plugins: tuple) -> bool:
  """Whether JAX will run on the CPU only: ``JAX_PLATFORMS`` names only
  ``cpu``, or is unset and no accelerator plugin is installed."""
  platforms = environ.get("JAX_PLATFORMS", "").strip().lower()
  if platforms:
    return platforms == "cpu"
  return not plugins


def apply_cpu_workaround(environ=os.environ, jaxlib_version: Optional[str] = None,
                         plugins: Optional[tuple] = None) -> str:
  """Appends ``--xla_cpu_experimental_ynn_fusion_type=`` to ``XLA_FLAGS`` on CPU runs.

  Args:
    environ: the environment mapping to edit (``os.environ`` by default).
    jaxlib_version: the installed jaxlib's version; read from the package
      metadata when None.
    plugins: the installed accelerator plugins (``ACCELERATOR_PLUGINS``);
      looked up when None.

  Returns:
    The resulting value of ``XLA_FLAGS`` (unchanged when the run is not a CPU
    run, when jaxlib is outside ``KNOWN_JAXLIB``, or when the user already set
    the flag with any value).
  """
  flags = environ.get("XLA_FLAGS", "")
  version = _jaxlib_version() if jaxlib_version is None else jaxlib_version
  plugins = _installed_plugins() if plugins is None else plugins
  first, past = KNOWN_JAXLIB
  known = version is not None and first <= _minor(version) < past
  if YNN_FLAG not in flags and known and is_cpu_run(environ, plugins):
    flags = f"{flags} {YNN_FLAG}=".strip()
    environ["XLA_FLAGS"] = flags
  return flags
