"""Test set-up: 4 virtual CPU devices, set before JAX initialises its backend.

The tests compile hundreds of tiny programs and run each a few times, so
compiling is most of the suite's time and they compile for speed of compiling
(:data:`_COMPILE_FLAGS`: LLVM at ``-O0``, XLA:CPU's older loop emitters instead
of its MLIR fusion emitters, one LLVM module per program; XLA's own graph passes
still run). A flag the user set in ``XLA_FLAGS`` is kept;
``tests/test_xla_flags.py`` checks the YNN work-around at the default options.
"""

import os
import pathlib

from petra_jax import _xla_flags  # (applies the XLA-CPU work-around)

# flag -> (value, the [first, past) jaxlib (major, minor) whose XLA knows it, checked: XLA aborts
# on a flag it does not know): options that change how fast XLA:CPU compiles, not what it computes.
_COMPILE_FLAGS = {"--xla_backend_optimization_level": ("0", ((0, 10), (0, 13))),
                  "--xla_cpu_use_fusion_emitters": ("false", ((0, 10), (0, 11))),  # gone in 0.12
                  "--xla_cpu_parallel_codegen_split_count": ("1", ((0, 10), (0, 13)))}

_flags = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
_flags += "".join(f" {f}={v}" for f, (v, known) in _COMPILE_FLAGS.items()
                  if f not in _flags and _xla_flags.jaxlib_in(known))
os.environ["XLA_FLAGS"] = _flags.strip()

# One persistent XLA compilation cache for the whole test session, inherited by
# the CLI subprocesses: the tests build the same tiny stages many times, and
# compiling them dominates the suite's time on CPU.
# Likewise the decoded CIFAR-10 splits (petra_jax.training.assembly's
# test-support hook): each CLI run would otherwise decode 60,000 PNGs again.
# The process that makes the directory (pytest, or xdist's controller: its
# workers inherit the variables) removes it at exit.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  import atexit  # noqa: E402
  import shutil  # noqa: E402
  import tempfile  # noqa: E402
  _session_dir = tempfile.mkdtemp(prefix="petra_jax_test_cache_")
  atexit.register(shutil.rmtree, _session_dir, ignore_errors=True)
  os.environ["JAX_COMPILATION_CACHE_DIR"] = os.path.join(_session_dir, "xla")
  os.environ.setdefault("PETRA_JAX_TEST_SPLIT_CACHE", _session_dir)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

import gc  # noqa: E402

import pytest  # noqa: E402

# Python's cyclic garbage collector, tuned for a process that traces thousands of programs: it
# runs after 50,000 net allocations instead of 700, and what the collected test modules imported
# (JAX, Flax, the engine) is frozen out of its scans (pytest_collection_finish). Its measured
# effect: docs/performance.md, "The test suite's time".
gc.set_threshold(50_000, 50, 50)


def pytest_collection_finish(session):
  """Freezes the objects alive once every test module is imported (see ``gc`` above)."""
  del session
  gc.collect()
  gc.freeze()

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
SHARED_TFDS = REPO_ROOT.parent / "shared" / "data" / "tensorflow_datasets"


def _real_data_dir():
  env = os.environ.get("TFDS_DATA_DIR")
  for d in (env, str(SHARED_TFDS)):
    if d and (pathlib.Path(d) / "cifar10").is_dir():
      return d
  return None


@pytest.fixture(scope="session")
def cifar10_dir():
  """The tfds data_dir that holds the real CIFAR-10; skips when absent, fails
  instead when the environment variable ``CI`` is set."""
  d = _real_data_dir()
  if d is None:
    message = "real CIFAR-10 not found (set TFDS_DATA_DIR)"
    if os.environ.get("CI"):
      pytest.fail(f"{message}; CI is set, so the tests that need it fail instead of skipping",
                  pytrace=False)
    pytest.skip(message)
  return d


def pytest_collection_modifyitems(config, items):
  """Modules with tests on the real data (``slow`` ones, CLI runs: the longest
  tests) first, each module's tests kept together and in order: with ``-n 2``
  a long test then does not start last while the other worker idles."""
  del config
  slow = {item.module.__name__ for item in items
          if item.get_closest_marker("slow") or "cifar10_dir" in getattr(item, "fixturenames", ())}
  items.sort(key=lambda item: item.module.__name__ not in slow)
