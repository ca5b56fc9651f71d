"""Graceful stop on SIGTERM / SIGINT: finish the tick, checkpoint, exit 75.

Cluster schedulers preempt a job by sending SIGTERM (then SIGKILL after a
grace period: SLURM's ``KillWait``, Kubernetes' ``terminationGracePeriodSeconds``);
a user stops one with Ctrl-C (SIGINT). ``StopOnSignal`` turns either into a
flag that the training loop polls, so that it stops at a clean point::

  with preemption.StopOnSignal() as stop:
    for tick in schedule:
      run_tick(...)
      if stop.requested:
        save_checkpoint(...)
        preemption.exit_preempted(f"preempted by {stop.signal_name} at step "
                                  f"{step}: checkpoint saved, resume with the "
                                  "same command")

* First signal: ``requested`` becomes True and one line goes to stderr; the
  process keeps running.
* A second signal of a kind in ``escalate`` (default: SIGINT only, i.e. a
  second Ctrl-C) means "stop now": the handler that was installed before is
  run for it (for SIGINT Python's, which raises ``KeyboardInterrupt``; for a
  default SIGTERM the process is killed by the signal). A second SIGTERM is
  ignored by default, because launchers may send it more than once (to the
  job script and to each task) during one preemption and the checkpoint
  being written must not be cut short.
* Handlers run in the main thread between Python bytecodes: during a long
  XLA call the flag is set when the call returns.
* On exit from the ``with`` block the previous handlers are restored.

Exit status: ``PREEMPTED_EXIT_CODE`` = 75 (``EX_TEMPFAIL`` of BSD's
``sysexits.h``, "temporary failure, retry"), chosen to be distinct from a
failure (1), a usage error (2) and death by a signal (128 + n as a shell
reports it, e.g. 143 for an unhandled SIGTERM, which may have left no
checkpoint). A launcher reads 75 as "stopped cleanly with a checkpoint:
requeue and resume", e.g. ``sbatch --requeue`` or a loop in the job script::

  python -m petra_jax.train ...; status=$?
  if [ "$status" -eq 75 ]; then scontrol requeue "$SLURM_JOB_ID"; fi

In a multi-process run each process gets its own signal at its own time:
the processes must agree on the tick at which they stop (e.g. combine their
``requested`` flags with a collective every few ticks, and stop when any is
set), or one stage leaves while its neighbours wait for it.
"""

import logging
import os
import signal
import sys
import threading
from types import FrameType
from typing import Any, Callable, NoReturn, Sequence

from tqdm import tqdm

PREEMPTED_EXIT_CODE = 75

logger = logging.getLogger(__name__)

_Handler = Callable[[int, FrameType | None], Any] | int | None


class Interrupted(BaseException):
  """A signal while :attr:`StopOnSignal.raising` (e.g. during start-up)."""

  def __init__(self, signal_name: str):
    super().__init__(signal_name)
    self.signal_name = signal_name


class StopOnSignal:
  """Turns SIGTERM and SIGINT into a "stop requested" flag (a context manager).

  Attributes:
    signals: the signals handled.
    escalate: those of ``signals`` whose second arrival runs the previous
      handler ("stop now") instead of being ignored.
  """

  def __init__(
      self,
      signals: Sequence[int] = (signal.SIGTERM, signal.SIGINT),
      escalate: Sequence[int] = (signal.SIGINT,),
      announce: bool = True,
  ):
    """Args:
      signals: signal numbers to handle.
      escalate: signal numbers whose second arrival escalates (a subset of
        ``signals``).
      announce: print one line to stderr at the first signal.

    Raises:
      ValueError: ``escalate`` holds a signal not in ``signals``, or a signal
        cannot be handled (e.g. SIGKILL).
    """
    self.signals = tuple(signal.Signals(s) for s in signals)
    self.escalate = tuple(signal.Signals(s) for s in escalate)
    if not set(self.escalate) <= set(self.signals):
      raise ValueError(f"escalate={list(self.escalate)} must be a subset of "
                       f"signals={list(self.signals)}.")
    for s in self.signals:
      if s in (signal.SIGKILL, signal.SIGSTOP):
        raise ValueError(f"{s.name} cannot be handled; pass e.g. SIGTERM, SIGINT.")
    self.announce = announce
    self.raising = False  # True: a signal raises Interrupted instead of setting the flag
    self._signum: int | None = None
    self._previous: dict[int, _Handler] = {}

  @property
  def requested(self) -> bool:
    """Whether a stop was requested (a handled signal arrived, or ``request``)."""
    return self._signum is not None

  @property
  def signal_name(self) -> str | None:
    """Name of the first signal received (``"SIGTERM"``), ``"request"`` after
    ``request()``, or None if no stop was requested."""
    if self._signum is None:
      return None
    return "request" if self._signum == 0 else signal.Signals(self._signum).name

  @property
  def installed(self) -> bool:
    """Whether the handlers are installed (False outside the ``with`` block,
    and off the main thread, where Python cannot install signal handlers)."""
    return bool(self._previous)

  def request(self) -> None:
    """Requests a stop without a signal (e.g. when another process of the run
    got one); keeps the first reason."""
    if self._signum is None:
      self._signum = 0

  def __enter__(self) -> "StopOnSignal":
    """Installs the handlers (the main thread only; elsewhere logs a warning
    and installs none: signals keep their previous effect)."""
    if threading.current_thread() is not threading.main_thread():
      logger.warning("StopOnSignal off the main thread: signals are not caught, "
                     "a SIGTERM or SIGINT stops the process as before.")
      return self
    for s in self.signals:
      self._previous[s] = signal.signal(s, self._handle)
    return self

  def __exit__(self, *exc_info) -> None:
    """Restores the handlers installed before ``__enter__``."""
    previous, self._previous = self._previous, {}
    for s, handler in previous.items():
      signal.signal(s, handler if handler is not None else signal.SIG_DFL)

  def _handle(self, signum: int, frame: FrameType | None) -> None:
    name = signal.Signals(signum).name
    if self.raising:
      self.raising = False
      raise Interrupted(name)
    if self._signum is None:
      self._signum = signum
      if self.announce:
        again = (" (again to stop at once)" if signum in self.escalate else "")
        _write_stderr(f"{name} received: stopping after the current step and "
                      f"saving a checkpoint{again}.\n")
      return
    if signum not in self.escalate:
      return
    previous = self._previous.get(signum, signal.SIG_DFL)
    if callable(previous):
      previous(signum, frame)  # e.g. Python's SIGINT handler: KeyboardInterrupt
    elif previous in (signal.SIG_DFL, None):
      _write_stderr(f"{name} received again: stopping now.\n")
      signal.signal(signum, signal.SIG_DFL)
      os.kill(os.getpid(), signum)  # the default action: terminate


def exit_preempted(message: str) -> NoReturn:
  """Prints ``message`` (one line) to stderr and exits with
  ``PREEMPTED_EXIT_CODE`` (raises ``SystemExit(75)``)."""
  tqdm.write(message, file=sys.stderr)  # (on a line of its own under a progress bar)
  sys.stderr.flush()
  sys.exit(PREEMPTED_EXIT_CODE)


def _write_stderr(text: str) -> None:
  """Writes from a signal handler without taking Python's I/O locks."""
  try:
    os.write(2, text.encode())
  except OSError:
    pass
