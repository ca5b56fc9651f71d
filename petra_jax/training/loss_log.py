"""The training-loss log: per-micro-batch losses in, ``train_loss`` lines out.

:class:`LossLog` turns losses into lines (process 0 writes them);
:class:`LossRelay` brings a multi-process run's losses from the last stage's
process to process 0's log, batched.
"""

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

  A batch's line is written once its k losses exist; PETRA's arrive ``J-1``
  ticks after their micro-batch entered. Converting them to floats then costs
  no wait: those ticks have been dispatched long since. Each line holds the
  mean of the float32 losses of the ``log_every`` updates since the last one.

  Args:
    writer: a :class:`petra_jax.training.metrics.MetricWriter`.
    k: micro-batches per update (``accumulation_steps``).
    log_every: updates between lines.
    steps_per_epoch: updates per epoch (the lines' ``epoch``).
    schedule: ``update count -> learning rate`` (the lines' ``learning_rate``).
  """

  def __init__(self, writer, k, log_every, steps_per_epoch, schedule):
    self.writer, self.k, self.log_every = writer, k, log_every
    self.steps_per_epoch, self.schedule = steps_per_epoch, schedule
    self.losses: dict[int, jax.Array] = {}
    self.next_step = 0
    self.window: list = []
    self.last_loss = float("nan")

  def add(self, micro_batch: int, loss: jax.Array):
    """Records micro-batch ``micro_batch``'s loss; writes the lines now complete.

    Raises:
      Diverged: a written mean is NaN/Inf.
    """
    self.losses[micro_batch] = loss
    self._flush()

  def _flush(self, final_step: int | None = None):
    while all(self.next_step * self.k + i in self.losses for i in range(self.k)):
      s = self.next_step
      self.window.extend(self.losses.pop(s * self.k + i) for i in range(self.k))
      self.next_step += 1
      if self.next_step % self.log_every == 0 or self.next_step == final_step:
        self._write(s + 1)

  def _write(self, step):
    value = float(np.mean(jax.device_get(self.window)))
    first = step - len(self.window) // self.k + 1  # the window's first update
    self.window = []
    if not math.isfinite(value):
      raise Diverged(value, first)
    self.last_loss = value
    self.writer.write(step, epoch=step / self.steps_per_epoch, train_loss=value,
                      learning_rate=float(self.schedule(step - 1)))

  def finish(self, final_step):
    """Writes what is left after the last update ``final_step``."""
    self._flush(final_step)
    if self.window:
      self._write(self.next_step)

  def check_finite(self):
    """Raises :class:`Diverged` if a loss received but not yet written is
    NaN/Inf (a host sync). After it, every update before ``next_step`` is
    known finite."""
    window = np.asarray(jax.device_get(self.window))
    if window.size and not np.all(np.isfinite(window)):
      bad = int(np.argmin(np.isfinite(window)))
      raise Diverged(window[bad], self.next_step - len(window) // self.k + bad // self.k + 1)
    for m, loss in sorted(self.losses.items()):
      if not math.isfinite(float(loss)):
        raise Diverged(float(loss), m // self.k + 1)

  def state(self):
    """``(json, arrays)``: what a checkpoint needs to resume the log exactly."""
    arrays = dict(self.losses)
    arrays.update({-(i + 1): v for i, v in enumerate(self.window)})
    return {"next_step": self.next_step, "window": len(self.window),
            "last_loss": self.last_loss}, arrays

  def restore(self, meta, arrays):
    """Back to a checkpoint's :meth:`state`."""
    self.next_step, self.last_loss = meta["next_step"], meta["last_loss"]
    self.window = [arrays[-(i + 1)] for i in range(meta["window"])]
    self.losses = {m: v for m, v in arrays.items() if m >= 0}


class LossRelay:
  """The losses on their way to the :class:`LossLog` of process 0.

  One process: every loss goes to the log as it arrives (``move`` None).
  Multi-process: the last stage computes the losses on its own process;
  they wait there and cross to process 0 in one transfer per :meth:`flush`
  (a float32 vector, the same values bit for bit), instead of one transfer
  per tick. Every process calls :meth:`add` for every loss task (its loss,
  or None where it is not this process's) and :meth:`flush` at the same
  points, so both ends agree on the vector's length.

  Args:
    loss_log: process 0's :class:`LossLog` (unused elsewhere).
    move: ``(vector or None, spec) -> vector on process 0 or None``: the
      pipeline's message route from the last stage to stage 0
      (``Messenger.move``); None for one process.
  """

  def __init__(self, loss_log: LossLog, move: Optional[Callable] = None):
    self.loss_log, self.move = loss_log, move
    self.pending: list = []  # (micro_batch, loss or None), in arrival order

  def add(self, micro_batch: int, loss: Optional[jax.Array]):
    """Micro-batch ``micro_batch``'s float32 scalar loss (None off the last
    stage's process). One process: straight to the log.

    Raises:
      Diverged: a line written now has a NaN/Inf mean (process 0).
    """
    if self.move is None:
      if loss is not None:
        self.loss_log.add(micro_batch, loss)
      return
    self.pending.append((micro_batch, loss))

  def flush(self):
    """Sends the pending losses to process 0's log (multi-process: every
    process at the same point; a transfer between the last stage's process
    and process 0, asynchronous like any other message).

    Raises:
      Diverged: a line written now has a NaN/Inf mean (process 0).
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
