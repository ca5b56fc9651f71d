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


# -- the depth study's simulated time (petra_jax.studies.depth_time) -------------------------

MB = 6.4e6  # bytes: 0.105 ms over PCIe 5 x16 (5 us + 6.4e6 / 64e9 s), 12.8e6 bytes 0.205 ms


def test_schedule_ms_with_link_costs_by_hand():
  """J = 3, k = 2 over PCIe 5 x16, s = 0.105 ms a 6.4 MB message, s2 = 0.205 ms PETRA's doubled
  one (stage 1 is reversible: the message to it carries its output and the cotangent).

  PETRA (F = 1, 1, 1; B = 2, 2, 3.5): each stage's tick is F + B plus its sends, k per update:
  2 max(1 + 2 + s, 1 + 2 + 2 s, 3.5 + s2) = 2 x 3.705 = 7.41 ms.
  GPipe recomputing (F = 1, 1; B = 3, 3; the last stage's loss 2), one flushed round:
  F(0,0) [0, 1], F(0,1) [1+s, 2+s]; F(1,0) [1+s, 2+s], F(1,1) [2+2s, 3+2s]; L(2,0)
  [2+2s, 4+2s], L(2,1) [4+3s, 6+3s]; B(1,0) [4+3s, 7+3s], B(1,1) [7+4s, 10+4s]; B(0,0)
  [7+4s, 10+4s], B(0,1) [10+5s, 13+5s]: 13 + 5 s = 13.525 ms. Storing (B - F = 2, 2): B(1,0)
  [4+3s, 6+3s], B(1,1) [6+4s, 8+4s], B(0,0) [6+4s, 8+4s], B(0,1) [8+5s, 10+5s]: 10.525 ms."""
  from petra_jax.studies import depth_time
  s = links.message_ms(MB, "pcie5_x16")
  assert s == pytest.approx(0.105)
  stage_ms = {"stream": [[1.0, 1.0, 1.0], [2.0, 2.0, 3.5]],
              "stored": [[1.0, 1.0, 1.0], [3.0, 3.0, 2.0]]}
  nbytes = {"forward": [MB, MB, 0], "stream_backward": [0, MB, 2 * MB],
            "stored_backward": [0, MB, MB]}
  got = depth_time.schedule_ms(stage_ms, nbytes, 2, "pcie5_x16")
  assert got["petra"] == pytest.approx(7.41)
  assert got["gpipe_rc"] == pytest.approx(13 + 5 * s)
  assert got["gpipe"] == pytest.approx(10 + 5 * s)
  # Every cost x1.2 on PETRA alone: 2 max(3.6 + s, 3.6 + 2 s, 4.2 + s2) = 8.81 ms.
  assert depth_time.schedule_ms(stage_ms, nbytes, 2, "pcie5_x16", petra_scale=1.2)[
      "petra"] == pytest.approx(8.81)


def test_message_bytes_are_the_products_of_the_shapes():
  """tiny_revnet on [4, 16, 16, 3]: stem, rev0 output two streams [4, 16, 16, 2] (float32:
  2 x 4 x 16 x 16 x 2 x 4 = 16384 B), down and rev1 two [4, 8, 8, 4] (8192 B). PETRA's message
  back to a reversible stage (rev0 from down, rev1 from head) also carries its output."""
  from helpers import tiny_revnet
  from petra_jax.studies import depth_time
  big, small = 2 * 4 * 16 * 16 * 2 * 4, 2 * 4 * 8 * 8 * 4 * 4
  got = depth_time.message_bytes(tiny_revnet(), (4, 16, 16, 3))
  assert got == {"forward": [big, big, small, small, 0],
                 "stream_backward": [0, big, 2 * big, small, 2 * small],
                 "stored_backward": [0, big, big, small, small]}


def _write(path, evals):
  """A metrics file: a training line, then ``(step, accuracy)`` evaluations at 400 updates an
  epoch."""
  rows = [{"step": 1, "train_loss": 2.0}] + [
      {"step": s, "epoch": s / 400, "test_accuracy": a} for s, a in evals]
  path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
  return tta.read_evaluations(str(path))


def test_time_table_from_fake_metrics_files_by_hand(tmp_path):
  """Evaluations every 100 updates (4 an epoch of 400). J = 2, k = 1, messages free:
  PETRA max(F0 + B0, B1) = 200 ms an update, GPipe recomputing F0 + L + B0 = 400 ms, storing
  (B0 - F0 = 0) 300 ms. Seed 0: PETRA at 70/75/78 % after 100/200/300 updates (20, 40, 60 s),
  never 80 % or the reference's final 81 %; the reference at 100/200/200/300/400 (GPipe
  recomputing 40, 80, 80, 120, 160 s). Seed 1: PETRA 78 % at 400 (80 s), the reference at 300
  (120 s); seed 2: PETRA never 78 %. PETRA / GPipe recomputing at 78 %, seeds 0 and 1:
  (60 + 80) / (80 + 120) = 0.7; storing (60 + 80) / (60 + 90) = 0.933."""
  from petra_jax.studies import depth_time
  ref = [(100, 0.72), (200, 0.78), (300, 0.80), (400, 0.81)]
  refs = {0: ref, 1: [(100, 0.72), (200, 0.77), (300, 0.78), (400, 0.80)], 2: ref}
  petra = {0: [(100, 0.70), (200, 0.76), (300, 0.785), (400, 0.79)],
           1: [(200, 0.72), (400, 0.78)], 2: [(400, 0.77)]}
  pairs = []
  for seed, evals in petra.items():
    row = _write(tmp_path / f"p{seed}.jsonl", evals)
    base = _write(tmp_path / f"r{seed}.jsonl", refs[seed])
    pairs.append({"row": {"row": "petra_J2_k1_muon", "seed": seed, "records": row,
                          "test_accuracy": row[-1]["test_accuracy"]},
                  "reference": {"row": "revprop_muon", "seed": seed, "records": base,
                                "test_accuracy": base[-1]["test_accuracy"]}})
  stage_ms = {"stream": [[100.0, 100.0], [100.0, 200.0]],
              "stored": [[100.0, 100.0], [100.0, 200.0]]}
  nbytes = {key: [0, 0] for key in ("forward", "stream_backward", "stored_backward")}
  ms = depth_time.schedule_ms(stage_ms, nbytes, 1, "nvlink4")
  assert [ms[s] for s in ("petra", "gpipe_rc", "gpipe")] == pytest.approx([200, 400, 300])
  got = depth_time.seed_seconds(pairs[0], ms)
  assert got["petra"][:3] == pytest.approx([20, 40, 60]) and math.isnan(got["petra"][3])
  assert math.isnan(got["petra"][4])  # the reference's final 81 %
  assert got["gpipe_rc"] == pytest.approx([40, 80, 80, 120, 160])
  assert depth_time.headline_ratio(pairs, ms, "gpipe_rc") == pytest.approx(0.7)
  assert depth_time.headline_ratio(pairs, ms, "gpipe") == pytest.approx(140 / 150)
  assert depth_time.evaluations_per_epoch(pairs[0]["row"]["records"]) == 4
  entry = {"row": "petra_J2_k1_muon", "stage_ms": stage_ms, "bytes": nbytes, "k": 1,
           "split": (5, 5), "pairs": pairs}
  table = depth_time.link_table("nvlink4", [entry])
  cells = [[c.strip() for c in l.strip("|").split("|")] for l in table if l.startswith("| `")]
  assert cells[0] == ["`petra_J2_k1_muon`", "0", "4 / 4", "`revprop_muon` 81.0", "PETRA",
                      "200.0", "20", "40", "60", "never", "never"]
  assert cells[1][4:] == ["GPipe, recomputing", "400.0", "40", "80", "80", "120", "160"]
  ratios = depth_time.ratio_table([entry])
  assert ratios[2].split("|")[3].strip() == "0.70"  # nvlink4, against GPipe recomputing


def test_balanced_row_splits_on_the_blocks_measured_costs(tmp_path):
  """Blocks (tokenizer, 8 halves, head) costing 6, 5, 5, 5, 5, 5, 2, 2, 2, 6 ms a tick in 8
  stages: the slowest can be no faster than 6 ms (an end block), and only the three 2-ms blocks
  merged (6 ms) keep it there: (1, 1, 1, 1, 1, 1, 3, 1), not the default (2, 1, ..., 1, 2)."""
  import argparse
  from helpers import REPO
  from petra_jax.studies import depth
  from petra_jax.training import validation
  args = argparse.Namespace(recipe=f"{REPO}/configs/cifar10_vit_cpu.py", epochs=6,
                            steps_per_epoch=0, data_dir="", workdir=str(tmp_path),
                            finished_only=True)
  row = "petra_J8_k4_muon_prediction_balanced"
  with pytest.raises(ValueError, match="no block costs"):
    depth.row_config(args, row, 0)
  costs = [6.0, 5.0, 5.0, 5.0, 5.0, 5.0, 2.0, 2.0, 2.0, 6.0]
  (tmp_path / "block_ms_petra_J8_k4_muon_prediction.json").write_text(json.dumps(
      {"stream": [[1.0] * 10, [c - 1.0 for c in costs[:-1]] + [costs[-1]]],
       "stored": [[1.0] * 10, [1.0] * 10]}))
  config = depth.row_config(args, row, 0)
  assert tuple(config.model.stage_sizes) == (1, 1, 1, 1, 1, 1, 3, 1)
  assert tuple(depth.row_config(args, row[:-len("_balanced")], 0).model.stage_sizes) == (
      depth.SPLITS[8])
  assert config.evals_per_epoch == depth.EVALS_PER_EPOCH == 4
  assert depth.describe(row) == depth.describe("petra_J8_k4_muon_prediction")
  validation.validate_config(config, 1)
  with pytest.raises(ValueError, match="_balanced"):
    depth.row_config(args, "revprop_muon_balanced", 0)


def test_evaluations_a_quarter_epoch_apart():
  """390 updates an epoch, 4 evaluations: after updates ceil(97.5) = 98, 195, ceil(292.5) =
  293 and 390 of each evaluated epoch; the loop's hooks evaluate there (eval_every = 1)."""
  import types
  from petra_jax.training import loop
  assert loop.evaluation_offsets(390, 4) == [98, 195, 293, 390]
  assert loop.evaluation_offsets(390, 1) == [390] and loop.evaluation_offsets(2, 4) == [1, 2]
  run = types.SimpleNamespace(steps_per_epoch=390, total_steps=780, config=types.SimpleNamespace(
      eval_every=1, evals_per_epoch=4, log_every=1000, checkpoint_every=0))
  due = [s for s in range(1, 780) if loop._due(run, s).evaluate]  # pylint: disable=protected-access
  assert due == [98, 195, 293, 390, 488, 585, 683]
  assert loop._next_due_step(run, 98) == 195  # pylint: disable=protected-access
  assert loop._next_due_step(run, 390) == 488  # pylint: disable=protected-access
  run.config.log_every = 1  # a train_loss line reads losses only: no call ends there
  assert loop._next_due_step(run, 98) == 195  # pylint: disable=protected-access
  run.config.eval_every = 2
  assert [s for s in range(1, 780) if loop._due(run, s).evaluate] == [  # pylint: disable=protected-access
      488, 585, 683]
