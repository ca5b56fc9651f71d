"""Turns off XLA's experimental YNN fusion on CPU: it returns wrong values (0, inf, NaN).

jaxlib 0.10.2-0.12 on x86, e.g. ``jit(lambda a: relu(a @ jnp.ones((256, 256))).sum())`` gives 0.
The flag must be in ``XLA_FLAGS`` before JAX starts its backend, and XLA aborts on a flag it does
not know, so it is added only for CPU runs, only for the jaxlib versions in ``KNOWN_JAXLIB``, and
never over a value the user set.
"""

import importlib.metadata
import importlib.util
import os
from typing import Mapping, Optional

YNN_FLAG = "--xla_cpu_experimental_ynn_fusion_type"
# [first, past-last) jaxlib (major, minor) whose XLA knows the YNN flag.
KNOWN_JAXLIB = ((0, 10), (0, 13))
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


def jaxlib_in(known: tuple, jaxlib_version: Optional[str] = None) -> bool:
  """Whether the installed (or given) jaxlib's (major, minor) is in ``known = (first, past)``."""
  version = _jaxlib_version() if jaxlib_version is None else jaxlib_version
  first, past = known
  return version is not None and first <= _minor(version) < past


def knows_cpu_flags(jaxlib_version: Optional[str] = None) -> bool:
  """Whether the installed (or given) jaxlib is in :data:`KNOWN_JAXLIB`: XLA aborts on unknown flags."""
  return jaxlib_in(KNOWN_JAXLIB, jaxlib_version)


def is_cpu_run(environ: Mapping[str, str], plugins: tuple) -> bool:
  """``JAX_PLATFORMS`` is ``cpu``, or it is unset and no accelerator plugin is installed."""
  platforms = environ.get("JAX_PLATFORMS", "").strip().lower()
  if platforms:
    return platforms == "cpu"
  return not plugins


def apply_cpu_workaround(environ=os.environ, jaxlib_version: Optional[str] = None,
                         plugins: Optional[tuple] = None) -> str:
  """Appends ``--xla_cpu_experimental_ynn_fusion_type=`` to ``environ["XLA_FLAGS"]`` on CPU runs.

  ``jaxlib_version`` and ``plugins`` default to what is installed; returns the new ``XLA_FLAGS``.
  """
  flags = environ.get("XLA_FLAGS", "")
  plugins = _installed_plugins() if plugins is None else plugins
  if YNN_FLAG not in flags and knows_cpu_flags(jaxlib_version) and is_cpu_run(environ, plugins):
    flags = f"{flags} {YNN_FLAG}=".strip()
    environ["XLA_FLAGS"] = flags
  return flags
