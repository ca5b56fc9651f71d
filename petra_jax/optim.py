"""Optimizers and learning-rate schedules (all from optax).

The paper's recipe (Sec. 4, "Experimental setup"): SGD with Nesterov momentum
0.9, weight decay on conv and dense kernels only (5e-4 on CIFAR-10), a linear
warm-up from 0 over 5 epochs, then the learning rate divided by 10 at given
epochs; base learning rate ``0.1 * batch_size / 256`` with ``batch_size`` the
images per update (``64 k`` in the paper). Gradients are averaged over the
``k`` micro-batches of an update by ``optax.MultiSteps`` (Alg. 1, l. 18-22),
whose counter lives in each stage's optimizer state.

Schedules count optimizer updates (one per ``batch_size`` images).
"""

from __future__ import annotations

import jax
import ml_collections
import optax

SCHEDULES = ("step", "cosine", "constant")
OPTIMIZERS = ("sgd",)


def base_learning_rate(config: ml_collections.ConfigDict) -> float:
  """``config.optim.learning_rate``, or ``0.1 * batch_size / 256`` when 0."""
  lr = config.optim.learning_rate
  return lr if lr > 0 else 0.1 * config.batch_size / 256


def learning_rate_schedule(config: ml_collections.ConfigDict,
                           steps_per_epoch: int) -> optax.Schedule:
  """Warm-up then decay, as a function of the update count.

  Args:
    config: the run config (``optim.schedule`` in ``SCHEDULES``,
      ``optim.warmup_epochs``, ``optim.decay_epochs``, ``optim.decay_factor``,
      ``num_epochs``).
    steps_per_epoch: optimizer updates per epoch.

  Raises:
    ValueError: unknown schedule name.
  """
  o = config.optim
  lr = base_learning_rate(config)
  warmup = int(round(o.warmup_epochs * steps_per_epoch))
  total = max(config.num_epochs * steps_per_epoch, warmup + 1)
  if o.schedule == "step":
    boundaries = {int(e * steps_per_epoch): o.decay_factor for e in o.decay_epochs}
    main = optax.piecewise_constant_schedule(lr, boundaries)
  elif o.schedule == "cosine":
    return optax.warmup_cosine_decay_schedule(0.0, lr, max(warmup, 1), total)
  elif o.schedule == "constant":
    main = optax.constant_schedule(lr)
  else:
    raise ValueError(f"Unknown optim.schedule {o.schedule!r}; choose one of {SCHEDULES}.")
  if warmup == 0:
    return main
  return optax.join_schedules(
      [optax.linear_schedule(0.0, lr, warmup), lambda n: main(n + warmup)], [warmup])


def kernel_mask(params):
  """True for conv and dense kernels (weight decay), False for BN and biases."""
  return jax.tree_util.tree_map_with_path(
      lambda path, _: getattr(path[-1], "key", None) == "kernel", params)


def make_optimizer(config: ml_collections.ConfigDict,
                   steps_per_epoch: int) -> optax.GradientTransformation:
  """The per-stage optimizer, with gradient accumulation over k micro-batches.

  Returns:
    ``optax.MultiSteps(chain(add_decayed_weights(wd, kernel_mask),
    sgd(schedule, momentum, nesterov)), every_k_schedule=k)``: PyTorch's SGD
    semantics (``d = g + wd theta``; ``b = mu b + d``; ``d += mu b``).

  Raises:
    ValueError: unknown optimizer or schedule, or ``accumulation_steps < 1``.
  """
  o = config.optim
  if o.name not in OPTIMIZERS:
    raise ValueError(f"Unknown optim.name {o.name!r}; choose one of {OPTIMIZERS}.")
  k = config.accumulation_steps
  if k < 1:
    raise ValueError(f"accumulation_steps must be >= 1, got {k}.")
  schedule = learning_rate_schedule(config, steps_per_epoch)
  tx = optax.chain(
      optax.add_decayed_weights(o.weight_decay, mask=kernel_mask),
      optax.sgd(schedule, momentum=o.momentum or None, nesterov=o.nesterov),
  )
  return optax.MultiSteps(tx, every_k_schedule=k) if k > 1 else tx
