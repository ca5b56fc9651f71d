"""``--config.profile_steps``: a window of a run traced with jax.profiler
(petra_jax/training/profile_window.py)."""

import glob
import os
import re

import jax
import pytest

from petra_jax import train
from petra_jax.benchmarks import device_time
from petra_jax.benchmarks import gpu_check
from petra_jax.training import profile_window
from tests.helpers import tiny_config


@pytest.mark.parametrize("spec,bounds", [("", None), ("0:1", (0, 1)), ("100:120", (100, 120))])
def test_a_window_reads_as_two_update_counts(spec, bounds):
  assert profile_window.parse(spec) == bounds


@pytest.mark.parametrize("spec", ["3:3", "4:2", "-1:2", "5", "1:2:3", "a:b", "100-120"])
def test_a_window_that_is_not_start_before_stop_is_refused(spec):
  with pytest.raises(ValueError, match="--config.profile_steps=100:120"):
    profile_window.parse(spec)


def _trace(workdir: str):
  found = glob.glob(os.path.join(workdir, "profile", "**", "*.xplane.pb"), recursive=True)
  assert len(found) == 1, found
  return jax.profiler.ProfileData.from_file(found[0])


def _count(data, name: str) -> int:
  return sum(e.name == name for plane in data.planes for line in plane.lines for e in line.events)


def test_a_run_traces_its_window(cifar10_dir, tmp_path):
  # 2 stages, k = 1, one tick a call (the host executor): update u is fed at tick u - 1, so the
  # trace starts after tick 1 (update 2 fed) and stops after tick 3 (update 4): two calls.
  c = tiny_config(cifar10_dir, max_steps=8, eval_every=0, checkpoint_every=0,
                  checkpoint_minutes=0, executor="host", profile_steps="2:4",
                  eval_examples=32, eval_batch_size=32, **{"model.width": 2, "model.num_stages": 2})
  train.train_and_evaluate(c, str(tmp_path / "window"))
  data = _trace(str(tmp_path / "window"))
  assert _count(data, profile_window.CALL_EVENT) == 2
  assert _count(data, profile_window.WINDOW_EVENT) == 1
  assert list(device_time.device_events(data, "cpu"))  # the stages' programs ran inside it
  # What the GPU check's summary says of such a trace: the device's time inside the window.
  said = gpu_check.profile_summary(str(tmp_path / "window"))
  busy, wall, percent = re.match(
      r"device busy ([0-9.]+) ms of a ([0-9.]+) ms window \(([0-9]+) %", said).groups()
  assert 0 < float(busy) <= float(wall) and 0 < int(percent) <= 100, said
  calls, taking, between = (float(x) for x in re.search(
      r"host: ([0-9.]+) ms in executor calls \(([0-9.]+) ms of them taking micro-batches\), "
      r"(-?[0-9.]+) ms between calls", said).groups())
  # One thread runs the calls one after another, and takes the micro-batches inside them.
  assert 0 < taking <= calls <= float(wall) and between >= 0, said
  assert gpu_check.profile_summary(str(tmp_path / "nowhere")).startswith("none (")


@pytest.mark.parametrize("spec,step", [("", 0), ("2:4", 4)])
def test_no_window_or_a_run_resumed_past_it_traces_nothing(tmp_path, spec, step):
  with profile_window.ProfileWindow(spec, str(tmp_path), step) as window:
    for s in range(step, step + 6):
      window.after_call(s + 1, state=None)
  assert not os.path.exists(tmp_path / "profile")
