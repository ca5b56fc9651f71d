"""The accelerator benchmark on CPU: report schema, reconstruction error, bad flags."""

import contextlib
import io
import json

import jax
import numpy as np
import pytest

from petra_jax.benchmarks import accelerator, cli
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
    assert {"method", "micro_batch", "dtype", "images_per_s", "tick_ms", "device_ms",
            "busy_fraction", "host_us_per_tick"} <= set(r)
    assert r["tick_ms"] > 0 and r["device_ms"] > 0
    assert r["busy_fraction"] > 0  # (a ratio of two timings: no upper bound holds on a loaded machine)
    assert r["images_per_s"] == pytest.approx(1e3 * r["micro_batch"] / r["tick_ms"])
    assert r["busy_fraction"] == pytest.approx(r["device_ms"] / r["tick_ms"])


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


@pytest.mark.parametrize("flag, says", [("--methods=petra,sgd", "choose from"),
                                        ("--micro-batches=0", "at least 1"),
                                        ("--dtypes=float16", "choose from"),
                                        ("--ticks=0", "at least 1")])
def test_bad_flags_exit_with_status_2(flag, says, capsys):
  with pytest.raises(SystemExit) as e:
    accelerator.main([flag])
  assert e.value.code == 2
  assert says in capsys.readouterr().err
