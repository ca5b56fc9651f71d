"""Device-busy time from a ``jax.profiler`` trace, and straight-line fits of tick time.

Busy time is read from the device's own events in a profile of a window the caller marks, not
from per-call blocking timings: the union of the device's event intervals, clipped to the
window, can never exceed the window, so ``busy / window <= 1`` and ``window - busy >= 0`` hold by
construction. Device events are

- on an accelerator (planes named ``/device:...``): every event on the lines of the device's
  streams (``Stream ...`` on GPUs, ``XLA Ops`` on TPUs): kernels and copies;
- on the CPU backend (the CPU is its own device): every event carrying an ``hlo_op`` statistic,
  i.e. an XLA thunk running on any thread. (On an accelerator the host's events are never
  counted: its thunk launches carry ``hlo_op`` too.)

Overlapping events (several streams, several CPU threads) count once: busy time is the time at
least one device event runs.
"""

from __future__ import annotations

import contextlib
import glob
import os
import tempfile
from typing import Iterable, Iterator, Optional, Sequence

import jax
import numpy as np

# Lines of an accelerator plane that carry its kernels and copies (GPU streams, TPU ops).
_DEVICE_LINE_PREFIXES = ("Stream", "XLA Ops")


class Window:
  """Filled by :func:`profile_window` once the ``with`` block ends.

  ``wall_ns``: length of the marked window (ns, profiler clock); ``busy_ns``: the device's busy
  time inside it (ns), ``0 <= busy_ns <= wall_ns``; ``num_events``: device events seen;
  ``kernels``: device time (ns, clipped to the window, overlaps counted per event) by event name.
  """

  def __init__(self):
    self.wall_ns = 0.0
    self.busy_ns = 0.0
    self.num_events = 0
    self.kernels: dict = {}

  @property
  def busy_fraction(self) -> float:
    """``busy_ns / wall_ns`` in [0, 1]; 0 for an empty window."""
    return self.busy_ns / self.wall_ns if self.wall_ns > 0 else 0.0


@contextlib.contextmanager
def profile_window(name: str = "petra_jax_timed_window",
                   platform: Optional[str] = None) -> Iterator[Window]:
  """Profiles the ``with`` block; the yielded :class:`Window` is filled on exit.

  ``platform``: the backend whose device events count (default ``jax.default_backend()``).

  The block must wait for its own device work (``jax.block_until_ready``) before it ends, or
  that work falls outside the window. Python tracing is off and host tracing at level 1, so the
  profile adds little host cost. Raises RuntimeError if the profile holds no window event (the
  profiler dropped it).
  """
  window = Window()
  options = jax.profiler.ProfileOptions()
  options.python_tracer_level = 0
  options.host_tracer_level = 1
  with tempfile.TemporaryDirectory(prefix="petra_jax_profile_") as log_dir:
    jax.profiler.start_trace(log_dir, profiler_options=options)
    try:
      with jax.profiler.TraceAnnotation(name):
        yield window
    finally:
      jax.profiler.stop_trace()
    data = jax.profiler.ProfileData.from_file(xplane_file(log_dir))
    measure(data, name, platform or jax.default_backend(), window)


def measure(data, name: str, platform: str, window: Optional[Window] = None) -> Window:
  """``window`` (a new one if None) filled from ``data``, a ``jax.profiler.ProfileData``: the
  host event ``name`` bounds it, ``platform``'s device events fill it. RuntimeError if no event
  is named ``name``."""
  window = Window() if window is None else window
  start, end = window_bounds(data, name)
  named = list(device_events(data, platform))
  intervals = [(lo, hi) for _, lo, hi in named]
  window.wall_ns = end - start
  window.busy_ns = union_length(intervals, start, end)
  window.num_events = len(intervals)
  window.kernels = time_by_name(named, start, end)
  return window


def platform_of(data) -> str:
  """``"gpu"``, ``"tpu"`` or ``"cpu"``: the devices whose planes a profile holds."""
  names = [plane.name for plane in data.planes]
  for platform in ("gpu", "tpu"):
    if any(n.lower().startswith(f"/device:{platform}") for n in names):
      return platform
  return "cpu"


def xplane_file(log_dir: str) -> str:
  """The newest ``.xplane.pb`` under ``log_dir``; RuntimeError if there is none."""
  found = sorted(glob.glob(os.path.join(log_dir, "**", "*.xplane.pb"), recursive=True))
  if not found:
    raise RuntimeError(f"jax.profiler wrote no .xplane.pb under {log_dir}")
  return found[-1]


def window_bounds(data, name: str) -> tuple[float, float]:
  """``(start_ns, end_ns)`` of the host event named ``name``; RuntimeError if absent."""
  for plane in data.planes:
    for line in plane.lines:
      for e in line.events:
        if e.name == name:
          return float(e.start_ns), float(e.end_ns)
  raise RuntimeError(f"the profile holds no event named {name!r}")


def named_time(data, name: str, lo: float, hi: float) -> float:
  """Total length (ns) of the events named ``name`` on any plane and line of ``data``, each
  clipped to ``[lo, hi]``; events that overlap each count."""
  return sum(max(0.0, min(float(e.end_ns), hi) - max(float(e.start_ns), lo))
             for plane in data.planes for line in plane.lines for e in line.events
             if e.name == name)


def device_intervals(data, platform: str) -> Iterable[tuple[float, float]]:
  """``(start_ns, end_ns)`` of every device event of a ``jax.profiler.ProfileData`` whose
  device is a ``platform`` one (``"cpu"``, ``"gpu"``, ``"tpu"``; module docstring)."""
  return ((lo, hi) for _, lo, hi in device_events(data, platform))


def time_by_name(events: Iterable[tuple[str, float, float]], lo: float, hi: float) -> dict:
  """``{name: ns}``: each event's length clipped to ``[lo, hi]``, summed per name, largest
  first."""
  total: dict = {}
  for name, start, end in events:
    length = min(end, hi) - max(start, lo)
    if length > 0:
      total[name] = total.get(name, 0.0) + length
  return dict(sorted(total.items(), key=lambda kv: -kv[1]))


def device_events(data, platform: str) -> Iterable[tuple[str, float, float]]:
  """``(name, start_ns, end_ns)`` of every device event (as :func:`device_intervals`)."""
  for plane in data.planes:
    on_device = plane.name.startswith("/device:")
    if on_device == (platform == "cpu"):
      continue
    for line in plane.lines:
      if on_device and not line.name.startswith(_DEVICE_LINE_PREFIXES):
        continue
      for e in line.events:
        if on_device or _is_xla_op(e):
          yield e.name, float(e.start_ns), float(e.end_ns)


def _is_xla_op(event) -> bool:
  return "hlo_op" in dict(event.stats)


def union_length(intervals: Iterable[tuple[float, float]], lo: float, hi: float) -> float:
  """Total length of the union of ``intervals`` clipped to ``[lo, hi]``; in ``[0, hi - lo]``."""
  total, reach = 0.0, lo
  for start, end in sorted((max(s, lo), min(e, hi)) for s, e in intervals):
    if end <= reach:
      continue
    total += end - max(start, reach)
    reach = end
  return total


def fit_line(micro_batches: Sequence[float], ms: Sequence[float]) -> Optional[dict]:
  """Least-squares ``ms = fixed_ms + ms_per_image * B`` over the points; None with < 2 distinct B.

  Returns ``{"fixed_ms": H, "ms_per_image": C, "micro_batches": [B...]}`` (H the fixed cost per
  tick in ms, C the cost per image in ms).
  """
  if len(set(micro_batches)) < 2:
    return None
  slope, intercept = np.polyfit(np.asarray(micro_batches, float), np.asarray(ms, float), 1)
  return {"fixed_ms": float(intercept), "ms_per_image": float(slope),
          "micro_batches": sorted(micro_batches)}
