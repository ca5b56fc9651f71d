"""docs/examples/ do what they claim: they train (losses fall), the NNX and
linen examples are one model, own_loop reads the trained variables back."""

import json
import math
import os
import pathlib
import subprocess
import sys
import textwrap

import jax
import numpy as np
import optax
import pytest

import petra_jax
from helpers import random_batch, without_virtual_devices

REPO = pathlib.Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "docs" / "examples"
CHANCE_LOSS = math.log(10)  # cross-entropy of a uniform prediction over 10 classes


def _run(script, *args, tmp_path):
  # One CPU device, as a user's machine; conftest's compile options kept.
  env = dict(without_virtual_devices(os.environ),
             PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
             TMPDIR=str(tmp_path))  # custom_linen.py's tempfile.mkdtemp workdir: removed with tmp_path
  r = subprocess.run([sys.executable, *script, *args], cwd=tmp_path, env=env,
                     capture_output=True, text=True, timeout=600)
  assert r.returncode == 0, r.stderr[-3000:]
  return r.stdout


def _logged(workdir, key):
  lines = (workdir / "metrics.jsonl").read_text().splitlines()
  return [r[key] for r in map(json.loads, lines) if key in r]


@pytest.mark.slow
@pytest.mark.parametrize("script", [  # custom_nnx.py's model is custom_linen.py's (below): long
    "custom_linen.py", pytest.param("custom_nnx.py", marks=pytest.mark.long)])
def test_custom_model_example_trains(script, cifar10_dir, tmp_path):
  """20 updates at width 2: the logged train loss falls, and the test loss
  ends below chance's."""
  out = _run([str(EXAMPLES / script)], "--steps", "20", "--width", "2",
             "--data_dir", cifar10_dir, tmp_path=tmp_path)
  assert "'test_accuracy'" in out.splitlines()[-1]  # it prints the test metrics
  (workdir,) = tmp_path.glob("petra_example_*")
  losses = _logged(workdir, "train_loss")  # means over steps 1-10 and 11-20
  assert len(losses) == 2 and losses[1] < losses[0], losses
  assert _logged(workdir, "test_loss")[-1] < CHANCE_LOSS


def _nnx_as_linen(tree):
  """An NNX example stage's variables under the linen example's names: its
  ``ConvBN`` attributes (``layer``; ``a``, ``b``; ``x1``, ``x2``: sorted is
  call order) become ``Conv_i``/``BatchNorm_i``, ``dense`` ``Dense_0``."""
  if "dense" in tree:
    return {"Dense_0": tree["dense"]}
  names = {"conv": "Conv", "bn": "BatchNorm"}
  return {f"{names[part]}_{i}": tree[attr][part]
          for i, attr in enumerate(sorted(tree)) for part in tree[attr]}


def _example_losses(stages, variables=None, num_micro=8):
  """Backprop (one jitted step: the model, not the schedule, is under test),
  k = 2, SGD, on random 8x8 images: per-micro-batch losses and the initial
  variables; ``variables`` (per stage ``(params, batch_stats)``) replace the
  initial ones."""
  tx = optax.MultiSteps(optax.sgd(0.05, momentum=0.9), 2)
  pipe = petra_jax.Pipeline(stages, tx, jax.devices()[:1], method="backprop",
                            accumulation_steps=2)
  batches = lambda m: random_batch(batch=8, size=8, seed=m % 2)  # noqa: E731
  state = pipe.init(0, batches(0)[0])
  init = [(jax.tree.map(np.array, s.params), jax.tree.map(np.array, s.batch_stats))
          for s in state.train_states]
  if variables is not None:
    for j, (want, (params, stats)) in enumerate(zip(init, variables)):
      jax.tree.map(lambda a, b: np.testing.assert_equal(a.shape, b.shape), want, (params, stats))
      state.stage_states[j] = petra_jax.StageState.create(params, stats, tx)
  state, out = pipe.run(state, pipe.schedule(num_micro), batches)
  return np.array([float(o.loss) for o in sorted(out)]), init


def test_nnx_and_linen_examples_are_one_model(monkeypatch):
  """custom_nnx.py's model is custom_linen.py's: from the NNX model's initial
  weights, renamed, the linen model trains to the same losses."""
  monkeypatch.syspath_prepend(str(EXAMPLES))
  import custom_linen  # noqa: PLC0415
  import custom_nnx  # noqa: PLC0415
  nnx_losses, nnx_init = _example_losses(custom_nnx.reversible_cnn(width=2))
  renamed = [tuple(_nnx_as_linen(t) for t in v) for v in nnx_init]
  linen_losses, _ = _example_losses(custom_linen.reversible_cnn(width=2), renamed)
  # Measured: equal bit for bit; 1e-6 allows another XLA fusion of the two traces.
  np.testing.assert_allclose(linen_losses, nnx_losses, rtol=1e-6)
  assert nnx_losses[-2:].mean() < nnx_losses[:2].mean()  # it trains


# Runs own_loop.py as a script, then compares what it read back with the pipeline.
OWN_LOOP_CHECKS = textwrap.dedent("""
    import json, runpy, sys
    import jax, numpy as np
    sys.argv = sys.argv[1:]  # own_loop.py and its flags
    g = runpy.run_path(sys.argv[0], run_name="__main__")
    pipe, trained, variables = g["pipe"], g["state"].train_states, g["variables"]
    first = g["batch_fn"](g["train"], g["rows"][0], jax.random.key(0))[0]
    initial = pipe.init(seed=0, sample_input=first).train_states
    same = lambda a, b: all(np.array_equal(u, v) for u, v in
                            zip(jax.tree.leaves(a), jax.tree.leaves(b)))
    print(json.dumps({
        "read_back": [same(v["params"], s.params) and same(v["batch_stats"], s.batch_stats)
                      for v, s in zip(variables, trained)],
        "changed": [not same(v["params"], s.params) for v, s in zip(variables, initial)]}))
    """)


@pytest.mark.long  # the own loop's API (init, run_tick, predict, trained_variables): test_first_hour
@pytest.mark.slow
def test_own_loop_example_reads_back_trained_variables(cifar10_dir, tmp_path):
  """own_loop.py prints every micro-batch's loss and the same logits through
  plain Flax; the variables it reads back are the pipeline's trained ones
  (parameters and BatchNorm statistics), and every stage's parameters differ
  from its initial ones (the run drains: each stage took every gradient)."""
  steps = 3
  out = _run(["-c", OWN_LOOP_CHECKS, str(EXAMPLES / "own_loop.py")], "--steps", str(steps),
             "--data_dir", cifar10_dir, tmp_path=tmp_path)
  lines = out.splitlines()
  assert [line.split(":")[0] for line in lines[:steps]] == [
      f"micro-batch {m}" for m in range(steps)]
  assert all(np.isfinite(float(line.split("loss ")[1])) for line in lines[:steps])
  assert "test accuracy (500 images)" in out and "same logits: True" in lines
  checks = json.loads(lines[-1])
  assert all(checks["read_back"]) and all(checks["changed"]), checks


@pytest.mark.long  # test_api's user MODULE:FUNCTION model through the same CLI hook (CI time)
@pytest.mark.slow
def test_my_models_example_runs_the_cli(cifar10_dir, tmp_path):
  _run([str(EXAMPLES / "my_models.py")], "--steps", "2", "--data_dir", cifar10_dir,
       "--workdir", str(tmp_path / "run"), tmp_path=tmp_path)
  assert len(_logged(tmp_path / "run", "train_loss")) >= 1


def test_every_example_has_steps_and_a_docstring():
  for path in EXAMPLES.glob("*.py"):
    text = path.read_text()
    assert text.startswith('"""') and "--steps" in text, path.name
