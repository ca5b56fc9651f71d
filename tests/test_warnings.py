"""The suite's warning filters (pyproject.toml ``filterwarnings``)."""

import warnings

import pytest


def test_a_deprecation_warning_from_petra_jax_fails_the_test():
  with pytest.raises(DeprecationWarning, match="is deprecated"):
    warnings.warn_explicit("jax.sharding.X is deprecated; use Y", DeprecationWarning,
                           "placement.py", 1, module="petra_jax.engine.transport.placement")


def test_other_deprecation_warnings_stay_warnings():
  # nanobind's (jaxlib 0.12) while it builds a type: an error there aborts the process.
  with pytest.warns(DeprecationWarning):
    warnings.warn_explicit("builtin type event_stats has no __module__ attribute",
                           DeprecationWarning, "device_time.py", 1,
                           module="petra_jax.benchmarks.device_time")
  with pytest.warns(DeprecationWarning):
    warnings.warn_explicit("flax.nnx.State will be deprecated", DeprecationWarning,
                           "statelib.py", 1, module="flax.nnx.statelib")
