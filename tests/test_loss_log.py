"""The training-loss log reads each line one line late: the host never waits for the
losses it has just dispatched, and every line is written by the end."""

import jax.numpy as jnp
import numpy as np
import pytest

from petra_jax.training.loss_log import Diverged, LossLog


class _Writer:
  def __init__(self):
    self.rows = []

  def write(self, step, **values):
    self.rows.append((step, values))


def _log(k=2, log_every=2):
  writer = _Writer()
  return LossLog(writer, k, log_every, steps_per_epoch=10, schedule=lambda s: 0.1), writer


class _Unreadable:
  """A loss whose reading fails: the log must not read it yet."""

  def __array__(self, *args, **kwargs):
    raise AssertionError("read too early")


def test_a_line_is_read_once_the_next_line_is_complete():
  log, writer = _log()
  losses = [jnp.float32(v) for v in (1.0, 2.0, 3.0, 4.0)]  # updates 1-2: line at step 2
  for m, loss in enumerate(losses):
    log.add(m, loss)
  assert writer.rows == []
  for m in range(4, 7):  # updates 3-4 not complete yet
    log.add(m, jnp.float32(10.0))
  assert writer.rows == []
  log.add(7, jnp.float32(10.0))  # line 2 complete: line 1 is read
  assert [s for s, _ in writer.rows] == [2]
  assert writer.rows[0][1]["train_loss"] == pytest.approx(np.mean([1.0, 2.0, 3.0, 4.0]))


def test_the_newest_line_is_not_read_until_finish():
  log, writer = _log(k=1, log_every=1)
  log.add(0, jnp.float32(1.0))
  log.add(1, _Unreadable())  # the newest complete line: not read while training
  with pytest.raises(AssertionError, match="read too early"):
    log.finish(2)


def test_finish_and_state_write_every_complete_line():
  log, writer = _log(k=1, log_every=1)
  for m in range(3):
    log.add(m, jnp.float32(m))
  assert [s for s, _ in writer.rows] == [1, 2]
  meta, arrays = log.state()
  assert [s for s, _ in writer.rows] == [1, 2, 3] and meta["window"] == 0 and not arrays
  log.finish(3)
  assert [s for s, _ in writer.rows] == [1, 2, 3]


def test_a_nan_line_raises_with_its_first_update_by_the_next_line():
  log, _ = _log(k=1, log_every=2)
  log.add(0, jnp.float32(1.0))
  log.add(1, jnp.float32(np.nan))  # line at step 2 (updates 1-2)
  log.add(2, jnp.float32(1.0))
  with pytest.raises(Diverged) as e:
    log.add(3, jnp.float32(1.0))
  assert e.value.step == 1


def test_lines_completed_by_one_call_wait_for_the_next_call():
  """A compiled call runs several updates: the lines its losses complete are not read until
  a later call's losses arrive (reading them would wait for the call just dispatched)."""
  log, writer = _log(k=1, log_every=1)
  log.begin_call()
  for m in range(4):  # one call: updates 1-4, four complete lines
    log.add(m, _Unreadable() if m else jnp.float32(1.0))
  assert writer.rows == []  # not even line 1: its call is the newest
  log.begin_call()
  with pytest.raises(AssertionError, match="read too early"):  # now lines 1-3 may be read
    log.add(4, jnp.float32(5.0))
  assert [s for s, _ in writer.rows] == [1]


def test_without_calls_a_line_is_still_read_one_line_late():
  log, writer = _log(k=1, log_every=1)
  log.begin_call()  # the host executor: one tick a call, here every loss in one call
  log.add(0, jnp.float32(1.0))
  log.begin_call()
  log.add(1, jnp.float32(2.0))
  assert [s for s, _ in writer.rows] == [1]
