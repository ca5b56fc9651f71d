"""The GPU check (launch/gpu_check.sh): its parts, its summary, and a tiny run on the CPU."""

import json
import os
import subprocess
import sys
import tarfile

import pytest

from petra_jax.benchmarks import gpu_check

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_full_check_fits_in_eight_minutes_and_covers_the_grid(tmp_path):
  parts = gpu_check.parts(tiny=False, out=str(tmp_path), executor="host")
  assert [p.name for p in parts if not p.optional] == [
      "info", "accelerator_float32", "accelerator_host", "accelerator_bfloat16", "train",
      "accelerator_recipe", "language_model"]
  assert sum(p.seconds + gpu_check.GRACE_S for p in parts if not p.optional) <= 8 * 60
  ordered = next(p.argv for p in parts if p.name == "accelerator_ordered")
  assert {"--order-writes=0,1", "--methods=petra", "--dtypes=float32",
          "--executor=compiled"} <= set(ordered)  # (the ordered writes are the compiled executor's)
  for dtype in ("float32", "bfloat16"):
    argv = next(p.argv for p in parts if p.name == f"accelerator_{dtype}")
    assert "--micro-batches=64,256,1024" in argv and f"--dtypes={dtype}" in argv
    assert "--methods=petra,backprop" in argv
  train = next(p for p in parts if p.name == "train")
  assert "--config=configs/cifar10.py" in train.argv and train.until_stopped
  assert "--config.eval_every=0" in train.argv  # its rate is the loop's and the input's
  recipe = next(p.argv for p in parts if p.name == "accelerator_recipe")
  assert {"--config=configs/cifar10.py", "--micro-batches=64", "--accumulation-steps=2",
          "--methods=petra", "--dtypes=float32"} <= set(recipe)
  profiled = next(p for p in parts if p.name == "train_profile")
  assert profiled.optional and profiled.until_stopped
  assert {"--config=configs/cifar10.py", "--config.profile_steps=96:192"} <= set(profiled.argv)
  assert not any("pip" in a for p in parts for a in p.argv)


def test_ordered_rows_are_compared_with_the_same_compiled_program():
  def row(b, rate=None, ordered=False, unroll=4, executor="compiled"):
    r = {"method": "petra", "dtype": "float32", "micro_batch": b, "executor": executor}
    r.update({"unroll_ticks": unroll, "periods_per_dispatch": 64} if executor == "compiled" else {})
    r.update({"order_writes": True} if ordered else {})
    return r | ({"images_per_s": rate} if rate is not None else {})
  rows = [row(64, 100.0), row(64, 80.0, unroll=1), row(64, 110.0, ordered=True),
          row(256, 50.0, executor="host"), row(256, 40.0, ordered=True), row(1024, ordered=True)]
  # 110 / 100 - 1 = +10 %; the host row and the other unrolling are not the same program.
  assert gpu_check.ordered_against_unordered(rows) == (
      "64: 110.0 against 100.0 (+10.0 %); 256: needs the float32 row of the same compiled "
      "program; 1024: no rate (incomplete)")
  assert gpu_check.ordered_against_unordered(rows[:2]) == ""


def test_unknown_executor_is_refused(tmp_path):
  with pytest.raises(ValueError, match="host"):
    gpu_check.parts(tiny=True, out=str(tmp_path), executor="fast")


def test_every_timed_part_runs_under_the_chosen_executor(tmp_path):
  parts = gpu_check.parts(tiny=True, out=str(tmp_path), executor="compiled")
  timed = [p for p in parts if p.name not in ("info", "accelerator_host")]
  assert all("--executor=compiled" in p.argv or "--config.executor=compiled" in p.argv
             for p in timed)


def test_launch_script_installs_wheels_without_the_network():
  text = open(os.path.join(ROOT, "launch", "gpu_check.sh")).read()
  pip_lines = [line for line in text.splitlines() if "pip install" in line]
  assert pip_lines and all("--no-index" in line for line in pip_lines)


def test_summary_fits_rows_and_quotes_progress_lines(tmp_path):
  rows = [{"method": "petra", "dtype": "float32", "micro_batch": b, "tick_ms": 8.8 + 0.02 * b,
           "device_ms": 0.02 * b, "profiled_tick_ms": 9.0 + 0.02 * b,
           "busy_fraction": 0.5, "device_idle_us_per_tick": 9.0, "compile_s": 1.0,
           "images_per_s": 1.0} for b in (64, 256, 1024)]
  (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
  (tmp_path / "train.log").write_text("step 5/9: 10.0 img/s\nstep 7/9: 12.5 img/s\ndone\n")
  (tmp_path / "language_model.log").write_text("step 3/9: 2.0 sequences/s, 512 tokens/s\n")
  (tmp_path / "recipe_rows.jsonl").write_text(json.dumps({**rows[0], "images_per_s": 50.0}))
  text = gpu_check.summary(str(tmp_path), [{"name": "train", "status": "stopped",
                                            "seconds": 90.0}])
  assert "train: stopped (90 s)" in text
  assert "petra float32: tick H = 8.800 ms + C = 0.02000 ms/image" in text
  assert "main job: step 7/9: 12.5 img/s" in text
  assert "language model: step 3/9: 2.0 sequences/s, 512 tokens/s" in text
  assert "main job against the benchmark on its recipe: 12.5 img/s / 50.0 img/s = 25 %" in text
  assert text.count("petra float32: tick") == 1  # the recipe's row (k = 2) is not in the fit


def test_main_job_against_benchmark_says_what_is_missing():
  assert gpu_check.against_benchmark("", [{"images_per_s": 3.0}]) == "needs a progress line"
  assert gpu_check.against_benchmark("step 1/2: 1.0 img/s", [{"incomplete": "compiling"}]) == (
      "needs the recipe's row")


def test_tiny_check_runs_on_the_cpu(tmp_path):
  out = tmp_path / "check"
  env = {**os.environ, "PYTHON": sys.executable}
  r = subprocess.run([os.path.join(ROOT, "launch", "gpu_check.sh"), "--tiny",
                      "--parts=info,accelerator_float32", f"--out={out}"],
                     capture_output=True, text=True, env=env, timeout=400, check=False)
  assert r.returncode == 0, r.stdout + r.stderr
  assert "jax" in (out / "info.log").read_text()
  rows = [json.loads(x) for x in (out / "rows.jsonl").read_text().splitlines()]
  assert {(x["method"], x["micro_batch"], x["dtype"]) for x in rows} == {
      (m, b, "float32") for m in ("petra", "backprop") for b in (2, 4)}
  assert all(0 < x["busy_fraction"] <= 1 and x["device_idle_us_per_tick"] >= 0 for x in rows)
  assert "petra float32 host: tick H =" in (out / "summary.txt").read_text()
  with tarfile.open(f"{out}.tar.gz") as tar:
    names = set(tar.getnames())
  assert {"check/info.log", "check/rows.jsonl", "check/summary.txt",
          "check/accelerator_float32.log"} <= names


def test_an_optional_part_runs_only_when_named(tmp_path, monkeypatch):
  ran = []
  monkeypatch.setattr(gpu_check, "run_part",
                      lambda part, out: ran.append(part.name) or {"status": 0})
  monkeypatch.setattr(gpu_check, "summary", lambda out, results: "")
  monkeypatch.setattr(gpu_check, "bundle", lambda out: out + ".tar.gz")
  assert gpu_check.main(["--tiny", f"--out={tmp_path / 'a'}"]) == 0
  assert "accelerator_ordered" not in ran and "accelerator_float32" in ran
  assert "train_profile" not in ran
  ran.clear()
  assert gpu_check.main(["--tiny", f"--out={tmp_path / 'b'}", "--parts=accelerator_ordered"]) == 0
  assert ran == ["accelerator_ordered"]
