"""Per-stage optimizers (optax): SGD-Nesterov, LARC, AdamW, Muon, NAdamW, PSGD Kron (``optim.name``)."""

from __future__ import annotations

from typing import NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
import ml_collections
import optax

from petra_jax.optim.kron import kron
from petra_jax.optim.muon import muon
from petra_jax.optim.nadam import nadamw
from petra_jax.optim.schedules import base_learning_rate, learning_rate_schedule

OPTIMIZERS = ("sgd", "lars", "adam", "muon", "nadamw", "kron")


def _check_name(name: str) -> None:
  """ValueError for an unknown ``optim.name``."""
  if name not in OPTIMIZERS:
    raise ValueError(f"Unknown optim.name {name!r}; choose one of {OPTIMIZERS}.")


def kernel_mask(params):
  """True for conv and dense kernels (weight decay), False for BN and biases."""
  return jax.tree_util.tree_map_with_path(
      lambda path, _: getattr(path[-1], "key", None) == "kernel", params)


class LarcState(NamedTuple):
  """State of ``scale_by_larc``."""
  count: jax.Array  # int32 []


def scale_by_larc(learning_rate: optax.ScalarOrSchedule, weight_decay: float,
                  trust_coefficient: float = 0.02, eps: float = 1e-8,
                  weight_decay_mask=kernel_mask) -> optax.GradientTransformation:
  """LARS in its clipping form (LARC; You et al., 2017), as NVIDIA apex's; per leaf::

    update = (g + wd theta) min(tc |theta| / (|g| + wd |theta| + eps) / lr, 1)

  (ratio 1 where ``|theta|``, ``|g|`` or ``lr`` is 0). Chain before momentum.
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


def momentum_chain(o: ml_collections.ConfigDict, lr_schedule: optax.Schedule,
                   momentum: Optional[Sequence[optax.GradientTransformation]] = None
                   ) -> optax.GradientTransformation:
  """The ``sgd`` (``optax.sgd``'s chain, decay on kernels) or ``lars`` chain, no accumulation.

  ``momentum``: the transformations before the learning rate (default
  ``optax.trace(o.momentum, o.nesterov)``; compensations put theirs here).

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
                       optax.chain(*momentum, optax.scale_by_learning_rate(lr_schedule)))
  if o.name == "lars":
    return optax.chain(
        scale_by_larc(lr_schedule, o.weight_decay, o.trust_coefficient, o.lars_eps),
        *momentum, optax.scale_by_learning_rate(lr_schedule))
  raise ValueError(f"optim.name={o.name!r} has no momentum chain; use 'sgd' or 'lars'.")


def base_optimizer(config: ml_collections.ConfigDict,
                   lr_schedule: optax.Schedule) -> optax.GradientTransformation:
  """``optim.name``'s optimizer, one update per call: :func:`momentum_chain`,
  ``optax.adamw(..., mask=kernel_mask)`` (decoupled decay ``lr wd theta``),
  :func:`petra_jax.optim.muon.muon`, :func:`petra_jax.optim.nadam.nadamw` or
  :func:`petra_jax.optim.kron.kron` (momentum ``adam_b1``).

  Raises:
    ValueError: unknown ``optim.name``.
    ImportError: ``kron`` without the ``psgdax`` package.
  """
  o = config.optim
  _check_name(o.name)
  if o.name in ("sgd", "lars"):
    return momentum_chain(o, lr_schedule)
  if o.name == "muon":
    ratio = o.muon_learning_rate / base_learning_rate(config)
    return muon(lr_schedule, lambda n: lr_schedule(n) * ratio, momentum=o.muon_momentum,
                weight_decay=o.weight_decay, b1=o.adam_b1, b2=o.adam_b2, eps=o.adam_eps,
                decay_mask=kernel_mask)
  if o.name == "nadamw":
    return nadamw(lr_schedule, b1=o.adam_b1, b2=o.adam_b2, eps=o.adam_eps,
                  weight_decay=o.weight_decay, momentum_decay=o.momentum_decay,
                  clip=o.clip_norm, decay_mask=kernel_mask)
  if o.name == "kron":
    return kron(lr_schedule, b1=o.adam_b1, weight_decay=o.weight_decay, decay_mask=kernel_mask)
  return optax.adamw(lr_schedule, b1=o.adam_b1, b2=o.adam_b2, eps=o.adam_eps,
                     weight_decay=o.weight_decay, mask=kernel_mask)


def accumulate(tx: optax.GradientTransformation, k: int) -> optax.GradientTransformation:
  """``optax.MultiSteps(tx, k)`` (mean of ``k`` gradients per update), ``tx`` at ``k = 1``.

  Raises:
    ValueError: ``k < 1``.
  """
  if k < 1:
    raise ValueError(f"accumulation_steps must be >= 1, got {k}.")
  return optax.MultiSteps(tx, every_k_schedule=k) if k > 1 else tx


def make_optimizer(config: ml_collections.ConfigDict, steps_per_epoch: int,
                   lr_schedule: Optional[optax.Schedule] = None) -> optax.GradientTransformation:
  """:func:`base_optimizer` accumulated over ``k = accumulation_steps`` micro-batches.

  Raises:
    ValueError: unknown optimizer or learning-rate schedule, or ``k < 1``.
  """
  _check_name(config.optim.name)
  if lr_schedule is None:
    lr_schedule = learning_rate_schedule(config, steps_per_epoch)
  return accumulate(base_optimizer(config, lr_schedule), config.accumulation_steps)
