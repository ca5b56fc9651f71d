"""Graceful stop on SIGTERM / SIGINT: finish the tick, checkpoint, exit 75.

``StopOnSignal`` turns the first signal into a flag the loop polls; a second
signal in ``escalate`` (default: a second Ctrl-C) runs the previous handler,
a repeated SIGTERM is ignored (launchers may send several). With ``raising``
(start-up) a signal raises :class:`Interrupted` at once. Handlers run in the
main thread between bytecodes, and are restored on exit from the ``with``.

Exit status 75 (``EX_TEMPFAIL``, "retry") means "stopped cleanly with a
checkpoint: requeue and resume", distinct from failure (1), usage (2) and
death by a signal (128 + n)::

  python -m petra_jax.train ...; [ $? -eq 75 ] && scontrol requeue "$SLURM_JOB_ID"
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
  """Turns SIGTERM and SIGINT into a "stop requested" flag (a context manager)."""

  def __init__(
      self,
      signals: Sequence[int] = (signal.SIGTERM, signal.SIGINT),
      escalate: Sequence[int] = (signal.SIGINT,),
      announce: bool = True,
  ):
    """Raises ValueError: ``escalate`` not a subset of ``signals``, or SIGKILL/SIGSTOP."""
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
    """Whether a handled signal arrived (or ``request`` was called)."""
    return self._signum is not None

  @property
  def signal_name(self) -> str | None:
    """``"SIGTERM"``, ``"request"`` or None."""
    if self._signum is None:
      return None
    return "request" if self._signum == 0 else signal.Signals(self._signum).name

  @property
  def installed(self) -> bool:
    """Whether the handlers are installed (never off the main thread)."""
    return bool(self._previous)

  def request(self) -> None:
    """Requests a stop without a signal; keeps the first reason."""
    if self._signum is None:
      self._signum = 0

  def __enter__(self) -> "StopOnSignal":
    """Installs the handlers (main thread only; elsewhere warns)."""
    if threading.current_thread() is not threading.main_thread():
      logger.warning("StopOnSignal off the main thread: signals are not caught, "
                     "a SIGTERM or SIGINT stops the process as before.")
      return self
    for s in self.signals:
      self._previous[s] = signal.signal(s, self._handle)
    return self

  def __exit__(self, *exc_info) -> None:
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
  """Prints ``message`` to stderr and raises ``SystemExit(75)``."""
  tqdm.write(message, file=sys.stderr)  # (on a line of its own under a progress bar)
  sys.stderr.flush()
  sys.exit(PREEMPTED_EXIT_CODE)


def _write_stderr(text: str) -> None:
  """Writes from a signal handler without taking Python's I/O locks."""
  try:
    os.write(2, text.encode())
  except OSError:
    pass
