"""Simulated time to an accuracy: the first evaluation at or above it, times ms per update.

A run's metrics file holds one JSON object a line; evaluations carry ``"step"``
(updates done, int) and ``"test_accuracy"`` (a fraction in [0, 1]). With ``T``
ms per update (simulated, :mod:`petra_jax.benchmarks.simulate`), the time to
accuracy ``a`` is ``T * min{step : test_accuracy(step) >= a}`` ms, NaN when no
evaluation reaches ``a``. Resolution: the evaluation interval (evaluate at
least 4 times an epoch to keep it under a quarter epoch).
"""

from __future__ import annotations

import json
import math
from typing import Iterable, Sequence

TARGETS = (0.70, 0.75, 0.78, 0.80)  # the fixed accuracies of the depth study


def read_evaluations(path: str) -> list[dict]:
  """The evaluation records (those with ``test_accuracy``) of a JSON-lines metrics file,
  in step order. Raises OSError (no file) or ValueError (a line that is not JSON)."""
  with open(path) as f:
    return sorted_evaluations([json.loads(line) for line in f if line.strip()])


def sorted_evaluations(records: Iterable[dict]) -> list[dict]:
  """The records with ``test_accuracy``, in step order."""
  return sorted((r for r in records if "test_accuracy" in r), key=lambda r: r["step"])


def first_step_at(evaluations: Sequence[dict], accuracy: float) -> float:
  """The step of the first evaluation with ``test_accuracy >= accuracy`` (NaN if none)."""
  for r in evaluations:
    if r["test_accuracy"] >= accuracy:
      return float(r["step"])
  return math.nan


def seconds_to(evaluations: Sequence[dict], ms_per_update: float,
               targets: Iterable[float]) -> dict:
  """``{target: seconds}``: ``ms_per_update * first_step_at(target) / 1e3`` (NaN if never)."""
  return {a: ms_per_update * first_step_at(evaluations, a) / 1e3 for a in targets}


def ratio(a: float, b: float) -> float:
  """``a / b``, NaN when either is NaN or ``b`` is 0."""
  return a / b if b and not (math.isnan(a) or math.isnan(b)) else math.nan
