"""The accelerator benchmark on CPU: report schema, busy time, fits, reconstruction error, flags."""

import contextlib
import io
import json
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import compiles_counted
from petra_jax.benchmarks import accelerator, cli, device_time
from petra_jax.engine.stages import stage as stage_lib
from petra_jax.engine.arrays.precision import Precision

TINY = ["--width=2", "--micro-batches=2", "--ticks=3", "--warmup=1",
        "--methods=petra,backprop", "--dtypes=float32", "--json"]


def _by_hand(stages, variables, images) -> float:
  """||x~ - x|| / ||x|| over the reversible stages' inputs, eagerly, in numpy."""
  num = den = 0.0
  x = images
  for stage, v in zip(stages[:-1], variables):
    y, _ = stage_lib.forward(stage, v["params"], v["batch_stats"], x)
    if stage.reversible:
      x_tilde = stage_lib.inverse(stage, v["params"], v["batch_stats"], y)
      for a, b in zip(jax.tree.leaves(x_tilde), jax.tree.leaves(x)):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        num += float(np.sum((a - b) ** 2))
        den += float(np.sum(b ** 2))
    x = y
  return float(np.sqrt(num / den))


@pytest.fixture(scope="module")
def report():
  """The tiny run's JSON report (petra and backprop, float32, width 2)."""
  out = io.StringIO()
  with contextlib.redirect_stdout(out):
    assert accelerator.main(TINY) == 0
  return json.loads(out.getvalue())


@pytest.mark.long  # about a minute; logic covered by faster tests (CI time)
def test_report_schema(report):
  assert {"device", "versions", "results", "reconstruction_error"} <= set(report)
  assert report["device"]["platform"] == jax.devices()[0].platform
  assert report["versions"]["jax"] == jax.__version__
  rows = report["results"]
  assert {(r["method"], r["micro_batch"], r["dtype"]) for r in rows} == {
      ("petra", 2, "float32"), ("backprop", 2, "float32")}
  for r in rows:
    assert {"method", "micro_batch", "dtype", "images_per_s", "tick_ms", "profiled_tick_ms",
            "device_ms", "busy_fraction", "device_idle_us_per_tick", "compile_s"} <= set(r)
    assert "incomplete" not in r
    assert r["tick_ms"] > 0 and r["device_ms"] > 0 and r["device_events"] > 0
    assert 0 < r["busy_fraction"] <= 1  # by construction: busy time is inside the window
    assert r["device_idle_us_per_tick"] >= 0
    assert r["images_per_s"] == pytest.approx(1e3 * r["micro_batch"] / r["tick_ms"])
    assert r["busy_fraction"] == pytest.approx(r["device_ms"] / r["profiled_tick_ms"])
    assert r["device_idle_us_per_tick"] == pytest.approx(
        1e3 * (r["profiled_tick_ms"] - r["device_ms"]))
  assert [(f["method"], f["dtype"], f["tick"]) for f in report["fits"]] == [
      ("petra", "float32", None), ("backprop", "float32", None)]  # one micro-batch: no line


@pytest.mark.long  # about a minute; logic covered by faster tests (CI time)
def test_reconstruction_error_in_report(report):
  err = report["reconstruction_error"]
  assert set(err) == {"default", "highest"}
  assert 0 <= err["highest"] < 1e-4 and 0 <= err["default"] < 1e-4
  stages = cli.build("revnet18", "cifar10", 2)
  images, _ = accelerator.random_batch((32, 32, 3), 10, 2)
  variables = accelerator.init_variables(stages, images)
  hand = _by_hand(stages, variables, images)
  assert hand < 1e-4
  assert err["highest"] == pytest.approx(hand, abs=1e-6)  # both at float32 round-off


def test_reconstruction_error_matches_by_hand_in_bfloat16():
  # bfloat16 streams make the error large enough to compare its value.
  stages = stage_lib.with_precision(cli.build("revnet18", "cifar10", 2),
                                    Precision("bfloat16", "bfloat16"))
  images, _ = accelerator.random_batch((32, 32, 3), 10, 2, seed=1)
  variables = accelerator.init_variables(stages, images, seed=1)
  got = accelerator.reconstruction_error(stages, variables, images, "highest")
  hand = _by_hand(stages, variables, images)
  assert hand > 1e-4
  assert got == pytest.approx(hand, rel=0.2)


def test_union_length_matches_a_grid_count():
  rng = np.random.default_rng(0)
  starts = rng.integers(0, 90, 12)
  intervals = [(float(s), float(s + rng.integers(0, 15))) for s in starts]
  lo, hi = 10.0, 80.0
  covered = np.zeros(200, bool)  # unit cells [t, t + 1) of integer intervals
  for s, e in intervals:
    covered[int(s):int(e)] = True
  assert device_time.union_length(intervals, lo, hi) == covered[int(lo):int(hi)].sum()
  assert device_time.union_length([], lo, hi) == 0
  assert device_time.union_length([(0.0, 500.0)], lo, hi) == hi - lo


def test_time_by_name_clips_and_sums_per_name():
  events = [("conv", 0.0, 10.0), ("copy", 5.0, 8.0), ("conv", 95.0, 120.0), ("late", 200.0, 210.0)]
  # By hand: conv 10 + (100 - 95) = 15 inside [0, 100]; copy 3; "late" lies outside.
  assert device_time.time_by_name(events, 0.0, 100.0) == {"conv": 15.0, "copy": 3.0}
  assert list(device_time.time_by_name(events, 0.0, 100.0)) == ["conv", "copy"]


def test_kernel_families_drop_instance_numbers():
  got = accelerator.kernel_families({"fusion.12": 5.0, "fusion.3": 2.0, "loop_add_fusion_3": 4.0,
                                     "copy": 1.0})
  assert got == [("fusion", 7.0), ("loop_add_fusion", 4.0), ("copy", 1.0)]


def test_fit_line_recovers_a_line():
  bs = [64, 256, 1024]
  fit = device_time.fit_line(bs, [2.5 + 0.02 * b for b in bs])
  assert fit["fixed_ms"] == pytest.approx(2.5) and fit["ms_per_image"] == pytest.approx(0.02)
  assert device_time.fit_line([64, 64], [1.0, 2.0]) is None


def test_fits_group_rows_by_method_and_dtype():
  rows = [{"method": m, "dtype": "float32", "micro_batch": b, "tick_ms": h + c * b,
           "device_ms": c * b} for m, h, c in (("petra", 3.0, 0.5), ("backprop", 1.0, 0.25))
          for b in (2, 4, 8)]
  rows.append({"method": "petra", "dtype": "bfloat16", "micro_batch": 2, "compile_s": 9.0})
  got = {(f["method"], f["dtype"]): f for f in accelerator.fits(rows)}
  assert got["petra", "float32"]["tick"]["fixed_ms"] == pytest.approx(3.0)
  assert got["backprop", "float32"]["tick"]["ms_per_image"] == pytest.approx(0.25)
  assert got["backprop", "float32"]["device"]["fixed_ms"] == pytest.approx(0.0, abs=1e-9)
  assert got["petra", "bfloat16"]["tick"] is None  # an incomplete row has no tick_ms


def test_fits_keep_rows_of_another_loop_unroll_apart():
  rows = [{"method": "petra", "dtype": "float32", "micro_batch": b, "tick_ms": h + 0.5 * b,
           "executor": "compiled", "unroll_ticks": u} for u, h in ((4, 1.0), (1, 3.0))
          for b in (2, 4)]
  got = {f["executor"]: f["tick"]["fixed_ms"] for f in accelerator.fits(rows)}
  assert got == {"compiled/u4": pytest.approx(1.0), "compiled/u1": pytest.approx(3.0)}


def test_fits_keep_rows_with_ordered_writes_apart():
  rows = [{"method": "petra", "dtype": "float32", "micro_batch": b, "tick_ms": h + 0.5 * b,
           "executor": "compiled", "unroll_ticks": 4, "order_writes": o}
          for o, h in ((False, 2.0), (True, 1.5)) for b in (2, 4)]
  got = {f["executor"]: f["tick"]["fixed_ms"] for f in accelerator.fits(rows)}
  assert got == {"compiled/u4": pytest.approx(2.0), "compiled/u4/ordered": pytest.approx(1.5)}


def test_fits_keep_rows_of_another_periods_per_dispatch_apart():
  rows = [{"method": "petra", "dtype": "float32", "micro_batch": b, "tick_ms": h + 0.5 * b,
           "executor": "compiled", "unroll_ticks": 4, "periods_per_dispatch": n}
          for n, h in ((16, 2.0), (64, 1.5)) for b in (2, 4)]
  got = {f["executor"]: f["tick"]["fixed_ms"] for f in accelerator.fits(rows)}
  assert got == {"compiled/u4/n16": pytest.approx(2.0), "compiled/u4/n64": pytest.approx(1.5)}


def test_a_compiled_row_runs_at_every_listed_periods_per_dispatch_and_unroll(monkeypatch):
  """``--periods-per-dispatch``, ``--unroll-ticks`` and ``--order-writes`` take lists: one row
  per combination where the compiled executor runs the method, one row where the host executor
  does (they change nothing there)."""
  seen = []

  def fake_measure(cfg, ticks, warmup, row_seconds):
    del ticks, warmup, row_seconds
    seen.append((cfg.method, cfg.periods_per_dispatch, cfg.unroll_ticks, cfg.order_writes))
    return {"method": cfg.method, "micro_batch": cfg.batch_size, "dtype": cfg.dtype,
            "executor": "host" if cfg.method == "1f1b" else "compiled"}
  monkeypatch.setattr(accelerator, "measure", fake_measure)
  monkeypatch.setattr(accelerator, "fits", lambda results: {})
  args = accelerator.parse_args(["--width=2", "--micro-batches=2", "--methods=petra,1f1b",
                                 "--dtypes=float32", "--periods-per-dispatch=16,64",
                                 "--unroll-ticks=1,4", "--order-writes=0,1",
                                 "--no-reconstruction"])
  accelerator.benchmark(args)
  assert seen == [("petra", n, u, o) for n in (16, 64) for u in (1, 4) for o in (False, True)
                  ] + [("1f1b", 16, 1, False)]
  with pytest.raises(SystemExit):
    accelerator.parse_args(["--periods-per-dispatch=16,0"])


def _fake_profile():
  """A profile's shape: planes of lines of events (name, start_ns, end_ns, stats)."""
  ev = lambda name, a, b, stats=(): SimpleNamespace(name=name, start_ns=a, end_ns=b,
                                                    stats=list(stats))
  line = lambda name, *events: SimpleNamespace(name=name, events=list(events))
  host = SimpleNamespace(name="/host:CPU", lines=[
      line("python", ev("PjitFunction(step)", 0, 5)),
      line("tf_XLAPjRtCpuClient/1", ev("fusion", 1, 3, [("hlo_op", "fusion")]),
           ev("ThreadpoolListener::Record", 2, 2))])
  gpu = SimpleNamespace(name="/device:GPU:0", lines=[
      line("Stream #13(Compute)", ev("gemm", 10, 14), ev("memcpy", 15, 16)),
      line("XLA Modules", ev("jit_step", 10, 16))])
  return SimpleNamespace(planes=[host, gpu])


@pytest.mark.parametrize("platform, expected", [("cpu", [(1, 3)]),
                                                ("gpu", [(10, 14), (15, 16)])])
def test_device_events_are_the_backends_own(platform, expected):
  got = list(device_time.device_intervals(_fake_profile(), platform))
  assert got == expected


def test_profile_window_busy_time_lies_inside_the_window():
  f = jax.jit(lambda a: jnp.tanh(a @ a))
  a = jnp.ones((256, 256))
  jax.block_until_ready(f(a))
  with device_time.profile_window() as window:
    for _ in range(4):
      a = f(a)
    jax.block_until_ready(a)
  assert window.num_events >= 4  # at least one device event per call
  assert 0 < window.busy_ns <= window.wall_ns
  assert 0 < window.busy_fraction <= 1


@pytest.mark.parametrize("method", ["petra", "1f1b"])
def test_timed_segments_follow_each_other(method):
  cfg = accelerator.run_config("revnet18", "cifar10", 2, method, 2, "float32", 1)
  info = accelerator.data_lib.get_dataset_info("cifar10")
  pipe, _, _ = accelerator.assembly.build_pipeline(cfg, "", info, 2, 10)
  warm, (first, second), done = accelerator.segments(pipe, 5, 2, repeats=2)
  assert len(first) == len(second) and done >= 5
  whole = list(pipe.schedule(len(warm) + 2 * len(first)))
  # Same ticks as one schedule cut in three: running them in turn is running the schedule.
  assert [str(t) for t in warm + first + second] == [str(t) for t in whole[:len(warm) + 2 * len(first)]]


@pytest.mark.parametrize("method", ["petra", "1f1b"])
def test_timed_segments_run_only_programs_the_warm_up_compiled(method):
  """The warm-up (one call here) compiles every program the timed ticks run: a call that takes
  the carry the call before it left runs the program the first call ran (a compile inside the
  timed ticks was counted as their time)."""
  cfg = accelerator.run_config("revnet18", "cifar10", 2, method, 2, "float32", 1,
                               executor="compiled", periods=3)
  info = accelerator.data_lib.get_dataset_info("cifar10")
  pipe, _, _ = accelerator.assembly.build_pipeline(cfg, "", info, 2, 10)
  run = accelerator.compiled.executor(pipe, "compiled", 3)
  warm, (first, _), _ = accelerator.segments(pipe, 5, 2, repeats=2, per_call=3)
  table = warm + first
  images, labels = accelerator.random_batch(info.image_shape, info.num_classes, 2)
  state = accelerator._run_ticks(run, pipe.init(0, images), table, 0, len(warm), images, labels)
  assert run.dispatches == 1
  with compiles_counted() as compiles:
    accelerator._run_ticks(run, state, table, len(warm), len(table), images, labels)
  assert not compiles
  # Every timed tick ran inside a full call of 3 periods.
  assert (run.dispatches - 1) * 3 * len(run.period.ticks) == len(first)


@pytest.mark.parametrize("flag, says", [("--methods=petra,sgd", "choose from"),
                                        ("--micro-batches=0", "at least 1"),
                                        ("--dtypes=float16", "choose from"),
                                        ("--ticks=0", "at least 1"),
                                        ("--row-seconds=0", "at least 1"),
                                        ("--order-writes=0,2", "0 or 1")])
def test_bad_flags_exit_with_status_2(flag, says, capsys):
  with pytest.raises(SystemExit) as e:
    accelerator.main([flag])
  assert e.value.code == 2
  assert says in capsys.readouterr().err


@pytest.mark.parametrize("recipe, says", [("missing.py", "no recipe at"),
                                           ("deep.py", "model.depth applies to")])
def test_a_grid_it_cannot_run_is_one_line_before_any_row(recipe, says, tmp_path, monkeypatch,
                                                          capsys):
  """A recipe that is not there, or whose fields do not fit ``--model``, is one line and exit
  status 2 before any row runs (not a traceback after the rows before it)."""
  (tmp_path / "deep.py").write_text(
      "from petra_jax import config\n\n\ndef get_config():\n  c = config.get_config()\n"
      "  c.model.depth = 2\n  return c\n")
  monkeypatch.setattr(accelerator, "measure", lambda *a, **k: pytest.fail("a row ran"))
  code = accelerator.main([f"--config={tmp_path / recipe}", "--methods=petra",
                           "--dtypes=float32", "--micro-batches=2"])
  err = capsys.readouterr().err
  assert code == 2
  assert err.count("\n") == 1 and err.startswith("error: ") and says in err, err


def test_rows_run_size_by_size_every_method_at_a_size_first(monkeypatch):
  """A check stopped by its time limit keeps comparable pairs: the grid runs every method at
  one micro-batch before the next micro-batch (the GPU check's bfloat16 part lost its whole
  backprop column when methods ran first)."""
  order = []

  def fake_measure(cfg, ticks, warmup, row_seconds):
    del ticks, warmup, row_seconds
    order.append((cfg.method, cfg.batch_size, cfg.dtype))
    return {"method": cfg.method, "micro_batch": cfg.batch_size, "dtype": cfg.dtype}
  monkeypatch.setattr(accelerator, "measure", fake_measure)
  monkeypatch.setattr(accelerator, "fits", lambda results: {})
  args = accelerator.parse_args(["--width=2", "--micro-batches=2,4", "--accumulation-steps=1",
                                 "--methods=petra,backprop",
                                 "--dtypes=float32,bfloat16", "--no-reconstruction"])
  accelerator.benchmark(args)
  assert order == [(m, b, d) for d in ("float32", "bfloat16") for b in (2, 4)
                   for m in ("petra", "backprop")]


def test_a_row_trains_with_the_recipe_of_the_main_job(tmp_path):
  """``--config``: a row keeps the recipe's optimizer, compensation and split (the main job's
  own, so that the two compare the loop and the input pipeline only) and sets its own fields."""
  recipe = tmp_path / "recipe.py"
  recipe.write_text(
      "from petra_jax import config\n"
      "def get_config(variant=''):\n"
      "  c = config.get_config()\n"
      "  c.compensation.name = 'nesterov_lookahead+weight_prediction'\n"
      "  c.optim.learning_rate = 0.123\n"
      "  c.model.num_stages, c.model.stage_sizes = 4, (1, 2, 2, 5)\n"
      "  c.model.width = 8 if variant == 'small' else 16\n"
      "  return c\n")
  cfg = accelerator.run_config("revnet18", "cifar10", 2, "petra", 4, "float32", 2,
                               recipe=f"{recipe}:small")
  assert cfg.compensation.name == "nesterov_lookahead+weight_prediction"
  assert cfg.optim.learning_rate == 0.123 and tuple(cfg.model.stage_sizes) == (1, 2, 2, 5)
  assert (cfg.model.width, cfg.batch_size, cfg.accumulation_steps, cfg.method) == (2, 8, 2, "petra")
  resplit = accelerator.run_config("revnet18", "cifar10", 2, "petra", 4, "float32", 2,
                                   num_stages=5, recipe=str(recipe))
  assert resplit.model.num_stages == 5 and tuple(resplit.model.stage_sizes) == ()
  default = accelerator.run_config("revnet18", "cifar10", 2, "petra", 4, "float32", 2)
  assert default.compensation.name != cfg.compensation.name
  with pytest.raises(ValueError, match="no recipe at"):
    accelerator.run_config("revnet18", "cifar10", 2, "petra", 4, "float32", 2,
                           recipe=str(tmp_path / "absent.py"))
  assert accelerator.parse_args([f"--config={recipe}"]).config == str(recipe)
