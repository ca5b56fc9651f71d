"""The cross-process transfer's program (petra_jax/engine/transport/transfers.py).

Two processes run one transfer from different lines of code (the sender's branch and the
receiver's). With jaxlib 0.12's CPU collectives, two programs that differ only in the
locations their lowering recorded never meet, nor do programs loaded from the persistent
compilation cache (docs/multihost.md, "JAX versions"). So the program must not depend on who
lowers it: its lowering is compared with locations in (``debug_info=True``), four virtual CPU
devices standing for the two ends; and the cache is off where it hangs.
"""

import jax
import numpy as np
import pytest

from petra_jax.engine.transport import transfers

SHAPES = (((8, 4), np.dtype(np.float32)), ((4,), np.dtype(np.uint32)))


def _lowered_text(src, dst) -> str:
  treedef = jax.tree.structure([0] * len(SHAPES))
  lowered, _ = transfers._lowered(treedef, SHAPES, (src,), (dst,))  # pylint: disable=protected-access
  return lowered.as_text(debug_info=True)


def _as_the_sender(src, dst) -> str:
  return _lowered_text(src, dst)


def _as_the_receiver(src, dst) -> str:
  return _lowered_text(src, dst)


@pytest.mark.parametrize("src,dst", [(0, 2), (3, 1)])
def test_a_transfer_lowers_to_one_program_whoever_calls_it(src, dst):
  devices = jax.devices()
  sender = _as_the_sender(devices[src], devices[dst])
  receiver = _as_the_receiver(devices[src], devices[dst])
  assert "collective_permute" in sender
  assert sender == receiver


def test_lowering_leaves_the_traceback_setting_as_it_was():
  before = jax.config.jax_include_full_tracebacks_in_locations
  devices = jax.devices()
  _lowered_text(devices[0], devices[1])
  assert jax.config.jax_include_full_tracebacks_in_locations == before


@pytest.mark.parametrize("jaxlib,processes,cache_off", [
    ("0.12.1", 2, True), ("0.10.2", 2, False), ("0.12.1", 1, False)])
def test_the_persistent_cache_is_off_only_where_cached_collectives_hang(
    monkeypatch, jaxlib, processes, cache_off):
  monkeypatch.setattr(transfers._xla_flags, "_jaxlib_version", lambda: jaxlib)  # pylint: disable=protected-access
  monkeypatch.setattr(jax, "process_count", lambda: processes)
  before = jax.config.jax_enable_compilation_cache
  try:
    assert transfers.skip_cache_if_it_hangs() == cache_off
    assert jax.config.jax_enable_compilation_cache == (before and not cache_off)
  finally:
    jax.config.update("jax_enable_compilation_cache", before)
