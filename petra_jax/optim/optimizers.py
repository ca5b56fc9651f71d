"""The per-stage optimizers: SGD with Nesterov momentum, LARC, AdamW (all optax).

The paper's recipe (Sec. 4, "Experimental setup"): SGD with Nesterov momentum
0.9, weight decay on conv and dense kernels only (5e-4 on CIFAR-10, 1e-4 on
ImageNet32 and ImageNet). Gradients are averaged over the ``k`` micro-batches
of an update by ``optax.MultiSteps`` (Alg. 1, l. 18-22), whose counter lives
in each stage's optimizer state.

Also offered (``optim.name``): LARS in its clipping form (LARC, trust
coefficient 0.02, as the authors' code) and Adam with decoupled weight decay
(AdamW).
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
import ml_collections
import optax

from petra_jax.optim.schedules import base_learning_rate, learning_rate_schedule

OPTIMIZERS = ("sgd", "lars", "adam", "muon")


def _check_name(name: str) -> None:
  """ValueError for an unknown ``optim.name``."""
  if name not in OPTIMIZERS:
    raise ValueError(f"Unknown optim.name {name!r}; choose one of {OPTIMIZERS}.")


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


def momentum_chain(o: ml_collections.ConfigDict, schedule: optax.Schedule,
                   momentum: Optional[Sequence[optax.GradientTransformation]] = None
                   ) -> optax.GradientTransformation:
  """The ``sgd`` or ``lars`` chain (``o.name``), without gradient accumulation.

  * ``sgd``: ``chain(add_decayed_weights(wd, kernel_mask), chain(*momentum,
    scale_by_learning_rate(schedule)))``; with the default ``momentum`` this
    is ``optax.sgd``'s chain, PyTorch's SGD semantics (``d = g + wd theta``;
    ``b = mu b + d``; ``d += mu b``; ``theta -= lr d``).
  * ``lars``: ``chain(scale_by_larc(...), *momentum,
    scale_by_learning_rate(schedule))``: SGD as above with each leaf's ``d``
    rescaled by the clipped trust ratio first (NVIDIA apex's LARC wrapped
    around PyTorch SGD, trust coefficient ``o.trust_coefficient``).

  Args:
    o: ``config.optim`` (``name`` ``sgd`` or ``lars``, ``weight_decay``,
      ``momentum``, ``nesterov``, ``trust_coefficient``, ``lars_eps``).
    schedule: the learning-rate schedule (:func:`learning_rate_schedule`).
    momentum: the transformations between the weight decay (or trust ratio)
      and the learning rate; default ``[optax.trace(o.momentum, o.nesterov)]``
      (``[optax.identity()]`` for ``sgd`` without momentum, as
      ``optax.sgd(momentum=None)``). Delay compensations put their modified
      trace here (:mod:`petra_jax.optim.momentum`).

  Raises:
    ValueError: ``o.name`` is not ``sgd`` or ``lars``.
  """
  if momentum is None:
    if o.name == "sgd" and not o.momentum:
      momentum = [optax.identity()]
    else:
      momentum = [optax.trace(decay=o.momentum, nesterov=o.nesterov)]
  if o.name == "sgd":
    return optax.chain(optax.add_decayed_weights(o.weight_decay, mask=kernel_mask),
                       optax.chain(*momentum, optax.scale_by_learning_rate(schedule)))
  if o.name == "lars":
    return optax.chain(
        scale_by_larc(schedule, o.weight_decay, o.trust_coefficient, o.lars_eps),
        *momentum, optax.scale_by_learning_rate(schedule))
  raise ValueError(f"optim.name={o.name!r} has no momentum chain; use 'sgd' or 'lars'.")


def base_optimizer(config: ml_collections.ConfigDict,
                   schedule: optax.Schedule) -> optax.GradientTransformation:
  """``optim.name``'s optimizer, one update per call (no accumulation).

  ``sgd`` and ``lars``: :func:`momentum_chain`. ``adam``:
  ``optax.adamw(schedule, adam_b1, adam_b2, adam_eps, weight_decay,
  mask=kernel_mask)``. Decoupled weight decay (AdamW) rather than L2 through
  ``add_decayed_weights``: an L2 term added to the gradient is divided by
  Adam's second-moment estimate, so weights with large gradients are barely
  decayed (Loshchilov & Hutter, 2019). Note the decay step is ``lr *
  weight_decay * theta``: AdamW's usual weight_decay values (1e-2 - 5e-2) are
  larger than SGD's. Weight decay applies to conv and dense kernels only
  (:func:`kernel_mask`), for all three.

  Raises:
    ValueError: unknown ``optim.name``.
  """
  o = config.optim
  _check_name(o.name)
  if o.name in ("sgd", "lars"):
    return momentum_chain(o, schedule)
  if o.name == "muon":
    from petra_jax.optim.muon import muon  # pylint: disable=g-import-not-at-top
    ratio = o.muon_learning_rate / base_learning_rate(config)
    return muon(schedule, lambda n: schedule(n) * ratio, momentum=o.muon_momentum,
                weight_decay=o.weight_decay, b1=o.adam_b1, b2=o.adam_b2, eps=o.adam_eps)
  return optax.adamw(schedule, b1=o.adam_b1, b2=o.adam_b2, eps=o.adam_eps,
                     weight_decay=o.weight_decay, mask=kernel_mask)


def accumulate(tx: optax.GradientTransformation, k: int) -> optax.GradientTransformation:
  """``tx`` applied once per ``k`` calls with the mean of the ``k`` gradients.

  ``optax.MultiSteps(tx, every_k_schedule=k)`` when ``k > 1`` (zero updates
  in between), ``tx`` itself when ``k == 1``.

  Raises:
    ValueError: ``k < 1``.
  """
  if k < 1:
    raise ValueError(f"accumulation_steps must be >= 1, got {k}.")
  return optax.MultiSteps(tx, every_k_schedule=k) if k > 1 else tx


def make_optimizer(config: ml_collections.ConfigDict, steps_per_epoch: int,
                   schedule: Optional[optax.Schedule] = None) -> optax.GradientTransformation:
  """The per-stage optimizer, with gradient accumulation over k micro-batches.

  :func:`base_optimizer` (``optim.name`` ``sgd``, ``lars`` or ``adam``)
  wrapped by :func:`accumulate` with ``k = accumulation_steps``.

  Args:
    config: the run config (``optim.*``, ``accumulation_steps``,
      ``batch_size``, ``num_epochs``).
    steps_per_epoch: optimizer updates per epoch.
    schedule: the run's learning-rate schedule; default
      ``learning_rate_schedule(config, steps_per_epoch)``.

  Returns:
    An ``optax.GradientTransformation``; ``update`` needs ``params``.

  Raises:
    ValueError: unknown optimizer or schedule, or ``accumulation_steps < 1``.
  """
  _check_name(config.optim.name)
  if schedule is None:
    schedule = learning_rate_schedule(config, steps_per_epoch)
  return accumulate(base_optimizer(config, schedule), config.accumulation_steps)
