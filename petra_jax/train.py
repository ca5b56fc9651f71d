"""Training entry point: ``python -m petra_jax.train --config=configs/cifar10.py``.

``main`` only parses flags (``--config``, ``--workdir``; absl's
``--verbosity`` shows other libraries' logging) and calls
:func:`train_and_evaluate`. Errors in the configuration or the data end the
run with one line naming the fix, never a JAX traceback. The work lives in
:mod:`petra_jax.training`: ``validation`` (config checks), ``distributed``
(multi-process start-up), ``assembly`` (data, pipeline, checkpoint),
``loop`` (the loop and its hooks), ``evaluate``, ``loss_log``, ``console``.
"""

from __future__ import annotations

import contextlib
import sys

import petra_jax  # noqa: F401  (applies the XLA-CPU work-around first)

from absl import app, flags, logging
import jax
from ml_collections import config_flags

from petra_jax import data as data_lib
from petra_jax.engine import transport
from petra_jax.training import checkpoint as checkpoint_lib
from petra_jax.training import console
from petra_jax.training import workdir as workdir_lib
# Re-exported: what studies.py, benchmarks and tests call as ``train.<name>``.
from petra_jax.training.assembly import setup  # noqa: F401
from petra_jax.training.distributed import exit_now, initialize_distributed
from petra_jax.training.evaluate import evaluate  # noqa: F401
from petra_jax.training.loop import train_and_evaluate
from petra_jax.training.validation import ConfigError, validate_config  # noqa: F401

_CONFIG = config_flags.DEFINE_config_file("config", None, "Path to a config file.",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", "runs/default", "Directory for metrics and checkpoints.")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  console.quiet_library_logging(verbosity_given=flags.FLAGS["verbosity"].present > 0)
  try:
    distributed = initialize_distributed(_CONFIG.value)
  except ConfigError as e:
    exit_now(f"error: {e}")
  backend_error = console.backend_error()
  if backend_error:
    exit_now(f"error: {backend_error}")
  try:
    with _workdir_lock(_WORKDIR.value):
      train_and_evaluate(_CONFIG.value, _WORKDIR.value)
  except transport.PeerError as e:
    exit_now(f"error: process {jax.process_index()}: {e}")
  except (ConfigError, data_lib.DataError, checkpoint_lib.CheckpointError, FloatingPointError,
          ValueError, workdir_lib.WorkdirBusyError) as e:
    if distributed:
      exit_now(f"error: process {jax.process_index()}: {e}")
    sys.exit(f"error: {e}")
  except Exception as e:  # pylint: disable=broad-except
    if not distributed:
      raise
    # e.g. a runtime error surfacing after a peer died: name this process and
    # exit now rather than wait at jax.distributed's shutdown barrier.
    logging.exception("process %d failed", jax.process_index())
    exit_now(f"error: process {jax.process_index()}: {type(e).__name__}: {e}")


def _workdir_lock(workdir: str):
  """Held for the run's lifetime by process 0: a second run on the same
  ``--workdir`` is refused (:class:`petra_jax.training.workdir.WorkdirLock`)."""
  if jax.process_index() == 0:
    return workdir_lib.WorkdirLock(workdir)
  return contextlib.nullcontext()


def _parse_flags(argv):
  """absl's flag parsing, with a bad ``--config.*`` override as one line."""
  try:
    return flags.FLAGS(argv)
  except (KeyError, AttributeError, TypeError, ValueError) as e:
    # ml_collections raises these (not flags.Error) for an unknown field or a
    # value of the wrong type; its message has a "did you mean" hint.
    message = str(e.args[0] if e.args else e).replace("\n", " ")
    sys.exit(f"error: bad config override: {message}. See petra_jax/config.py for the "
             "fields and their types.")
  except flags.Error as e:
    # A config file's get_config(variant) refusing its argument: its one-line
    # ValueError, not the traceback ml_collections wraps it in.
    last = str(e).strip().splitlines()[-1]
    if "Error whilst parsing config file" in str(e) and last.startswith("ValueError: "):
      sys.exit(f"error: {str(e).splitlines()[0]} {last[len('ValueError: '):]}")
    sys.exit(f"error: {e}\nPass --helpfull to list the flags.")


if __name__ == "__main__":
  flags.mark_flags_as_required(["config"])
  app.run(main, flags_parser=_parse_flags)
