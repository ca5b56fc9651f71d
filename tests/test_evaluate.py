"""Evaluation (``training.evaluate.evaluate`` over ``Pipeline.predict``) after
a few PETRA updates, against the composed model's eval-mode forward written
independently of the engine (helpers.composed_logits) with the pipeline's
current weights and running BatchNorm statistics."""

import jax
import numpy as np
import optax
import pytest

from helpers import batches_of, composed_logits, loss_and_accuracy, run_ticks, tiny_revnet
from petra_jax import models
from petra_jax.data import sources
from petra_jax.engine import pipeline
from petra_jax.training import evaluate

INFO = sources.DatasetInfo("synthetic", 10, (16, 16, 3), mean=(0.4, 0.5, 0.6),
                           std=(0.2, 0.25, 0.3))
N = 75  # 5 batches of 16, the last one padded


def _split(seed=1):
  rng = np.random.default_rng(seed)
  images = rng.integers(0, 256, (N, 16, 16, 3), dtype=np.uint8)
  return sources.Split(images, rng.integers(0, 10, N).astype(np.int32))


def _revvit():
  return models.build_model("revvit_tiny", width=2, depth=1)


@pytest.mark.parametrize("build", [tiny_revnet, _revvit], ids=["revnet", "revvit"])
def test_evaluation_equals_the_composed_eval_forward(build):
  stages = build()
  pipe = pipeline.Pipeline(stages, optax.sgd(0.1, momentum=0.9), jax.devices()[:1],
                           method="petra")
  state = pipe.init(0, batches_of()(0)[0])
  init_stats = [jax.tree.map(np.array, s.batch_stats) for s in state.train_states]
  state, out = run_ticks(pipe, state, 6, batches_of(seed_offset=3))
  assert len(out) == 6 and state.in_flight() == 0
  params = [s.params for s in state.train_states]
  stats = [s.batch_stats for s in state.train_states]
  if jax.tree.leaves(stats):  # the RevNet's running statistics moved off init
    assert not all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(stats),
                                                          jax.tree.leaves(init_stats)))

  split = _split()
  got = evaluate.evaluate(pipe, state, split, INFO, batch_size=16)

  mean, std = np.array(INFO.mean), np.array(INFO.std)
  x = ((split.images / 255.0 - mean) / std).astype(np.float32)
  forward = jax.jit(lambda p, s, x: composed_logits(stages, p, s, x))  # eager: seconds
  want_loss, want_acc = loss_and_accuracy(forward(params, stats, x), split.labels)
  # float32 round-off of the forward (XLA's fusions) and of the per-batch sums.
  np.testing.assert_allclose(got["test_loss"], want_loss, rtol=2e-6)
  assert got["test_accuracy"] == want_acc
  assert 0.0 < want_acc < 1.0
