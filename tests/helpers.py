"""Shared helpers for tests: tiny models and an independent composed loss."""

import jax
import jax.numpy as jnp
import numpy as np
import optax

from petra_jax import stage as stage_lib


def random_batch(batch=8, size=16, num_classes=10, seed=0):
  rng = np.random.default_rng(seed)
  x = jnp.asarray(rng.normal(size=(batch, size, size, 3)), jnp.float32)
  y = jnp.asarray(rng.integers(0, num_classes, batch), jnp.int32)
  return x, y


def composed_loss(stages, params, batch_stats, x, labels):
  """Loss of the composed model, written independently of the engine.

  The reversible coupling is spelt out here, (y1, y2) = (x2 + F(x1), x1),
  so this does not reuse petra_jax.stage.forward.
  """
  h = x
  for s, p, bs in zip(stages, params, batch_stats):
    variables = {"params": p, "batch_stats": bs} if bs else {"params": p}
    if s.reversible:
      x1, x2 = h
      f, _ = s.module.apply(variables, x1, train=True, mutable=["batch_stats"])
      h = (x2 + f, x1)
    else:
      h, _ = s.module.apply(variables, h, train=True, mutable=["batch_stats"])
  return optax.softmax_cross_entropy_with_integer_labels(h, labels).mean()


def rel_err(a, b):
  """||a - b|| / ||b|| over all leaves of two pytrees."""
  la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
  num = sum(float(jnp.sum((u - v) ** 2)) for u, v in zip(la, lb))
  den = sum(float(jnp.sum(v ** 2)) for v in lb)
  return (num / den) ** 0.5


def batches_of(seed_offset=0, **kwargs):
  """``m -> random_batch(seed=m + seed_offset)``: a different batch per micro-batch."""
  return lambda m: random_batch(seed=m + seed_offset, **kwargs)


def run_ticks(pipe, state, num_micro_batches, batches, num_ticks=None):
  """Runs the first ``num_ticks`` ticks (default: all) of the pipeline's
  schedule over ``num_micro_batches``; returns ``(state, outputs)``."""
  table = pipe.schedule(num_micro_batches)
  n = len(table) if num_ticks is None else num_ticks
  return pipe.run(state, (table[t] for t in range(n)), batches)
