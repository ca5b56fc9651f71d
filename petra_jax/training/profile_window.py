"""Updates of a run traced with ``jax.profiler``: ``--config.profile_steps=START:STOP``.

The trace (XPlane: TensorBoard's profile tab reads it, and so does
:mod:`petra_jax.benchmarks.device_time`) goes to ``WORKDIR/profile``
(``WORKDIR/profile/process_<i>`` in a run of several processes). The window holds whole
executor calls, as a compiled call runs many updates: the trace starts after the first call
that reaches update ``START`` and stops after the first call that reaches ``STOP`` (the next
call if that one did too), once that call's state is computed: the window's one wait on the
device. A run that ends inside the window stops the trace as it ends. In the trace, a host
event :data:`WINDOW_EVENT` spans the window's calls as the host ran them (not that last wait),
:data:`CALL_EVENT` each executor call and :data:`BATCHES_EVENT` each micro-batch the loop takes
from its batch source (waits included).
"""

from __future__ import annotations

import os
from typing import Callable, Optional

from absl import logging
import jax

WINDOW_EVENT = "petra_jax_profile_window"
CALL_EVENT = "petra_jax_executor_call"
BATCHES_EVENT = "petra_jax_batches"

def parse(spec: str) -> Optional[tuple[int, int]]:
  """``"START:STOP"`` -> ``(START, STOP)`` in updates; ``""`` -> None (no trace).

  Raises:
    ValueError: not two integers with ``0 <= START < STOP``.
  """
  if not spec:
    return None
  try:
    start, stop = (int(part) for part in spec.split(":"))
  except ValueError:
    start = stop = -1
  if not 0 <= start < stop:
    raise ValueError(f"profile_steps must be 'START:STOP', two update counts with "
                     f"0 <= START < STOP, got {spec!r}: e.g. --config.profile_steps=100:120, "
                     "or '' for no trace.")
  return start, stop


def traced(fn: Callable, name: str) -> Callable:
  """``fn`` with each call inside a host event ``name`` of a trace (about 0.25 µs a call on
  the 2-core dev CPU while none is taken)."""
  def call(*args):
    with jax.profiler.TraceAnnotation(name):
      return fn(*args)
  return call


def trace_dir(workdir: str) -> str:
  """Where this process's trace goes."""
  if jax.process_count() > 1:
    return os.path.join(workdir, "profile", f"process_{jax.process_index()}")
  return os.path.join(workdir, "profile")


class ProfileWindow:
  """The trace of one window of a run; a context manager that stops it at exit.

  Call :meth:`after_call` after each executor call with the updates run so far and the
  state it returned (a ``PipelineState``). A run resumed at update ``step >= STOP`` traces
  nothing. Raises ValueError for a bad ``spec`` (:func:`parse`).
  """

  def __init__(self, spec: str, workdir: str, step: int = 0):
    self._bounds = parse(spec)
    self._dir = trace_dir(workdir)
    self._tracing = False
    self._done = self._bounds is None or step >= self._bounds[1]

  def __enter__(self) -> "ProfileWindow":
    return self

  def __exit__(self, *exc_info) -> None:
    if self._tracing:
      self._stop(state=None)

  def after_call(self, step: int, state) -> None:
    """Starts the trace once ``step >= START``; stops it after a traced call reaching STOP."""
    if self._done:
      return
    start, stop = self._bounds
    if not self._tracing and step >= start:
      options = jax.profiler.ProfileOptions()
      options.python_tracer_level = 0  # (Python's own calls: a large host cost of its own)
      jax.profiler.start_trace(self._dir, profiler_options=options)
      self._annotation = jax.profiler.TraceAnnotation(WINDOW_EVENT)
      self._annotation.__enter__()
      self._tracing, self._first_step = True, step
    elif self._tracing and step >= stop:
      self._stop(state)
      logging.info("profile of updates %d to %d: %s", self._first_step, step, self._dir)

  def _stop(self, state) -> None:
    """Ends the window's event, waits for ``state`` (if any: the window's device work into the
    trace), stops the trace."""
    self._annotation.__exit__(None, None, None)
    if state is not None:
      state.block_until_ready()
    jax.profiler.stop_trace()
    self._tracing, self._done = False, True
