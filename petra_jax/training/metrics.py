"""``metrics.jsonl`` (one JSON object per line, ``step`` = updates) and TensorBoard."""

from __future__ import annotations

import json
import math
import os
import shutil

import time

from tensorboardX import summary as tb_summary
from tensorboardX.event_file_writer import EventsWriter
from tensorboardX.proto import event_pb2


class MetricWriter:
  """Appends scalars to ``WORKDIR/metrics.jsonl`` and TensorBoard events.

  ``metrics.jsonl`` is first cut to ``truncate_to`` bytes (the restored
  checkpoint's offset; None: a fresh run, 0), and the TensorBoard events are
  rebuilt from the lines kept, so both hold each step once. Both are flushed
  at every line.

  Args:
    workdir: output directory (created if needed).
    enabled: False on every process but 0 in multi-process runs.
    truncate_to: bytes of ``metrics.jsonl`` to keep.
  """

  def __init__(self, workdir: str, enabled: bool = True, truncate_to: int | None = None):
    self.enabled = enabled
    if not enabled:
      return
    os.makedirs(workdir, exist_ok=True)
    self.path = os.path.join(workdir, "metrics.jsonl")
    kept = []
    if os.path.exists(self.path):
      os.truncate(self.path, min(truncate_to or 0, os.path.getsize(self.path)))
      kept = read_metrics(workdir)
    tensorboard = os.path.join(workdir, "tensorboard")
    shutil.rmtree(tensorboard, ignore_errors=True)
    os.makedirs(tensorboard)
    self._file = open(self.path, "a", encoding="utf-8")
    # Synchronous (SummaryWriter's queue thread would make a flush partial).
    self._tb = EventsWriter(os.path.join(tensorboard, "events"))
    for record in kept:
      self._add_scalars(record)
    self._tb.flush()

  def write(self, step: int, **scalars):
    """Writes one line ``{"step": step, **scalars}`` and the TensorBoard scalars."""
    if not self.enabled:
      return
    record = {"step": int(step)}
    for k, v in scalars.items():
      record[k] = v if isinstance(v, (str, int)) else float(v)
    self._file.write(json.dumps(record) + "\n")
    self._file.flush()
    self._add_scalars(record)
    self._tb.flush()

  def _add_scalars(self, record: dict):
    for k, v in record.items():
      if k != "step" and isinstance(v, float) and math.isfinite(v):
        self._event(tb_summary.scalar(k, v), record["step"])

  def _event(self, summary, step: int):
    self._tb.write_event(event_pb2.Event(summary=summary, step=step, wall_time=time.time()))

  def write_text(self, tag: str, text: str):
    """A TensorBoard text at step 0 (e.g. the config)."""
    if self.enabled:
      self._event(tb_summary.text(tag, text), 0)
      self._tb.flush()

  def offset(self) -> int:
    """Bytes of ``metrics.jsonl`` written so far (saved in checkpoints)."""
    return self._file.tell() if self.enabled else 0

  def flush(self):
    if self.enabled:
      self._file.flush()
      self._tb.flush()

  def close(self):
    if self.enabled:
      self._file.close()
      self._tb.close()


def read_metrics(workdir: str) -> list[dict]:
  """The records of ``WORKDIR/metrics.jsonl``, in order."""
  with open(os.path.join(workdir, "metrics.jsonl"), encoding="utf-8") as f:
    return [json.loads(line) for line in f if line.strip()]
