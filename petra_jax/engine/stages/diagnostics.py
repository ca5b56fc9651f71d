"""Gradient quality (paper App. B, Figs. 5-6) and reconstruction error (Sec. 3.2).

Per stage, three gradients of one micro-batch's loss: ``applied`` (the
method's backward), ``delayed`` (``jax.grad`` at the forward's weights
``theta_j^{t-tau_j}``) and ``e2e`` (``jax.grad`` at the backward's weights
``theta_j^t``), compared by cosine similarity and norm ratio.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp

from petra_jax.engine.arrays import quantize as quantize_lib
from petra_jax.engine.stages.stage import Stage, composed_loss

PyTree = Any

PAIRS = (("applied_delayed", "applied", "delayed"),
         ("applied_e2e", "applied", "e2e"),
         ("delayed_e2e", "delayed", "e2e"))
METRICS = tuple(f"{kind}_{pair}" for kind in ("cos", "norm_ratio") for pair, _, _ in PAIRS)
PREFIX = "grad_quality"


def _flat(tree: PyTree) -> jax.Array:
  """All leaves of ``tree`` as one float32 vector ``[P]``."""
  leaves = [jnp.ravel(x).astype(jnp.float32) for x in jax.tree.leaves(tree)]
  return jnp.concatenate(leaves) if leaves else jnp.zeros((0,), jnp.float32)


def cosine_similarity(a: PyTree, b: PyTree) -> jax.Array:
  """``<a, b> / (||a|| ||b||)`` over the flattened leaves, float32 (App. B); NaN if one is 0."""
  x, y = _flat(a), _flat(b)
  return jnp.vdot(x, y) / (jnp.linalg.norm(x) * jnp.linalg.norm(y))


def norm_ratio(a: PyTree, b: PyTree) -> jax.Array:
  """``||a|| / ||b||`` over the flattened leaves, float32 (App. B); Inf/NaN if ``b`` is zero."""
  return jnp.linalg.norm(_flat(a)) / jnp.linalg.norm(_flat(b))


def relative_error(x_tilde: PyTree, x: PyTree) -> jax.Array:
  """``||x~ - x|| / ||x||`` over all leaves, float32 (Sec. 3.2); dequantises first."""
  x_tilde, x = jax.tree.map(lambda a: a.astype(jnp.float32),
                            quantize_lib.dequantize((x_tilde, x)))
  num = sum(jnp.sum((a - b) ** 2) for a, b in zip(jax.tree.leaves(x_tilde), jax.tree.leaves(x)))
  den = sum(jnp.sum(b ** 2) for b in jax.tree.leaves(x))
  return jnp.sqrt(num / den)


def composed_grads(stages: Sequence[Stage], params: Sequence[PyTree],
                   batch_stats: Sequence[PyTree], images: jax.Array,
                   labels: jax.Array) -> list:
  """Per-stage ``jax.grad`` of the composed mean cross-entropy (``images float32[B, H, W, C]``)."""
  return jax.grad(lambda ps: composed_loss(stages, ps, batch_stats, images, labels)[0])(
      list(params))


def grad_quality(stages: Sequence[Stage], applied_grads: Sequence[PyTree],
                 forward_params: Sequence[PyTree], backward_params: Sequence[PyTree],
                 batch_stats: Sequence[PyTree], images: jax.Array,
                 labels: jax.Array) -> dict[str, jax.Array]:
  """Per-stage cosine similarities and norm ratios (paper Figs. 5-6): ``{name: float32[J]}``.

  ``delayed`` at ``forward_params``, ``e2e`` at ``backward_params``.
  """
  grads = {"applied": list(applied_grads),
           "delayed": composed_grads(stages, forward_params, batch_stats, images, labels),
           "e2e": composed_grads(stages, backward_params, batch_stats, images, labels)}
  out = {}
  for pair, a, b in PAIRS:
    out[f"cos_{pair}"] = jnp.stack(
        [cosine_similarity(x, y) for x, y in zip(grads[a], grads[b])])
    out[f"norm_ratio_{pair}"] = jnp.stack(
        [norm_ratio(x, y) for x, y in zip(grads[a], grads[b])])
  return out


def metric_key(name: str, stage: int) -> str:
  """The metrics.jsonl / TensorBoard key, e.g. ``grad_quality/cos_applied_e2e/stage_3``."""
  return f"{PREFIX}/{name}/stage_{stage}"
