"""Gradient-quality diagnostics (paper App. B) and the plots command."""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from petra_jax.training import validation
from petra_jax import models, train

from petra_jax.engine.stages import diagnostics

from petra_jax.training import metrics

from petra_jax.engine import methods, observers

from petra_jax.engine import pipeline
from petra_jax.engine.stages.stage import Stage
from helpers import random_batch
from helpers import REPO, tiny_config



def _small_revnet():
  """Five stages of RevNet blocks at width 4: stem, reversible, downsampling,
  reversible, head (both kinds of backward, BatchNorm, 16x16 inputs)."""
  return [Stage("stem", models.Stem(4), False),
          Stage("rev0", models.BasicResidual(4), True),
          Stage("down1", models.BasicDownsample(8), False),
          Stage("rev1", models.BasicResidual(8), True),
          Stage("head", models.Head(10), False)]


def test_cosine_and_norm_ratio_match_a_hand_computation():
  rng = np.random.default_rng(0)
  a = {"w": rng.normal(size=(2, 3)), "b": rng.normal(size=(4,))}
  b = {"w": rng.normal(size=(2, 3)), "b": rng.normal(size=(4,))}
  va = np.concatenate([a["b"], a["w"].ravel()])  # (leaf order does not matter
  vb = np.concatenate([b["b"], b["w"].ravel()])  #  as long as it is the same)
  cos = va @ vb / (np.sqrt(va @ va) * np.sqrt(vb @ vb))
  ratio = np.sqrt(va @ va) / np.sqrt(vb @ vb)
  ja, jb = jax.tree.map(jnp.float32, a), jax.tree.map(jnp.float32, b)
  # float32 inputs: agreement to a few ulps of the sums of 10 products.
  np.testing.assert_allclose(diagnostics.cosine_similarity(ja, jb), cos, rtol=1e-5)
  np.testing.assert_allclose(diagnostics.norm_ratio(ja, jb), ratio, rtol=1e-5)
  minus_3a = jax.tree.map(lambda x: -3 * x, ja)
  np.testing.assert_allclose(diagnostics.cosine_similarity(minus_3a, ja), -1.0, rtol=1e-6)
  np.testing.assert_allclose(diagnostics.norm_ratio(minus_3a, ja), 3.0, rtol=1e-6)


def _run(method, num_ticks, zero_delay=False, lr=0.5):
  stages = _small_revnet()
  probe = observers.GradientProbe(every_updates=1 if zero_delay else 3)
  pipe = pipeline.Pipeline(stages, optax.sgd(lr, momentum=0.9), jax.devices()[:1],
                           method="revprop" if zero_delay else method, observers=[probe])
  state = pipe.init(0, random_batch(size=16)[0])
  table = pipe.schedule(num_ticks)
  state, _ = pipe.run(state, table, lambda m: random_batch(size=16, seed=m))
  quality = [(m, jax.device_get(q)) for m, q in probe.pop_results(wait=True)]
  assert not probe._probes  # every probe finished
  return pipe, probe, stages, quality


def test_zero_delay_gives_three_equal_gradients():
  # revprop: each micro-batch is drained before the next, so each stage's
  # forward and backward use the same weights, and those are the current ones;
  # the weights do change between micro-batches (lr 0.5, momentum 0.9).
  pipe, _, stages, quality = _run("petra", 3, zero_delay=True)
  assert [m for m, _ in quality] == [0, 1, 2]
  for m, q in quality:
    assert set(q) == set(diagnostics.METRICS)
    for name, v in q.items():
      assert v.shape == (len(stages),)
      # PETRA's gradient differs from the others by the reconstruction's
      # float32 round-off, relative ~1e-6 (test_stage): the norm ratio is off
      # by that much, the cosine by its square (1 - cos ~ eps^2 / 2).
      tol = 1e-5 if name.startswith("cos") else 1e-4
      np.testing.assert_allclose(v, 1.0, atol=tol, err_msg=f"{name} at micro-batch {m}")


def test_petra_with_delays_gives_cosines_in_range_and_differs():
  pipe, probe, stages, quality = _run("petra", 12)
  J = len(stages)
  assert [m for m, _ in quality] == [0, 3, 6, 9]
  for m, q in quality:
    for name, v in q.items():
      assert np.all(np.isfinite(v)), (name, m)
      if name.startswith("cos"):
        assert np.all((-1 - 1e-6 <= v) & (v <= 1 + 1e-6)), (name, m, v)
      else:
        assert np.all(v > 0), (name, m, v)
    # The last stage has no delay and its input is the forward's own output:
    # PETRA's and the delayed gradient coincide there.
    np.testing.assert_allclose(q["cos_applied_delayed"][J - 1], 1.0, atol=1e-5)
  # ... but with delays of up to 2(J-1) updates, the first stage's do not.
  last = quality[-1][1]
  assert last["cos_applied_delayed"][0] < 0.999, last["cos_applied_delayed"]
  assert np.abs(last["norm_ratio_applied_e2e"] - 1).max() > 1e-3
  # One compilation each, whatever the number of probes.
  for fn in ([s._gradient for s in pipe.steps] + [probe._quality]
             + [s.jitted_steps()[1] for s in pipe.steps]):
    assert fn._cache_size() == 1  # compiled, and only once


def test_delayed_method_applies_the_delayed_gradient():
  """PipeDream (stashed inputs and weights) computes exactly the delayed gradient."""
  _, _, _, quality = _run("delayed", 9)
  for m, q in quality:
    np.testing.assert_allclose(q["cos_applied_delayed"], 1.0, atol=1e-5, err_msg=str(m))
    np.testing.assert_allclose(q["norm_ratio_applied_delayed"], 1.0, atol=1e-4, err_msg=str(m))
  assert quality[-1][1]["cos_delayed_e2e"][0] < 0.999  # and it is not the end-to-end one


def test_without_observers_no_diagnostic_runs():
  """No observer: the tick calls the task functions directly, and no
  gradient-only step is ever built."""
  pipe = pipeline.Pipeline(_small_revnet(), optax.sgd(0.1), jax.devices()[:1])
  assert pipe._run_task == pipe._run_plain
  state = pipe.init(0, random_batch(size=16)[0])
  pipe.run(state, pipe.schedule(2), lambda m: random_batch(size=16, seed=m))
  assert not any(hasattr(s, "_gradient") for s in pipe.steps)


def test_plots_without_metrics_is_one_clear_error(tmp_path):
  r = subprocess.run([sys.executable, "-m", "petra_jax.plots", str(tmp_path / "none")],
                     cwd=REPO, capture_output=True, text=True, timeout=120)
  assert r.returncode == 1
  assert "Traceback" not in r.stderr
  assert "error: no metrics file" in r.stderr


def test_grad_quality_needs_a_pipelined_method():
  c = tiny_config("unused", method="backprop", grad_quality_every=5)
  with pytest.raises(validation.ConfigError, match="grad_quality_every"):
    validation.validate_config(c, len(jax.local_devices()))


@pytest.mark.long
@pytest.mark.slow
def test_tiny_run_logs_grad_quality_and_plots_render(cifar10_dir, tmp_path):
  c = tiny_config(cifar10_dir, steps_per_epoch=20, grad_quality_every=5, log_every=5)
  train.train_and_evaluate(c, str(tmp_path))
  records = metrics.read_metrics(str(tmp_path))
  J = len(models.build_model("revnet18", width=4))
  lines = [r for r in records if any(k.startswith("grad_quality/") for k in r)]
  # Micro-batches 0, 5, 10 and 15 are probed (k = 1): steps 1, 6, 11, 16.
  assert sorted(r["step"] for r in lines) == [1, 6, 11, 16]
  for r in lines:
    for name in diagnostics.METRICS:
      for j in range(J):
        v = r[diagnostics.metric_key(name, j)]
        assert np.isfinite(v)
        if name.startswith("cos"):
          assert -1 - 1e-6 <= v <= 1 + 1e-6
  assert "grad_quality/cos_applied_e2e/stage_3" in lines[0]
  # A recorded timeline is drawn too.
  with open(tmp_path / "timeline.json", "w") as f:
    json.dump({"num_stages": 3, "events": [[0, 0, "F", 0], [1, 1, "F", 0], [2, 2, "F", 0],
                                            [2, 2, "B", 0], [3, 1, "B", 0], [4, 0, "B", 0]]}, f)
  r = subprocess.run([sys.executable, "-m", "petra_jax.plots", str(tmp_path), "--smooth=2"],
                     cwd=REPO, capture_output=True, text=True, timeout=300)
  assert r.returncode == 0, r.stderr
  names = {"training.png", "grad_quality_cos.png", "grad_quality_norm_ratio.png",
           "grad_quality_by_stage.png", "timeline.png"}
  assert names <= set(os.listdir(tmp_path / "plots"))
  for name in names:
    path = tmp_path / "plots" / name
    assert path.stat().st_size > 10_000, name  # a rendered figure, not an empty file
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("method", sorted(methods.ALL_METHODS))
def test_each_method_with_gradient_probes_is_probed_or_refused_in_one_line(method):
  """What the method's row says (``probed``) decides: accepted, or one line naming the flag."""
  c = tiny_config("unused", method=method, grad_quality_every=2)
  if methods.get(method).probed:
    validation.validate_config(c, len(jax.local_devices()))
    return
  with pytest.raises(validation.ConfigError) as e:
    validation.validate_config(c, len(jax.local_devices()))
  assert "\n" not in str(e.value) and "--config.grad_quality_every=0" in str(e.value)


@pytest.mark.parametrize("method", ["gpipe"] + [
    pytest.param(m, marks=pytest.mark.long) for m in ("approximate_input", "dsp", "1f1b")])
def test_a_probed_method_produces_its_probes(method):
  """(petra, delayed and revprop: the tests above.)"""
  _, _, stages, quality = _run(method, 8)
  assert [m for m, _ in quality] == [0, 3, 6]
  for _, q in quality:
    assert set(q) == set(diagnostics.METRICS)
    assert all(np.all(np.isfinite(v)) and len(v) == len(stages) for v in q.values())
