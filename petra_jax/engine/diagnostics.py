"""Gradient quality: how far PETRA's gradients are from exact ones (paper App. B),
and the reconstruction error of its inputs (:func:`relative_error`, Sec. 3.2).

PETRA's gradient of stage ``j`` for micro-batch ``m`` is approximate twice
over: it is *delayed* (``tau_j = 2(J-1-j)`` ticks after the forward), and it is
taken at an input reconstructed with the *current* weights, with the current
weights. Appendix B compares, stage by stage, three gradients of the same
micro-batch's loss with respect to the stage's parameters:

* ``applied``: the gradient the method's backward applied (petra,
  approximate_input, dsp or delayed: each its own);
* ``delayed``: the standard delayed gradient of PipeDream / Zhuang et al.
  (2020): ``jax.grad`` of the composed model at the weights each stage's
  *forward* used (``theta_j^{t-tau_j}``), which reproduces the forward
  activations exactly (weight stashing);
* ``e2e``: the end-to-end gradient: ``jax.grad`` of the composed model at the
  *current* weights, those each stage holds when it runs the micro-batch's
  backward (``theta_j^t``, the weights PETRA's vjp used). With every delay 0
  (``Pipeline.revprop_step``) forward and backward weights coincide and the
  three gradients are equal.

and reports the cosine similarity and norm ratio of each pair (Fig. 5: over
training; Fig. 6: against the stage index). The engine gathers the inputs
(:class:`petra_jax.engine.observers.GradientProbe`); this module holds the math.

BatchNorm normalises with the batch's statistics in training, so the running
statistics passed here only give the variables their structure.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp

from petra_jax.engine import quantize as quantize_lib
from petra_jax.engine.stage import Stage, composed_loss

PyTree = Any

# (name, numerator/first gradient, second gradient) of each compared pair.
PAIRS = (("applied_delayed", "applied", "delayed"),
         ("applied_e2e", "applied", "e2e"),
         ("delayed_e2e", "delayed", "e2e"))
# Keys of grad_quality's result, e.g. "cos_applied_e2e", "norm_ratio_applied_delayed".
METRICS = tuple(f"{kind}_{pair}" for kind in ("cos", "norm_ratio") for pair, _, _ in PAIRS)
PREFIX = "grad_quality"


def _flat(tree: PyTree) -> jax.Array:
  """All leaves of ``tree`` as one float32 vector ``[P]``."""
  leaves = [jnp.ravel(x).astype(jnp.float32) for x in jax.tree.leaves(tree)]
  return jnp.concatenate(leaves) if leaves else jnp.zeros((0,), jnp.float32)


def cosine_similarity(a: PyTree, b: PyTree) -> jax.Array:
  """``<a, b> / (||a|| ||b||)`` over the flattened leaves (App. B, Cos-Sim).

  Args:
    a, b: pytrees of the same structure (e.g. two gradients of one stage's
      parameters), any float dtype; computed in float32.

  Returns:
    A float32 scalar in ``[-1, 1]`` (up to round-off); NaN if either is zero.
  """
  x, y = _flat(a), _flat(b)
  return jnp.vdot(x, y) / (jnp.linalg.norm(x) * jnp.linalg.norm(y))


def norm_ratio(a: PyTree, b: PyTree) -> jax.Array:
  """``||a|| / ||b||`` over the flattened leaves (App. B, Norm-Ratio).

  Returns:
    A float32 scalar ``>= 0``; Inf (or NaN) if ``b`` is zero.
  """
  return jnp.linalg.norm(_flat(a)) / jnp.linalg.norm(_flat(b))


def relative_error(x_tilde: PyTree, x: PyTree) -> jax.Array:
  """Relative reconstruction error ``||x~ - x|| / ||x||`` (paper Sec. 3.2).

  Args:
    x_tilde: the input a reversible stage rebuilt from its output (Eq. 5).
    x: the true input, same structure. Either may be quantised (it is
      dequantised first).

  Returns:
    A float32 scalar, computed in float32 over all leaves together.
  """
  x_tilde, x = jax.tree.map(lambda a: a.astype(jnp.float32),
                            quantize_lib.dequantize((x_tilde, x)))
  num = sum(jnp.sum((a - b) ** 2) for a, b in zip(jax.tree.leaves(x_tilde), jax.tree.leaves(x)))
  den = sum(jnp.sum(b ** 2) for b in jax.tree.leaves(x))
  return jnp.sqrt(num / den)


def composed_grads(stages: Sequence[Stage], params: Sequence[PyTree],
                   batch_stats: Sequence[PyTree], images: jax.Array,
                   labels: jax.Array) -> list:
  """``jax.grad`` of the composed model's mean cross-entropy.

  Args:
    stages: the model's stages.
    params: one parameter pytree per stage (may come from different ticks).
    batch_stats: one BatchNorm-statistics pytree per stage (training mode:
      only their structure matters).
    images: ``float32[B, H, W, C]``.
    labels: ``int32[B]``.

  Returns:
    One gradient pytree per stage, like ``params``.
  """
  return jax.grad(lambda ps: composed_loss(stages, ps, batch_stats, images, labels)[0])(
      list(params))


def grad_quality(stages: Sequence[Stage], applied_grads: Sequence[PyTree],
                 forward_params: Sequence[PyTree], backward_params: Sequence[PyTree],
                 batch_stats: Sequence[PyTree], images: jax.Array,
                 labels: jax.Array) -> dict[str, jax.Array]:
  """Per-stage cosine similarities and norm ratios of paper Figs. 5 and 6.

  Computes the delayed gradient (at ``forward_params``) and the end-to-end
  gradient (at ``backward_params``) of one micro-batch, two forward+backward
  passes of the whole model, and compares them with ``applied_grads``.

  Args:
    stages: the model's ``J`` stages.
    applied_grads: the gradient each stage applied for this micro-batch.
    forward_params: the parameters each stage's forward used.
    backward_params: the parameters each stage held at its backward.
    batch_stats: per stage, for the structure of the variables.
    images: the micro-batch, ``float32[B, H, W, C]``.
    labels: its labels, ``int32[B]``.

  Returns:
    ``{name: float32[J]}`` for every name in :data:`METRICS`
    (``cos_<a>_<b>``, ``norm_ratio_<a>_<b>`` with ``a`` the numerator).
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
