"""The training-loss log: per-micro-batch losses in, ``train_loss`` lines out."""

from __future__ import annotations

import math
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np


class Diverged(FloatingPointError):
  """A NaN or Inf training loss; ``step`` is the first update it affects."""

  def __init__(self, value, step: int):
    super().__init__(f"train_loss is {value} at step {step}: training diverged; lower "
                     "--config.optim.learning_rate or raise --config.optim.warmup_epochs.")
    self.step = step


class LossLog:
  """Collects per-micro-batch losses (device scalars) and writes train lines.

  A line is the float32 mean over the ``log_every`` updates since the last
  line. It is read from the device one line late and one call late (once the
  next line's losses exist and a later executor call's losses arrive, marked
  by :meth:`begin_call`; or at :meth:`finish`, :meth:`check_finite` and
  :meth:`state`), so the host never waits for the computation it has just
  dispatched, even when one call completes several lines.
  """

  def __init__(self, writer, k, log_every, steps_per_epoch, schedule):
    self.writer, self.k, self.log_every = writer, k, log_every
    self.steps_per_epoch, self.schedule = steps_per_epoch, schedule
    self.losses: dict[int, jax.Array] = {}
    self.next_step = 0
    self.window: list = []
    self.lines: list = []  # (step, window, call) complete, not yet read
    self.call = None  # the executor call whose losses arrive now (:meth:`begin_call`)
    self.read_step = 0  # the update of the last line read: every update to it has run
    self.last_loss = float("nan")

  def begin_call(self):
    """The losses added from now on come from a new executor call: the lines completed
    before it may be read (their call has been followed by another dispatch)."""
    self.call = 0 if self.call is None else self.call + 1

  def add(self, micro_batch: int, loss: jax.Array):
    """Records a loss; raises Diverged if a line written now is NaN/Inf."""
    self.losses[micro_batch] = loss
    self._flush()

  def _flush(self, final_step: int | None = None):
    while all(self.next_step * self.k + i in self.losses for i in range(self.k)):
      s = self.next_step
      self.window.extend(self.losses.pop(s * self.k + i) for i in range(self.k))
      self.next_step += 1
      if self.next_step % self.log_every == 0 or self.next_step == final_step:
        self.lines.append((s + 1, self.window, self.call))
        self.window = []
    self._write_lines(keep=1)

  def _write_lines(self, keep: int = 0):
    """Reads and writes the complete lines but the newest ``keep``; while training
    (``keep``), none completed by the current call."""
    while len(self.lines) > keep and not (keep and self.call is not None
                                          and self.lines[0][2] == self.call):
      step, window, _ = self.lines.pop(0)
      self._write(step, window)

  def _write(self, step, window):
    value = float(np.mean(jax.device_get(window)))
    first = step - len(window) // self.k + 1
    if not math.isfinite(value):
      raise Diverged(value, first)
    self.last_loss, self.read_step = value, step
    self.writer.write(step, epoch=step / self.steps_per_epoch, train_loss=value,
                      learning_rate=float(self.schedule(step - 1)))

  def finish(self, final_step):
    """Writes what is left after the last update ``final_step``."""
    self._flush(final_step)
    if self.window:
      self.lines.append((self.next_step, self.window, self.call))
      self.window = []
    self._write_lines()

  def check_finite(self):
    """Raises :class:`Diverged` if a pending loss is NaN/Inf (a host sync)."""
    self._write_lines()
    window = np.asarray(jax.device_get(self.window))
    if window.size and not np.all(np.isfinite(window)):
      bad = int(np.argmin(np.isfinite(window)))
      raise Diverged(window[bad], self.next_step - len(window) // self.k + bad // self.k + 1)
    for m, loss in sorted(self.losses.items()):
      if not math.isfinite(float(loss)):
        raise Diverged(float(loss), m // self.k + 1)

  def state(self):
    """``(json, arrays)``: what a checkpoint needs to resume the log exactly (every
    complete line written first)."""
    self._write_lines()
    arrays = dict(self.losses)
    arrays.update({-(i + 1): v for i, v in enumerate(self.window)})
    return {"next_step": self.next_step, "window": len(self.window),
            "last_loss": self.last_loss}, arrays

  def restore(self, meta, arrays):
    """Back to a checkpoint's :meth:`state`."""
    self.next_step, self.last_loss = meta["next_step"], meta["last_loss"]
    self.window = [arrays[-(i + 1)] for i in range(meta["window"])]
    self.read_step = self.next_step - len(self.window) // self.k
    self.losses = {m: v for m, v in arrays.items() if m >= 0}


class LossRelay:
  """The losses on their way to process 0's :class:`LossLog`.

  One process (``move`` None): straight to the log. Multi-process: they wait
  on the last stage's process and cross in one float32 vector per
  :meth:`flush`; every process calls :meth:`add` and :meth:`flush` at the
  same points.
  """

  def __init__(self, loss_log: LossLog, move: Optional[Callable] = None):
    self.loss_log, self.move = loss_log, move
    self.pending: list = []  # (micro_batch, loss or None), in arrival order

  def add(self, micro_batch: int, loss: Optional[jax.Array]):
    """A float32 scalar loss (None off the last stage's process)."""
    if self.move is None:
      if loss is not None:
        self.loss_log.add(micro_batch, loss)
      return
    self.pending.append((micro_batch, loss))

  def flush(self):
    """Sends the pending losses to process 0 (every process, same point);
    raises Diverged if a line written now is NaN/Inf.
    """
    if not self.pending:
      return
    batches = [m for m, _ in self.pending]
    losses = [loss for _, loss in self.pending]
    self.pending = []
    vector = jnp.stack(losses) if losses[0] is not None else None
    received = self.move(vector, jax.ShapeDtypeStruct((len(batches),), jnp.float32))
    if received is None:  # not process 0
      return
    for m, loss in zip(batches, list(received)):
      self.loss_log.add(m, loss)
