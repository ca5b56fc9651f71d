"""Metric writing: ``metrics.jsonl`` (one JSON object per line) and TensorBoard.

Keys use ``train_`` / ``test_`` prefixes; every line carries ``step`` (optimizer
updates so far) and ``epoch``.
"""

from __future__ import annotations

import json
import math
import os

from tensorboardX import SummaryWriter


class MetricWriter:
  """Appends scalars to ``WORKDIR/metrics.jsonl`` and TensorBoard events.

  Args:
    workdir: output directory (created if needed).
    enabled: False on every process but 0 in multi-process runs.
    truncate_to: on resume, cut ``metrics.jsonl`` to this many bytes first.
  """

  def __init__(self, workdir: str, enabled: bool = True, truncate_to: int | None = None):
    self.enabled = enabled
    if not enabled:
      return
    os.makedirs(workdir, exist_ok=True)
    self.path = os.path.join(workdir, "metrics.jsonl")
    if truncate_to is not None and os.path.exists(self.path):
      # Resuming: drop lines written after the checkpoint (they will be rewritten).
      os.truncate(self.path, truncate_to)
    self._file = open(self.path, "a", encoding="utf-8")
    self._tb = SummaryWriter(os.path.join(workdir, "tensorboard"))

  def write(self, step: int, **scalars):
    """Writes one line ``{"step": step, **scalars}`` and the TensorBoard scalars."""
    if not self.enabled:
      return
    record = {"step": int(step)}
    for k, v in scalars.items():
      record[k] = v if isinstance(v, (str, int)) else float(v)
    self._file.write(json.dumps(record) + "\n")
    self._file.flush()
    for k, v in record.items():
      if k != "step" and isinstance(v, float) and math.isfinite(v):
        self._tb.add_scalar(k, v, step)

  def offset(self) -> int:
    """Bytes of ``metrics.jsonl`` written so far (saved in checkpoints)."""
    return self._file.tell() if self.enabled else 0

  def close(self):
    if self.enabled:
      self._file.close()
      self._tb.close()


def read_metrics(workdir: str) -> list[dict]:
  """The records of ``WORKDIR/metrics.jsonl``, in order."""
  with open(os.path.join(workdir, "metrics.jsonl"), encoding="utf-8") as f:
    return [json.loads(line) for line in f if line.strip()]
