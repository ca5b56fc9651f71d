"""Links, the simulator with message costs, and time to accuracy from a metrics file,
against hand computations."""

import json
import math

import pytest

from petra_jax.benchmarks import links, simulate
from petra_jax.engine.schedules import Schedule
from petra_jax.studies import time_to_accuracy as tta


def test_message_ms_by_hand():
  """9 MB over NVLink 4: 2 us + 9e6 / 900e9 s = 0.002 + 0.01 ms; over PCIe 5: 0.005 +
  0.140625 ms; 100 Gb/s: 0.015 + 0.72 ms."""
  assert links.message_ms(9e6, "nvlink4") == pytest.approx(0.012)
  assert links.message_ms(9e6, "pcie5_x16") == pytest.approx(0.145625)
  assert links.message_ms(9e6, "ethernet_100g") == pytest.approx(0.735)
  assert links.stage_send_ms([0, 9e6], "nvlink4") == pytest.approx([0.0, 0.012])
  with pytest.raises(ValueError, match="Unknown link"):
    links.message_ms(1, "carrier_pigeon")


@pytest.mark.parametrize("recompute", [False, True])
def test_gpipe_one_micro_batch_with_link_costs_by_hand(recompute):
  """GPipe, J = 2, one micro-batch: F0, send, loss (B1), send back, B0 (with recomputation
  B0 + F0): makespan = F0 + s + B1 + s + B0 (+ F0), s a 1 MB message over PCIe 5."""
  f, b = [2.0, 3.0], [5.0, 7.0]
  s = links.message_ms(1e6, "pcie5_x16")  # 0.005 + 1e3 * 1e6 / 64e9 = 0.020625 ms
  assert s == pytest.approx(0.020625)
  back = [b[0] + f[0] if recompute else b[0], b[1]]
  out = simulate.simulate(Schedule("gpipe", 2, 1, 1), f, back, [s, s], [s, s])
  assert out["makespan_ms"] == pytest.approx(f[0] + s + b[1] + s + back[0])
  assert out["busy_ms"] == pytest.approx([f[0] + back[0], b[1]])


def test_time_to_accuracy_from_a_fake_metrics_file(tmp_path):
  """Evaluations at steps 10, 20, 30 (68, 76, 79 %), a training record between; 50 ms per
  update: 75 % at step 20 = 1 s, 78 % at step 30 = 1.5 s, 80 % never (NaN)."""
  path = tmp_path / "metrics.jsonl"
  rows = [{"step": 20, "test_accuracy": 0.76}, {"step": 5, "loss": 2.0},
          {"step": 10, "test_accuracy": 0.68}, {"step": 30, "test_accuracy": 0.79}]
  path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
  evals = tta.read_evaluations(str(path))
  assert [r["step"] for r in evals] == [10, 20, 30]
  got = tta.seconds_to(evals, 50.0, tta.TARGETS)
  assert got[0.70] == pytest.approx(1.0) and got[0.75] == pytest.approx(1.0)
  assert got[0.78] == pytest.approx(1.5) and math.isnan(got[0.80])
  assert tta.ratio(1.0, 2.0) == 0.5 and math.isnan(tta.ratio(got[0.80], 1.0))
