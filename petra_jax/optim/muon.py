"""Muon for the matrices (``optax.contrib.scale_by_muon``), AdamW for the rest.

Muon (Jordan et al., 2024): ``M <- beta M + (1 - beta) G`` (Nesterov, bias
corrected as optax), ``O = NS5(M / ||M||_F)`` (Newton-Schulz, coefficients
3.4445, -4.775, 2.0315), ``W <- W - eta_mu (sqrt(max(1, fan_out / fan_in)) O
+ wd W)``. Every ``kernel`` of rank >= 2 is a ``fan_in x fan_out`` matrix:
Dense ``[in, out]``, Conv ``[h, w, in, out]``, attention ``query|key|value``
``[D, H, hd]`` (``D x H hd``) and ``out`` ``[H, hd, D]`` (``H hd x D``).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import optax
from optax.contrib import MuonDimensionNumbers, scale_by_muon



def _dims(path, x):
  names = [getattr(k, "key", None) for k in path]
  if names[-1] != "kernel" or x.ndim < 2:
    return None
  if x.ndim == 3 and any(n in ("query", "key", "value") for n in names):
    return MuonDimensionNumbers(reduction_axis=0, output_axis=(1, 2))
  if x.ndim == 3 and "out" in names:
    return MuonDimensionNumbers(reduction_axis=(0, 1), output_axis=2)
  return MuonDimensionNumbers(reduction_axis=tuple(range(x.ndim - 1)), output_axis=x.ndim - 1)


def muon_dimension_numbers(tree):
  """Per leaf, its ``MuonDimensionNumbers`` or None (an AdamW leaf)."""
  return jax.tree_util.tree_map_with_path(_dims, tree)


def _labels(params):
  return jax.tree_util.tree_map_with_path(
      lambda path, x: "adam" if _dims(path, x) is None else "muon", params)


def _scale_by_width():
  def update_fn(updates, state, params=None):
    del params

    def one(path, u):
      d = _dims(path, u)
      fan_in, fan_out = (math.prod(u.shape[a] for a in ((axes,) if isinstance(axes, int) else axes))
                         for axes in (d.reduction_axis, d.output_axis))
      return u * jnp.asarray(max(1.0, fan_out / fan_in) ** 0.5, u.dtype)

    return jax.tree_util.tree_map_with_path(one, updates), state

  return optax.GradientTransformation(lambda p: optax.EmptyState(), update_fn)


def muon(lr_schedule: optax.Schedule, muon_schedule: optax.Schedule, *, momentum: float,
         weight_decay: float, b1: float, b2: float, eps: float,
         decay_mask) -> optax.GradientTransformation:
  """``optax.partition``: Muon (rate ``muon_schedule``) on the kernels of rank >= 2,
  ``optax.adamw(lr_schedule, b1, b2, eps, weight_decay, mask=decay_mask)`` on the rest."""
  matrices = optax.chain(
      scale_by_muon(beta=momentum, eps=eps, nesterov=True,
                    weight_dimension_numbers=muon_dimension_numbers),
      _scale_by_width(), optax.add_decayed_weights(weight_decay),
      optax.scale_by_learning_rate(muon_schedule))
  rest = optax.adamw(lr_schedule, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay,
                     mask=decay_mask)
  return optax.partition({"muon": matrices, "adam": rest}, _labels)
