"""Test set-up: 4 virtual CPU devices, set before JAX initialises its backend.

The tests compile hundreds of tiny programs and run each a few times: LLVM's
optimisation of the generated CPU code is about a third of the suite's CPU
time and nothing the tests check, so they compile at
``--xla_backend_optimization_level=0`` (XLA's own graph passes still run).
Give ``XLA_FLAGS=--xla_backend_optimization_level=N`` to test at another level;
``tests/test_xla_flags.py`` checks the YNN work-around at the default level.
"""

import os
import pathlib

_flags = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
if "--xla_backend_optimization_level" not in _flags:
  _flags += " --xla_backend_optimization_level=0"
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

import petra_jax  # noqa: E402,F401  (applies the XLA-CPU work-around)
import pytest  # noqa: E402

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
