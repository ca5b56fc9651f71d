"""The engine's ``delayed`` method on a RevViT against an independent reference.

The reference is backprop of the composed model (``helpers.composed_loss``)
in a plain Python loop: stage ``j``'s forward for micro-batch ``m`` uses its
weights after ``max(m - tau_j, 0)`` gradients (``tau_j = 2 (J-1-j)`` ticks),
and its gradient joins stage ``j``'s queue in micro-batch order; every ``k``
gradients their mean goes through ``optax.adamw``.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from petra_jax.engine import partition
from helpers import composed_loss, random_batch

from petra_jax import config as config_lib
from petra_jax import models
from petra_jax.engine import pipeline
from petra_jax.optim import compensation

SIZES, K, LR, WD, WARMUP, POOL = (2, 1, 1, 2), 2, 3e-3, 0.05, 10, 6


def _config():
  c = config_lib.get_config()
  c.batch_size, c.accumulation_steps, c.num_epochs = 16, K, 100
  o = c.optim
  o.name, o.learning_rate, o.weight_decay, o.schedule = "adam", LR, WD, "constant"
  o.warmup_epochs = 1.0  # steps_per_epoch = WARMUP below
  return c


def _batch(m):
  return random_batch(seed=m % POOL)


def _engine_losses(stages, params0_seed, num_micro):
  txs = compensation.stage_optimizers(_config(), WARMUP, len(stages))
  pipe = pipeline.Pipeline(stages, txs, jax.devices()[:1], method="delayed",
                           accumulation_steps=K)
  state = pipe.init(params0_seed, _batch(0)[0])
  params0 = [jax.tree.map(jnp.copy, s.params) for s in state.train_states]
  table = pipe.schedule(num_micro)
  state, out = pipe.run(state, (table[t] for t in range(len(table))), _batch)
  return params0, np.array([float(o.loss) for o in sorted(out)])


def _reference_losses(blocks, params0, num_micro):
  J = len(SIZES)
  owner = [j for j, n in enumerate(SIZES) for _ in range(n)]
  split = lambda p, j: [p[f"block_{i}"] for i in range(SIZES[j])] if SIZES[j] > 1 else [p]
  versions = [[split(p, j)] for j, p in enumerate(params0)]  # versions[j][n]: after n grads
  sched = optax.linear_schedule(0.0, LR, WARMUP)
  mask = lambda tree: jax.tree_util.tree_map_with_path(
      lambda path, _: path[-1].key == "kernel", tree)
  txs = [optax.adamw(sched, 0.9, 0.999, 1e-8, weight_decay=WD, mask=mask) for _ in range(J)]
  opt = [tx.init(v[0]) for tx, v in zip(txs, versions)]
  queue = [[] for _ in range(J)]
  current = [v[0] for v in versions]

  @jax.jit
  def loss_and_grad(flat, x, y):
    return jax.value_and_grad(lambda p: composed_loss(blocks, p, [{}] * len(p), x, y))(flat)

  losses = []
  for m in range(num_micro):
    mixed = [versions[j][max(m - 2 * (J - 1 - j), 0)] for j in range(J)]
    flat = [b for v in mixed for b in v]
    loss, g = loss_and_grad(flat, *_batch(m))
    losses.append(float(loss))
    for j in range(J):
      queue[j].append([g[i] for i in range(len(flat)) if owner[i] == j])
      if len(queue[j]) == K:
        mean = jax.tree.map(lambda *a: sum(a) / K, *queue[j])
        upd, opt[j] = txs[j].update(mean, opt[j], current[j])
        current[j] = optax.apply_updates(current[j], upd)
        queue[j] = []
      versions[j].append(current[j])
  return np.array(losses)


def test_delayed_matches_a_python_queue_of_stale_gradients():
  """revvit_tiny in 4 stages (delays 6, 4, 2, 0 ticks; k = 2: 3, 2, 1, 0 updates),
  AdamW with warm-up: per micro-batch losses equal over 20 updates, and at
  update 100."""
  blocks = models.build_model("revvit_tiny", width=2, depth=2)
  stages = partition.group_stages(blocks, SIZES)
  num_micro = 100 * K
  params0, got = _engine_losses(stages, 0, num_micro)
  want = _reference_losses(blocks, params0, num_micro)
  np.testing.assert_allclose(got[:20 * K], want[:20 * K], rtol=1e-5)
  np.testing.assert_allclose(got[-K:], want[-K:], rtol=1e-4)
  assert want[-K:].mean() < 0.5 * want[:K].mean()  # it trains
