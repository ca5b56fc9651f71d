"""Benchmarks: report schema, speed-up model, stage balancing, stored bytes, timeline."""

import itertools
import json
import os
import subprocess
import sys
import types

import numpy as np
import pytest

from petra_jax import data, models

from petra_jax.benchmarks import memory, throughput, timeline
from petra_jax.benchmarks.memory import live as memory_live
from petra_jax.benchmarks.memory import model as memory_model
from petra_jax.engine.arrays import quantize
from petra_jax.engine import schedules as schedule
from petra_jax.engine.stages.partition import balanced_partition, equal_partition, group_cost
from petra_jax.engine.timing import stage_cost

from helpers import tiny_revnet
from helpers import REPO, without_virtual_devices


IMAGE = (8, 8, 3)


_tiny_revnet = tiny_revnet


# --- throughput ----------------------------------------------------------------


def test_throughput_report_schema():
  r = throughput.benchmark(_tiny_revnet(), IMAGE, 10, batch_size=4, iters=1, warmup=1)
  r = json.loads(json.dumps(r))  # JSON-able
  assert set(r["ms_per_step"]) == {"backprop", "revprop", "petra"}
  assert all(v > 0 for v in r["ms_per_step"].values())
  assert r["ratio_petra_backprop"] == pytest.approx(
      r["ms_per_step"]["petra"] / r["ms_per_step"]["backprop"])
  assert r["num_stages"] == 5 and len(r["stage_ms"]) == 5
  for row in r["stage_ms"]:
    assert row["forward"] > 0 and row["backward"] > 0
  assert r["stage_ms"][0]["send_backward"] == 0 and r["stage_ms"][-1]["send_forward"] == 0
  rows = r["stage_ms"]
  assert rows[1]["bytes_backward"] == rows[0]["bytes_forward"]  # dx only to the stem
  assert rows[2]["bytes_backward"] == 2 * rows[1]["bytes_forward"]  # (x~, dx) to a rev stage
  assert r["simulated_speedup"] > 0
  assert r["simulated_speedup"] <= r["simulated_speedup_compute_only"] + 1e-9
  assert r["balancing"][-1]["devices"] == 5
  for b in r["balancing"]:  # the optimum is never worse than the equal-count baseline
    assert b["tick_ms"] <= b["equal_tick_ms"] + 1e-9
  assert r["balancing"][-1]["groups"] == r["balancing"][-1]["equal_groups"]
  assert len(r["block_gflops"]) == 5 and all(b["flops_speedup"] > 0 for b in r["balancing"])
  assert set(r["schedules"]) == {"gpipe", "1f1b", "petra"}
  sizes = memory_model.stage_bytes(_tiny_revnet(), IMAGE, 4)
  for method, by_k in r["schedules"].items():
    assert set(by_k) == {"1", "4", "8"}
    for k, v in by_k.items():
      assert {"simulated_ms_per_update", "bubble_fraction", "stored_bytes_per_stage"} <= set(v)
      assert 0 <= v["bubble_fraction"] < 1 and v["simulated_ms_per_update"] > 0
      # Independent accounting: GPipe keeps k inputs at every stage but the last.
      if method == "gpipe":
        assert v["stored_bytes_per_stage"] == [
            int(k) * row["input_bytes"] for row in sizes[:-1]] + [0]


def test_throughput_report_from_given_measurements(monkeypatch):
  """The report's derived figures from stage times set here, worked by hand:
  5 stages, compute c_j = F_j + B_j (the last stage B_j only) = 2, 3, 10, 3,
  4 ms; sends 0.5 ms each way except stage 2's (1 and 2 ms)."""
  fwd, bwd = [1.0, 1.0, 4.0, 1.0, 9.0], [1.0, 2.0, 6.0, 2.0, 4.0]
  sf, sb = [0.5, 0.5, 1.0, 0.5, 0.0], [0.0, 0.5, 2.0, 0.5, 0.5]
  rows = [{"forward": f, "backward": b, "send_forward": u, "send_backward": v,
           "bytes_forward": 64, "bytes_backward": 128, "input_bytes": 64}
          for f, b, u, v in zip(fwd, bwd, sf, sb)]
  ms = {"backprop": 8.0, "revprop": 12.0, "petra": 4.0}
  monkeypatch.setattr(throughput, "_measure",
                      lambda *a, **k: (ms, [dict(r) for r in rows], [dict(r) for r in rows]))
  r = throughput.benchmark(_tiny_revnet(), IMAGE, 10, batch_size=4, iters=1, warmup=1)
  assert r["ratio_petra_backprop"] == 0.5 and r["ratio_revprop_backprop"] == 1.5
  assert r["sum_stage_ms"] == 22.0  # 2 + 3 + 10 + 3 + 4
  # PETRA's tick is the slowest stage's compute, stage 2's 10 ms, plus its
  # sends (1 + 2 ms): 22 / 13 with sends, 22 / 10 without.
  assert r["simulated_speedup"] == pytest.approx(22.0 / 13.0)
  assert r["simulated_speedup_compute_only"] == pytest.approx(2.2)


def test_schedule_table_from_given_costs():
  """Equal stage costs (F = 1, B = 2 ms; the loss task 3 ms): PETRA's stream
  takes the slowest stage's 3 ms per micro-batch and idles nowhere; the
  flushed schedules pay a fill and a drain every update."""
  rows = [{"forward": 1.0, "backward": 2.0} for _ in range(4)]
  rows[-1]["backward"] = 3.0
  sizes = [{"reversible": False, "input_bytes": 100, "input_x1_bytes": 50, "param_bytes": 7}
           for _ in range(4)]
  table = throughput.schedule_table(rows, rows, sizes, ks=(1, 8))
  for k in ("1", "8"):
    assert table["petra"][k]["simulated_ms_per_update"] == pytest.approx(3.0 * int(k))
    assert table["petra"][k]["bubble_fraction"] == pytest.approx(0.0, abs=1e-9)
    assert table["petra"][k]["stored_bytes_per_stage"] == [600, 400, 200, 0]  # tau_j inputs
    for method in ("gpipe", "1f1b"):
      assert table[method][k]["simulated_ms_per_update"] > 3.0 * int(k)
  assert table["gpipe"]["8"]["stored_bytes_per_stage"] == [800, 800, 800, 0]
  assert table["1f1b"]["8"]["stored_bytes_per_stage"] == [400, 300, 200, 0]  # J - j in flight
  # J = 4, k = 1: one micro-batch through 4 stages and back: 1+1+1+3+2+2+2 = 12 ms.
  assert table["gpipe"]["1"]["simulated_ms_per_update"] == pytest.approx(12.0)


def test_stage_cost_last_stage_is_backward_only():
  assert stage_cost([1, 2, 3], [10, 20, 30]) == [11, 22, 30]


def test_simulated_speedup_formula():
  costs = [2.0, 6.0, 4.0]
  assert throughput.simulated_speedup(costs) == pytest.approx(12 / 6)
  # Stage 1 sends forward 1 ms and backward 0.5 ms: its tick is 7.5 ms.
  fwd, bwd = [0.5, 1.0, 0.0], [0.0, 0.5, 3.0]
  assert throughput.simulated_speedup(costs, fwd, bwd) == pytest.approx(12 / 7.5)
  # Stage 2: 4 + 3 (its backward send) = 7 < 7.5.
  assert group_cost(costs, 2, 2, fwd, bwd) == pytest.approx(7.0)
  # Balanced stages on J devices: speed-up J.
  assert throughput.simulated_speedup([3.0] * 10) == pytest.approx(10.0)


def _brute_force(costs, k, fwd=None, bwd=None):
  n, best = len(costs), float("inf")
  for cuts in itertools.combinations(range(1, n), k - 1):
    bounds = (0, *cuts, n)
    worst = max(group_cost(costs, a, b - 1, fwd, bwd)
                for a, b in zip(bounds, bounds[1:]))
    best = min(best, worst)
  return best


@pytest.mark.parametrize("seed", range(6))
def test_balanced_partition_matches_brute_force(seed):
  rng = np.random.default_rng(seed)
  n = int(rng.integers(1, 8))
  costs = list(rng.uniform(0.1, 5.0, n))
  fwd, bwd = list(rng.uniform(0, 1, n)), list(rng.uniform(0, 1, n))
  for k in range(1, n + 1):
    for sends in ((None, None), (fwd, bwd)):
      groups, worst = balanced_partition(costs, k, *sends)
      assert worst == pytest.approx(_brute_force(costs, k, *sends))
      assert len(groups) == k and groups[0][0] == 0 and groups[-1][1] == n - 1
      assert all(b + 1 == c for (_, b), (c, _) in zip(groups, groups[1:]))
      assert max(group_cost(costs, a, b, *sends) for a, b in groups) == \
          pytest.approx(worst)


def test_balanced_partition_rejects_bad_group_count():
  with pytest.raises(ValueError):
    balanced_partition([1.0, 2.0], 3)


@pytest.mark.parametrize("n,k,sizes", [(10, 4, [3, 3, 2, 2]), (10, 10, [1] * 10),
                                       (7, 1, [7]), (18, 5, [4, 4, 4, 3, 3])])
def test_equal_partition_sizes(n, k, sizes):
  groups = equal_partition(n, k)
  assert [b - a + 1 for a, b in groups] == sizes
  assert groups[0][0] == 0 and groups[-1][1] == n - 1
  assert all(b + 1 == c for (_, b), (c, _) in zip(groups, groups[1:]))
  with pytest.raises(ValueError):
    equal_partition(n, n + 1)


# --- memory --------------------------------------------------------------------


def test_measured_stored_bytes_match_formula():
  stages = _tiny_revnet()
  J, batch = len(stages), 4
  live = memory_live.measure_live(stages, IMAGE, batch)
  sizes = memory_model.stage_bytes(stages, IMAGE, batch)
  analytic = memory_model.stored_bytes(sizes, "petra")
  assert live["petra"] == analytic
  assert live["delayed"] == memory_model.stored_bytes(sizes, "delayed")
  for j, (s, b) in enumerate(zip(stages, live["petra"])):
    tau = schedule.delay(j, J)
    assert tau == 2 * (J - 1 - j)
    assert b == (0 if s.reversible else tau * sizes[j]["input_bytes"])
  assert live["petra"][0] == schedule.delay(0, J) * batch * int(np.prod(IMAGE)) * 4
  # Table 3 leaves the first stage's input out (it re-reads the dataset).
  table3_petra = memory_model.stored_bytes(sizes, "petra", first_input=False)
  assert table3_petra[0] == 0 and table3_petra[1:] == analytic[1:]


def test_stored_bytes_rev_stash_and_first_input_by_hand():
  """stem, rev, rev, head (tau = 6, 4, 2, 0): a reversible stage buffers its
  input only under a method that does not reconstruct it, one stream (x1)
  or both; weights are stashed per micro-batch in flight."""
  sizes = [{"reversible": rev, "input_bytes": inp, "input_x1_bytes": x1, "param_bytes": par}
           for rev, inp, x1, par in ((False, 100, 100, 1), (True, 40, 20, 2),
                                     (True, 40, 20, 3), (False, 20, 20, 4))]
  stored = memory_model.stored_bytes
  assert stored(sizes, "petra") == [600, 0, 0, 0]
  assert stored(sizes, "approximate_input") == [6 * 101, 4 * 2, 2 * 3, 0]
  assert stored(sizes, "dsp") == [600, 4 * 40, 2 * 40, 0]
  assert stored(sizes, "dsp", rev_stash="x1") == [600, 4 * 20, 2 * 20, 0]
  assert stored(sizes, "delayed", rev_stash="x1") == [6 * 101, 4 * 22, 2 * 23, 0]
  assert stored(sizes, "delayed", first_input=False) == [6 * 1, 4 * 42, 2 * 43, 0]
  assert stored(sizes, "petra", first_input=False) == [0, 0, 0, 0]
  with pytest.raises(ValueError, match="rev_stash"):
    stored(sizes, "dsp", rev_stash="x2")
  with pytest.raises(ValueError, match="Unknown method"):
    stored(sizes, "backprop")


def test_device_memory_per_stage():
  stages = _tiny_revnet()
  batch = 4
  rows = memory_live.device_memory(stages, IMAGE, batch)
  sizes = memory_model.stage_bytes(stages, IMAGE, batch)
  assert [r["name"] for r in rows] == [s.name for s in stages]
  for j, r in enumerate(rows):
    # Independent lower bounds: the parameters plus one momentum slot each,
    # the PETRA buffers from shapes, and the forward's own output activation.
    assert r["state_bytes"] >= 2 * sizes[j]["param_bytes"]
    assert r["buffer_bytes"] == memory_model.stored_bytes(sizes, "petra")[j]
    if j + 1 < len(stages):
      assert r["forward_bytes"] >= sizes[j + 1]["input_bytes"]
    assert r["total_bytes"] == (r["state_bytes"] + r["buffer_bytes"]
                                + max(r["forward_bytes"], r["backward_bytes"]))
  assert rows[1]["buffer_bytes"] == 0 and rows[2]["buffer_bytes"] > 0  # rev vs down


def test_revnet18_matches_reference_numbers():
  stages = models.build_model("revnet18", width=64, num_classes=10)
  sizes = memory_model.stage_bytes(stages, (32, 32, 3), 64)
  petra = [b / memory_model.MIB for b in memory_model.stored_bytes(sizes, "petra")]
  assert petra == pytest.approx([13.5, 0, 0, 384, 0, 128, 0, 32, 0, 0])
  delayed = sum(memory_model.stored_bytes(sizes, "delayed")) / memory_model.MIB
  assert delayed == pytest.approx(1911.3, rel=1e-3)  # the reference counts conv biases


def test_table3_revnet50_imagenet():
  d = data.DATASETS["imagenet"]
  stages = models.build_model("revnet50", width=64, num_classes=d.num_classes,
                              imagenet_stem=True)
  rows = memory_model.table3(memory_model.stage_bytes(stages, d.image_shape, 64))
  assert [r["method"] for r in rows] == ["delayed", "dsp", "approximate_input", "petra"]
  assert [(r["input_buffer"], r["param_buffer"]) for r in rows] == [
      (True, True), (True, False), (False, True), (False, False)]
  assert rows[0]["saving_pct"] == 0
  # The paper's Table 3 (Rivaud et al. 2025), saving % of each row.
  for r, paper in zip(rows, (0.0, 2.0, 52.3, 54.3)):
    assert abs(r["saving_pct"] - paper) < 2.0


# --- timeline ------------------------------------------------------------------


def test_timeline_png(tmp_path):
  stages, ticks = _tiny_revnet(), 12
  J = len(stages)
  events, table = timeline.run_timeline(stages, IMAGE, ticks, batch_size=2)
  assert sorted(events) == sorted(timeline.table_events(table, ticks))
  for t, j, kind, m in events:  # the closed forms (schedule module docstring)
    assert t == (m + j if kind == "F" else m + 2 * (J - 1) - j)
  stats = timeline.timeline_stats(events, J, ticks)
  assert stats["first_loss_tick"] == J - 1
  assert stats["fill_ticks"] == 2 * (J - 1)
  assert stats["bubbles"] == 2 * J * (J - 1)  # j idle F slots + 2(J-1)-j idle B slots
  path = timeline.plot_timeline(events, J, str(tmp_path / "timeline.png"), num_ticks=ticks)
  with open(path, "rb") as f:
    assert f.read(8) == b"\x89PNG\r\n\x1a\n"
  assert (tmp_path / "timeline.png").stat().st_size > 1000


def test_bytes_per_tick_by_hand_and_live_in_every_format():
  # _tiny_revnet, batch 4 of 8x8 images, float32: stream activations are
  # 2 x [4, 8, 8, 2] = 4096 B before the downsampling, 2 x [4, 4, 4, 4] =
  # 2048 B after. Forward: stem, rev0, down, rev1 each send their output:
  # 4096 + 4096 + 2048 + 2048. Backward: rev0 -> stem delta (4096), down ->
  # rev0 (x~, delta) (2 x 4096), rev1 -> down delta (2048), head -> rev1
  # (x~, delta) (2 x 2048).
  assert memory_model.bytes_per_tick(memory_model.stage_bytes(_tiny_revnet(), IMAGE, 4)) == (
      12288 + 18432)
  rows = {r["format"]: r for r in memory.quantization(
      lambda w: _tiny_revnet(), IMAGE, 4, live={"width": 2, "batch_size": 4,
                                                "image_shape": IMAGE})}
  assert rows["bfloat16"]["tick_ratio"] == rows["float16"]["tick_ratio"] == 2.0
  assert rows["int8"]["tick_ratio"] >= 3.5 and rows["int8"]["stored_ratio"] >= 3.5
  for r in rows.values():  # what the devices hold equals the shapes' count
    assert r["live"]["bytes_per_tick"] == r["live"]["analytic_bytes_per_tick"]
    assert r["live"]["petra_stored_bytes"] == r["live"]["analytic_petra_stored_bytes"]


def test_table3_extended_rows():
  d = data.DATASETS["cifar10"]
  build = lambda name: models.build_model(name, width=4)  # noqa: E731
  sizes = memory_model.stage_bytes(build("revnet18"), d.image_shape, 8)
  inv = memory_model.stage_bytes(build("revnet18_inv"), d.image_shape, 8)
  int8 = memory_model.stage_bytes(build("revnet18"), d.image_shape, 8,
                            formats=quantize.MessageFormats(buffer="int8"))
  rows = memory_model.table3_extended(sizes, {"int8": int8}, inv)
  assert [r["method"] for r in rows] == list(memory_model.TABLE3_METHODS) + ["petra"] * 2
  petra, inv_row, int8_row = rows[3], rows[4], rows[5]
  assert inv_row["model"] == "_inv" and int8_row["buffer_format"] == "int8"
  # Only stem and head buffer in the _inv model (stem's input excluded: the head's);
  # int8 buffers: a quarter of PETRA's buffers plus the scales.
  model_gb = sum(r["param_bytes"] for r in sizes) / memory_model.GB
  petra_buffers = petra["memory_gb"] - model_gb
  int8_buffers = int8_row["memory_gb"] - model_gb
  assert 3.5 < petra_buffers / int8_buffers <= 4.0
  assert inv_row["memory_gb"] < petra["memory_gb"]


# --- scaling (multi-process PETRA against one process) ---------------------------

SCALING_TINY = ["--processes=2", "--model=revnet_fixed", "--depth=2", "--width=2",
                "--stage-sizes=", "--image-size=8", "--batch-size=4", "--rounds=1",
                "--iters=2", "--warmup=1"]


def test_scaling_removes_the_compilation_cache_it_made(monkeypatch):
  from petra_jax.benchmarks.scaling import processes
  monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
  seen = []
  monkeypatch.setattr(processes, "_alternate", lambda args, env: seen.append(
      (env["JAX_COMPILATION_CACHE_DIR"], os.path.isdir(env["JAX_COMPILATION_CACHE_DIR"]))))
  processes.measure(types.SimpleNamespace())
  ((cache, existed),) = seen
  assert existed and not os.path.exists(cache)
  monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", "/the/callers/cache")
  processes.measure(types.SimpleNamespace())
  assert seen[-1][0] == "/the/callers/cache"


def _scaling(args, timeout=240):
  env = without_virtual_devices(os.environ)  # these processes choose their own device count
  return subprocess.run([sys.executable, "-m", "petra_jax.benchmarks.scaling", *args],
                        cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.long  # CI time; two processes: test_multiprocess's transfers, the simulator's tests
def test_scaling_command_reports_consistent_figures():
  """The plumbing on a 4-stage RevNet of width 2: two processes, two stages
  each. No timing is checked, only the report's fields and their relations,
  recomputed here from the reported numbers."""
  run = _scaling(SCALING_TINY + ["--json"])
  assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
  r = json.loads(run.stdout.strip().splitlines()[-1])
  ips, lim = r["images_per_s"], r["limits"]
  assert set(ips) == {"backprop", "petra_single_process", "petra_multiprocess"}
  assert all(isinstance(v, float) and v > 0 for v in ips.values())
  assert r["processes"] == 2 and r["num_stages"] == 4
  assert r["stage_process"] == [0, 0, 1, 1]  # stage j on process j*N//J
  assert r["measured_speedup"] == pytest.approx(
      ips["petra_multiprocess"] / ips["petra_single_process"])
  assert r["speedup_vs_backprop"] == pytest.approx(ips["petra_multiprocess"] / ips["backprop"])
  assert r["efficiency"] == pytest.approx(r["measured_speedup"] / r["simulated_speedup"])
  assert lim["measured_ms_per_tick"] == pytest.approx(1e3 * 4 / ips["petra_multiprocess"])
  assert r["efficiency_one_core"] == pytest.approx(
      lim["predicted_ms_per_tick"] / lim["measured_ms_per_tick"])
  # One boundary, after the reversible stage 1: (x~, delta) back, twice the
  # forward's bytes; a forward message is 4 images of 8x8, 2 streams of 2 channels.
  (t,) = lim["transfer"]
  assert t["boundary"] == 2 and t["round_trip_ms"] > 0
  assert t["bytes_forward"] == 4 * 8 * 8 * 2 * 2 * 4
  assert t["bytes_backward"] == 2 * t["bytes_forward"]
  # PETRA's steady tick on one device per process: the slowest process's
  # compute plus its sends (the round trip split by bytes).
  sends = [t["round_trip_ms"] / 3, 2 * t["round_trip_ms"] / 3]
  groups = [sum(lim["stage_ms_single_process"][:2]), sum(lim["stage_ms_single_process"][2:])]
  assert lim["group_ms_single_process"] == pytest.approx(groups)
  tick = max(g + s for g, s in zip(groups, sends))
  assert r["simulated_speedup"] == pytest.approx(sum(groups) / tick, rel=1e-6)
  one = lim["group_ms_1thread"]
  assert len(one) == 2 and all(v > 0 for v in one)
  assert lim["predicted_ms_per_tick"] == pytest.approx(max(g + s for g, s in zip(one, sends)))
  assert lim["thread_slowdown"] == pytest.approx(sum(one) / sum(groups))
  assert lim["load_balance"] == pytest.approx(max(one) / (sum(one) / 2))
  assert 0 <= lim["host_cpu_ms_per_tick"] and 0 < lim["host_ms_per_tick"]


def test_scaling_report_from_given_measurements():
  """The report of 2 processes over 4 stages of 1, 2, 3, 4 ms, from figures
  set here, worked by hand: groups [0 1 | 2 3] of 3 and 7 ms (4 and 8 on one
  core); the one boundary's 4 ms round trip split by bytes (100 forward, 300
  backward): 1 ms to process 0's sends, 3 ms to process 1's."""
  from petra_jax.benchmarks import scaling  # pylint: disable=g-import-not-at-top
  args = types.SimpleNamespace(processes=2, model="revnet_fixed", width=2, dataset="cifar10",
                               batch_size=8)
  single = {"stage_ms": [1.0, 2.0, 3.0, 4.0], "cores": 2,
            "images_per_s": {"backprop": 100.0, "petra": 200.0}}
  multi = {"images_per_s": 300.0, "group_ms_1thread": [4.0, 8.0],
           "transfer": [{"boundary": 2, "bytes_forward": 100, "bytes_backward": 300,
                         "round_trip_ms": 4.0}],
           "host_ms_per_tick": 1.0, "host_cpu_ms_per_tick": 0.5}
  r = scaling.report(args, single, multi)
  lim = r["limits"]
  assert r["stage_process"] == [0, 0, 1, 1] and lim["group_ms_single_process"] == [3.0, 7.0]
  assert r["measured_speedup"] == pytest.approx(1.5)  # 300 / 200 images/s
  assert r["speedup_vs_backprop"] == pytest.approx(3.0)
  # Tick: max(3 + 1, 7 + 3) = 10 ms against 10 ms in sequence; on one core
  # max(4 + 1, 8 + 3) = 11 ms, against 1e3 * 8 / 300 ms measured.
  assert r["simulated_speedup"] == pytest.approx(1.0)
  assert r["efficiency"] == pytest.approx(1.5)
  assert lim["predicted_ms_per_tick"] == pytest.approx(11.0)
  assert lim["measured_ms_per_tick"] == pytest.approx(80.0 / 3)
  assert r["efficiency_one_core"] == pytest.approx(11.0 * 3 / 80)
  assert lim["thread_slowdown"] == pytest.approx(1.2)  # 12 / 10
  assert lim["load_balance"] == pytest.approx(8.0 / 6.0)


def test_scaling_bad_process_count_is_one_clear_error():
  run = _scaling(["--processes=5", "--model=revnet_fixed", "--depth=2", "--stage-sizes="],
                 timeout=120)
  assert run.returncode != 0
  assert "Traceback" not in run.stderr
  assert run.stderr.strip() == ("error: --processes=5: use 2 to 4 (the number of stages; "
                                "--stage-sizes sets it).")


def test_side_by_side_ratios_are_medians_over_brackets_by_hand():
  from petra_jax.benchmarks import torch_side_by_side as sbs
  run = lambda p, b: {"ms_per_step": {"petra": p, "backprop": b}}  # noqa: E731
  theirs = [run(100, 80), run(300, 240), run(100, 80)]
  ours = [run(220, 100), run(90, 60)]
  rows = sbs.brackets(theirs, ours)
  # bracket 1: theirs' mean petra 200, backprop 160; bracket 2 the same
  assert rows[0]["ratio_petra_ours_theirs"] == pytest.approx(220 / 200)
  assert rows[1]["ratio_backprop_ours_theirs"] == pytest.approx(60 / 160)
  assert rows[1]["ratio_petra_backprop_ours"] == pytest.approx(90 / 60)
  got = sbs.summary(rows)
  assert got["ratio_petra_ours_theirs"] == pytest.approx((220 / 200 + 90 / 200) / 2)
  assert got["ratio_petra_backprop_theirs"] == pytest.approx(200 / 160)
  with pytest.raises(ValueError, match="need 3 of theirs"):
    sbs.brackets(theirs[:2], ours)


def test_side_by_side_without_the_authors_export_is_one_line(tmp_path):
  from petra_jax.benchmarks import torch_side_by_side as sbs
  with pytest.raises(SystemExit, match="has no async_torch"):
    sbs.main([f"--petra-repo={tmp_path}", "--torch-python=python3"])
