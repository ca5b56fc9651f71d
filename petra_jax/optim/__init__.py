"""Optimizers and learning-rate schedules (all from optax).

The paper's recipe (Sec. 4, "Experimental setup"): SGD with Nesterov momentum
0.9, weight decay on conv and dense kernels only (5e-4 on CIFAR-10, 1e-4 on
ImageNet32 and ImageNet), a linear warm-up from 0 over 5 epochs, then the
learning rate multiplied by 0.1 at given epochs; base learning rate
``0.1 * batch_size / 256`` with ``batch_size`` the images per update (``64 k``
in the paper). Gradients are averaged over the ``k`` micro-batches of an
update by ``optax.MultiSteps`` (Alg. 1, l. 18-22), whose counter lives in each
stage's optimizer state.

Also offered (``optim.name``): LARS in its clipping form (LARC, trust
coefficient 0.02, as the authors' code) and Adam with decoupled weight decay
(AdamW); ``optim.schedule``: ``step``, ``cosine``, ``polynomial`` or
``constant``, each after the same linear warm-up.

Schedules count optimizer updates (one per ``batch_size`` images).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import ml_collections
import optax

SCHEDULES = ("step", "cosine", "polynomial", "constant")
OPTIMIZERS = ("sgd", "lars", "adam")


def base_learning_rate(config: ml_collections.ConfigDict) -> float:
  """``config.optim.learning_rate``, or ``0.1 * batch_size / 256`` when 0."""
  lr = config.optim.learning_rate
  return lr if lr > 0 else 0.1 * config.batch_size / 256


def learning_rate_schedule(config: ml_collections.ConfigDict,
                           steps_per_epoch: int) -> optax.Schedule:
  """Linear warm-up from 0, then ``optim.schedule``, by update count.

  With ``lr`` the base rate, ``W`` the warm-up updates and ``T`` the total
  (``num_epochs * steps_per_epoch``), after the warm-up:

  * ``step``: ``lr * decay_factor ** (number of decay_epochs passed)``; the
    boundaries are absolute epochs (paper: 150/225 or 30/60/80).
  * ``cosine``: from ``lr`` to ``end_learning_rate`` over ``T - W`` updates.
  * ``polynomial``: ``end + (lr - end) (1 - (n - W) / (T - W)) ** power``.
  * ``constant``: ``lr``.

  Args:
    config: the run config (``optim.schedule`` in ``SCHEDULES``,
      ``optim.warmup_epochs``, ``optim.decay_epochs``, ``optim.decay_factor``,
      ``optim.end_learning_rate``, ``optim.polynomial_power``, ``num_epochs``).
    steps_per_epoch: optimizer updates per epoch.

  Returns:
    ``schedule(update_count) -> learning rate`` (float32 scalar).

  Raises:
    ValueError: unknown schedule name.
  """
  o = config.optim
  lr = base_learning_rate(config)
  warmup = int(round(o.warmup_epochs * steps_per_epoch))
  decay_steps = max(config.num_epochs * steps_per_epoch - warmup, 1)
  end = o.end_learning_rate
  # ``main`` counts updates since the end of the warm-up.
  if o.schedule == "step":
    boundaries = {int(round(e * steps_per_epoch)) - warmup: o.decay_factor
                  for e in o.decay_epochs}
    main = optax.piecewise_constant_schedule(lr, boundaries)
  elif o.schedule == "cosine":
    main = optax.cosine_decay_schedule(lr, decay_steps, alpha=end / lr if lr else 0.0)
  elif o.schedule == "polynomial":
    main = optax.polynomial_schedule(lr, end, o.polynomial_power, decay_steps)
  elif o.schedule == "constant":
    main = optax.constant_schedule(lr)
  else:
    raise ValueError(f"Unknown optim.schedule {o.schedule!r}; choose one of {SCHEDULES}.")
  if warmup == 0:
    return main
  return optax.join_schedules([optax.linear_schedule(0.0, lr, warmup), main], [warmup])


def kernel_mask(params):
  """True for conv and dense kernels (weight decay), False for BN and biases."""
  return jax.tree_util.tree_map_with_path(
      lambda path, _: getattr(path[-1], "key", None) == "kernel", params)


class LarcState(NamedTuple):
  """State of ``scale_by_larc``: updates done, to evaluate the schedule."""
  count: jax.Array  # int32 []


def scale_by_larc(learning_rate: optax.ScalarOrSchedule, weight_decay: float,
                  trust_coefficient: float = 0.02, eps: float = 1e-8,
                  weight_decay_mask=kernel_mask) -> optax.GradientTransformation:
  """LARS in its clipping form (LARC; You et al. 2017), as NVIDIA apex's.

  Per leaf, with ``wd`` the leaf's weight decay (0 where the mask is False)::

    local_lr = trust_coefficient * |theta| / (|g| + wd |theta| + eps)
    update   = (g + wd theta) * min(local_lr / lr, 1)

  i.e. the trust ratio ``local_lr / lr`` clipped at 1: each leaf's effective
  learning rate is ``min(local_lr, lr)``. A leaf with ``|theta| = 0`` or
  ``|g| = 0`` is not rescaled (ratio 1), nor is anything while ``lr = 0``.
  Chain it before momentum and ``scale_by_learning_rate`` (see
  ``make_optimizer``). ``optax.lars`` is the unclipped form (ratio
  ``trust_coefficient * |theta| / |g|``, no division by ``lr``).

  Args:
    learning_rate: the same schedule as the optimizer's (read at the current
      update count).
    weight_decay: L2 coefficient, folded into the update.
    trust_coefficient: LARS' eta (the authors' code: 0.02).
    eps: added to the denominator.
    weight_decay_mask: pytree of bools, or a function of the params giving it.

  Returns:
    An ``optax.GradientTransformation`` whose ``update`` needs ``params``.
  """

  def init_fn(params):
    del params
    return LarcState(count=jnp.zeros([], jnp.int32))

  def update_fn(updates, state, params):
    if params is None:
      raise ValueError("scale_by_larc needs params: call update(g, state, params).")
    lr = learning_rate(state.count) if callable(learning_rate) else learning_rate
    mask = weight_decay_mask(params) if callable(weight_decay_mask) else weight_decay_mask

    def scale(g, p, decayed):
      wd = weight_decay if decayed else 0.0
      p_norm, g_norm = jnp.linalg.norm(p), jnp.linalg.norm(g)
      local_lr = trust_coefficient * p_norm / (g_norm + wd * p_norm + eps)
      ratio = jnp.where((p_norm > 0) & (g_norm > 0) & (local_lr < lr), local_lr / lr, 1.0)
      return (g + wd * p) * ratio.astype(g.dtype)

    updates = jax.tree.map(scale, updates, params, mask)
    return updates, LarcState(count=optax.safe_increment(state.count))

  return optax.GradientTransformation(init_fn, update_fn)


def make_optimizer(config: ml_collections.ConfigDict,
                   steps_per_epoch: int) -> optax.GradientTransformation:
  """The per-stage optimizer, with gradient accumulation over k micro-batches.

  ``optim.name``:

  * ``sgd`` (paper Sec. 4): ``chain(add_decayed_weights(wd, kernel_mask),
    sgd(schedule, momentum, nesterov))``, PyTorch's SGD semantics
    (``d = g + wd theta``; ``b = mu b + d``; ``d += mu b``; ``theta -= lr d``).
  * ``lars``: ``chain(scale_by_larc(...), trace(momentum, nesterov),
    scale_by_learning_rate(schedule))``: SGD as above with each leaf's
    ``d`` rescaled by the clipped trust ratio first (NVIDIA apex's LARC
    wrapped around PyTorch SGD, trust coefficient ``optim.trust_coefficient``).
  * ``adam``: ``optax.adamw(schedule, adam_b1, adam_b2, adam_eps,
    weight_decay, mask=kernel_mask)``. Decoupled weight decay (AdamW) rather
    than L2 through ``add_decayed_weights``: an L2 term added to the gradient
    is divided by Adam's second-moment estimate, so weights with large
    gradients are barely decayed (Loshchilov & Hutter, 2019). Note the decay
    step is ``lr * weight_decay * theta``: AdamW's usual weight_decay values
    (1e-2 - 5e-2) are larger than SGD's.

  Weight decay applies to conv and dense kernels only (``kernel_mask``), for
  all three. The result is wrapped in ``optax.MultiSteps(every_k_schedule=k)``
  when ``k > 1``: updates are applied once per k calls with the mean of the k
  gradients, zero updates otherwise.

  Args:
    config: the run config (``optim.*``, ``accumulation_steps``,
      ``batch_size``, ``num_epochs``).
    steps_per_epoch: optimizer updates per epoch.

  Returns:
    An ``optax.GradientTransformation``; ``update`` needs ``params``.

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
  if o.name == "sgd":
    tx = optax.chain(
        optax.add_decayed_weights(o.weight_decay, mask=kernel_mask),
        optax.sgd(schedule, momentum=o.momentum or None, nesterov=o.nesterov),
    )
  elif o.name == "lars":
    tx = optax.chain(
        scale_by_larc(schedule, o.weight_decay, o.trust_coefficient, o.lars_eps),
        optax.trace(decay=o.momentum, nesterov=o.nesterov),
        optax.scale_by_learning_rate(schedule),
    )
  else:
    tx = optax.adamw(schedule, b1=o.adam_b1, b2=o.adam_b2, eps=o.adam_eps,
                     weight_decay=o.weight_decay, mask=kernel_mask)
  return optax.MultiSteps(tx, every_k_schedule=k) if k > 1 else tx
