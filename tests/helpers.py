"""Shared helpers for tests: tiny models and an independent composed loss."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax



def random_batch(batch=8, size=16, num_classes=10, seed=0):
  rng = np.random.default_rng(seed)
  x = jnp.asarray(rng.normal(size=(batch, size, size, 3)), jnp.float32)
  y = jnp.asarray(rng.integers(0, num_classes, batch), jnp.int32)
  return x, y


def composed_loss(stages, params, batch_stats, x, labels):
  """Loss of the composed model, written independently of the engine.

  The reversible coupling is spelt out here, (y1, y2) = (x2 + F(x1), x1),
  so this does not reuse petra_jax.engine.stage.forward.
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


def random_variables(stage, x, seed):
  """Variables shaped like ``stage.init``'s, filled by numpy.

  Fast: real init compiles jax.random's threefry once per kernel shape, which
  takes seconds per stage on a small CPU. Kernels get He-normal values, 1-D
  variables (BN scale, bias and statistics, dense bias) values in [0.5, 1.5].
  """
  rng = np.random.default_rng(seed)
  shapes = jax.eval_shape(functools.partial(stage.init, jax.random.key(0)), x)

  def fill(a):
    if len(a.shape) >= 2:
      std = (2 / math.prod(a.shape[:-1])) ** 0.5
      return jnp.asarray(rng.normal(0.0, std, a.shape), jnp.float32)
    return jnp.asarray(rng.uniform(0.5, 1.5, a.shape), jnp.float32)

  return jax.tree.map(fill, shapes)


def tiny_revnet():
  """stem, rev, downsample, rev, head: a 5-stage RevNet of width 2 (fast to compile)."""
  from petra_jax import models  # pylint: disable=g-import-not-at-top
  from petra_jax.engine.stage import Stage  # pylint: disable=g-import-not-at-top
  return [Stage("stem", models.Stem(2), False),
          Stage("rev0", models.BasicResidual(2), True),
          Stage("down", models.BasicDownsample(4, 2), False),
          Stage("rev1", models.BasicResidual(4), True),
          Stage("head", models.Head(10), False)]


def zero_delay_update_errors(stages, method: str) -> list:
  """Per stage, the relative error between ``method``'s update with every
  delay 0 (one micro-batch drained through ``drained_step``, SGD
  with rate 1) and ``-jax.grad`` of the composed model (:func:`composed_loss`,
  an independent composition) at the same weights."""
  from petra_jax.engine import pipeline  # pylint: disable=g-import-not-at-top
  pipe = pipeline.Pipeline(stages, optax.sgd(1.0), jax.devices()[:1], method=method)
  x, y = random_batch()
  state = pipe.init(0, x)
  params = [jax.tree.map(lambda a: a.copy(), s.params) for s in state.train_states]
  stats = [s.batch_stats for s in state.train_states]
  ref = jax.grad(lambda p: composed_loss(stages, p, stats, x, y))(params)
  state, _ = drained_step(pipe, state, x, y)
  step = jax.tree.map(lambda b, a: b - a, params, [s.params for s in state.train_states])
  return [rel_err(step[j], ref[j]) for j in range(len(stages))]


def drained_step(pipe, state, images, labels):
  """One micro-batch with every delay 0: the method's stage steps on the
  ``drained`` table. Returns ``(new_state, loss)``."""
  from petra_jax.engine.schedule import Schedule  # noqa: PLC0415
  state, outs = pipe.run(state, Schedule("drained", pipe.num_stages, 1),
                         lambda m: (images, labels))
  return state, outs[0].loss
