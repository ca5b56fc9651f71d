"""Training entry point: ``python -m petra_jax.train --config=configs/cifar10.py``.

``main`` parses the flags and calls :func:`train_and_evaluate`; a bad
config, data set, workdir or checkpoint ends the run with one line naming
the fix. ``--config=WORKDIR/config.json`` runs a saved config again.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import sys
from typing import Optional

from absl import app, flags, logging
import jax
from ml_collections import config_flags

from petra_jax import config as config_lib
from petra_jax import data as data_lib
from petra_jax.engine.transport import transfers as transport
from petra_jax.training.checkpoint import blocks as checkpoint_blocks
from petra_jax.training import console
from petra_jax.training import preemption
from petra_jax.training import run_record
from petra_jax.training import workdir as workdir_lib
from petra_jax.training.distributed import exit_now, initialize_distributed
from petra_jax.training.loop import train_and_evaluate
from petra_jax.training.validation import ConfigError

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Path to a config file (configs/*.py[:variant]) or a run's "
    "WORKDIR/config.json.", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", "runs/default", "Directory for metrics and checkpoints.")
_RESTART = flags.DEFINE_bool(
    "restart", False, "Start over: delete WORKDIR's checkpoints, metrics.jsonl and TensorBoard "
    "events first. Without it a run resumes from WORKDIR's last checkpoint, and a finished "
    "run says so and exits.")


def main(argv):
  if len(argv) > 1:
    sys.exit(f"error: unexpected argument(s) {' '.join(argv[1:])}: flags take the form "
             f"--name=value (e.g. --config.method=backprop); {_SEE_HELP}.")
  console.quiet_library_logging(verbosity_given=flags.FLAGS["verbosity"].present > 0)
  # Until training starts, SIGTERM stops the run at once (exit 75).
  with preemption.StopOnSignal((signal.SIGTERM,), escalate=(), announce=False) as startup:
    startup.raising = True
    try:
      _run()
    except preemption.Interrupted as e:
      preemption.exit_preempted(f"stopped by {e.signal_name} before training started; re-run "
                                "the same command to start again.")
    except KeyboardInterrupt:
      print("interrupted by Ctrl-C: stopped without saving; re-run the same command to "
            "resume from the last checkpoint.", file=sys.stderr)
      sys.exit(130)


def _run():
  try:
    distributed = initialize_distributed(_CONFIG.value)
  except ConfigError as e:
    exit_now(f"error: {e}")
  backend_error = console.backend_error()
  if backend_error:
    exit_now(f"error: {backend_error}")
  try:
    # A refused start (bad config, another run's checkpoint, no data) leaves
    # the workdir as it found it: no config.json, lock file or folders added.
    with workdir_lib.kept_as_found(_WORKDIR.value, jax.process_index() == 0) as accept:
      workdir_lib.check_workdir(_WORKDIR.value)
      with _workdir_lock(_WORKDIR.value):
        train_and_evaluate(_CONFIG.value, _WORKDIR.value, restart=_RESTART.value,
                           on_accepted=accept)
  except transport.PeerError as e:
    exit_now(f"error: process {jax.process_index()}: {e}")
  except (ConfigError, data_lib.DataError, checkpoint_blocks.CheckpointError, FloatingPointError,
          ValueError, workdir_lib.WorkdirBusyError, OSError) as e:
    message = _one_line(e)
    if distributed:
      exit_now(f"error: process {jax.process_index()}: {message}")
    sys.exit(f"error: {message}")
  except Exception as e:  # pylint: disable=broad-except
    if not distributed:
      raise
    # e.g. a runtime error surfacing after a peer died: name this process and
    # exit now rather than wait at jax.distributed's shutdown barrier.
    logging.exception("process %d failed", jax.process_index())
    exit_now(f"error: process {jax.process_index()}: {type(e).__name__}: {e}")


def _one_line(e: Exception) -> str:
  """The error's message; an OSError's with the file and the fix."""
  if not isinstance(e, OSError):
    return str(e)
  if console.disk_full(e):
    return (f"disk full ({e.filename or _WORKDIR.value}); free space there, then re-run the "
            "same command to resume from the last checkpoint.")
  return (f"{e.strerror or e} ({e.filename or _WORKDIR.value}); fix that path or pass "
          "another --workdir.")


def _workdir_lock(workdir: str):
  """Held for the run's lifetime by process 0: a second run on the same
  ``--workdir`` is refused (:class:`petra_jax.training.workdir.WorkdirLock`)."""
  if jax.process_index() == 0:
    return workdir_lib.WorkdirLock(workdir)
  return contextlib.nullcontext()


def _config_argument(argv) -> tuple[int, str] | None:
  """Where ``--config``'s value is in ``argv``, and the value."""
  for i, arg in enumerate(argv[1:], 1):
    if arg.startswith("--config="):
      return i, arg
    if arg == "--config" and i + 1 < len(argv):
      return i + 1, "--config=" + argv[i + 1]
  return None


def _checked_config(argv):
  """``argv`` with ``--config=X.json`` loaded by :mod:`run_record`; exits
  with one line if the config file does not exist."""
  found = _config_argument(argv)
  if found is None:
    return argv
  i, arg = found
  value = arg[len("--config="):]
  path = value.split(":", 1)[0]
  if not os.path.isfile(path):
    why = "is not a file" if os.path.exists(path) else "does not exist"
    sys.exit(f"error: config file {path} {why}; pass --config=configs/<recipe>.py "
             "(e.g. configs/cifar10_cpu.py) or a run's WORKDIR/config.json.")
  if value.endswith(".json"):
    value = f"{run_record.__file__}:{os.path.abspath(value)}"
  argv = list(argv)
  argv[i] = "--config=" + value if argv[i].startswith("--config=") else value
  return argv


_HELP_FLAGS = ("--help", "-h", "-help", "--helpshort", "-?")
_SEE_HELP = "python -m petra_jax.train --help lists every field with its default"


def usage() -> str:
  """``--help``: the flags, then every config field with its default and meaning
  (:data:`petra_jax.config.HELP`, the one source; docs/config.md says more)."""
  lines = [
      "usage: python -m petra_jax.train --config=CONFIG [--workdir=DIR] [--restart] "
      "[--config.FIELD=VALUE ...]", "",
      "Trains and evaluates a pipelined model (PETRA and the methods it is compared with).", "",
      "flags:"]
  for name in ("config", "workdir", "restart"):
    flag = flags.FLAGS[name]
    default = f" (default: {flag.default})" if name != "config" else " (required)"
    lines.append(f"  --{name}: {flag.help}{default}")
  lines += ["  --verbosity=1: other libraries' INFO logs too; --helpfull: absl's own flags", "",
            "config fields (--config.FIELD=VALUE; defaults of petra_jax/config.py, which a "
            "recipe in configs/ changes in part; docs/config.md):"]
  defaults = config_lib.fields(config_lib.get_config())
  for field, meaning in config_lib.HELP.items():
    lines.append(f"  --config.{field}={_literal(defaults[field])}: {meaning}")
  return "\n".join(lines)


def _literal(value) -> str:
  """A default as typed on the command line."""
  if isinstance(value, tuple):
    return "'" + repr(value).replace(" ", "") + "'"
  return repr(value) if isinstance(value, str) and not value else str(value)


def _innermost(e: BaseException) -> str:
  """The message of an exception wrapped in others' ``args`` (ml_collections
  nests a KeyError's in another's), on one line."""
  while isinstance(e, BaseException) and e.args:
    e = e.args[0]
  return str(e).replace("\n", "; ")


def _field_type_line(message: str) -> Optional[str]:
  """One line for absl's ``flag --config.F=V: why``: what ``F`` takes."""
  found = re.match(r"flag --config\.([\w.]+)=(.*?): ", message)
  if not found:
    return None
  field, value = found.groups()
  defaults = config_lib.fields(config_lib.get_config())
  if field not in defaults:  # a group: --config.model=3
    return (f"--config.{field} is a group of fields; set one of them, e.g. --config.{field}."
            f"{next(k for k in config_lib.HELP if k.startswith(field + '.')).split('.')[-1]}=...; "
            f"{_SEE_HELP}.")
  default = defaults[field]
  kind = ("a tuple in quotes, e.g. '(1,2,3)' or '()'" if isinstance(default, tuple) else
          "True or False" if isinstance(default, bool) else
          {int: "an integer", float: "a number"}.get(type(default), "a string"))
  return (f"--config.{field}={value} is not {kind} ({field}: {config_lib.HELP[field]}; "
          f"default {_literal(default)}); {_SEE_HELP}.")


def _parse_flags(argv):
  """absl's flag parsing, with ``--help`` (exit 0) and a bad ``--config.*``
  override as one line."""
  if any(a in _HELP_FLAGS for a in argv[1:]):
    print(usage())
    sys.exit(0)
  if _config_argument(argv) is None:
    sys.exit("error: --config is required: pass --config=configs/<recipe>.py (e.g. "
             f"configs/cifar10_cpu.py) or a run's WORKDIR/config.json; {_SEE_HELP}.")
  argv = _checked_config(argv)
  try:
    return flags.FLAGS(argv)
  except (KeyError, AttributeError, TypeError, ValueError) as e:
    # ml_collections raises these (not flags.Error) for an unknown field or a
    # value of the wrong type; its message has a "did you mean" hint.
    sys.exit(f"error: bad config override: no field {_innermost(e)}; {_SEE_HELP}.")
  except flags.Error as e:
    # A config file's get_config(variant) refusing its argument: its one-line
    # ValueError, not the traceback ml_collections wraps it in.
    last = str(e).strip().splitlines()[-1]
    if "Error whilst parsing config file" in str(e) and last.startswith("ValueError: "):
      sys.exit(f"error: {str(e).splitlines()[0]} {last[len('ValueError: '):]}")
    line = _field_type_line(str(e))
    if line:
      sys.exit(f"error: {line}")
    sys.exit(f"error: {str(e).splitlines()[0]}; python -m petra_jax.train --help lists the "
             "flags.")


if __name__ == "__main__":
  flags.mark_flags_as_required(["config"])
  app.run(main, flags_parser=_parse_flags)
