"""A PETRA stage as pure functions: forward, reconstruction and reverse vjp.

Activations are pytrees of ``float32`` arrays: the image ``[B, H, W, 3]`` at
the input of stage 0, two streams ``(x1, x2)`` of ``[B, H, W, C]`` between
stages. Parameters and BatchNorm statistics are Flax variable dicts.

A *reversible* stage holds only the residual function ``F`` (one stream) and
implements the coupling of paper Fig. 2::

    forward:  (y1, y2) = (x2 + F(x1), x1)
    inverse:  (x1, x2) = (y2, y1 - F(y2))

Its backward (:func:`reverse_vjp`) reconstructs the input from the output with
the *current* weights and takes the vector-Jacobian product at the
reconstruction (paper Eq. 5); ``F`` is evaluated once, its vjp recorded while
reconstructing.

A reversible stage may also hold a ``pre``: a parameter-free linear map ``P``
with ``P^T P = I`` (a permutation such as i-RevNet's space-to-depth ``psi``, or
an injective zero-padding; see :mod:`petra_jax.models.invertible`) applied to its
input before the coupling, so the stage is ``x -> C(P x)``. ``P^T`` is then both
the reconstruction of ``x`` from ``P x`` and ``P``'s vjp. Activations after
such a stage may carry, after the two streams, arrays set aside by ``P``
(``(x1, x2, *carried)``); the coupling passes them through unchanged.

A non-reversible stage (stem, downsampling, head) recomputes its forward from
a buffered input (:func:`recompute_vjp`, Alg. 1 l. 15-17).

Mixed precision (:class:`Precision`): a stage may compute in ``bfloat16``
(convolutions, BatchNorm, activations) while its parameters, optimizer state
and gradients stay ``float32``; the streams between stages are in
``Precision.streams``. A ``float32`` stream with ``bfloat16`` compute keeps the
coupling's addition ``x2 + F(x1)`` and its inverse ``y1 - F(y2)`` in float32, so
the reconstruction is as exact as in float32 (``F`` is deterministic: the
same ``y2`` gives the same ``F(y2)``).

BatchNorm always normalises with the current batch's statistics in training
(forward and reconstruction alike). Every function returns the BatchNorm
running statistics its evaluation would produce; the engine decides which
evaluation updates them (the paper's policy: the backward recomputation).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Protocol, Sequence

import flax.linen as nn
import jax
import optax

from petra_jax.engine.precision import DTYPES, FLOAT32, Precision, cast  # noqa: F401  (re-exported)

PyTree = Any


@dataclasses.dataclass(frozen=True, eq=False)
class Stage:
  """One pipeline stage: one residual block, or a group of consecutive ones.

  Attributes:
    name: a readable label, e.g. ``"group1_rev1"``.
    module: the Flax module of a single-block stage. For a reversible stage,
      the residual function ``F`` on one stream (``[B, H, W, C] -> [B, H, W,
      C]``); otherwise the whole block on the stage's input activation.
      Modules take ``train``. None for a group.
    reversible: whether the stage can rebuild its input from its output: the
      coupling of ``module`` (Fig. 2), or a group of reversible blocks only.
    blocks: for a group (:func:`group`), its single-block stages in order;
      their variables live under ``"block_0"``, ``"block_1"``, ...
    pre: for a reversible single-block stage, an optional :class:`Reshuffle`
      applied to the input before the coupling (e.g. invertible
      downsampling); None for the plain coupling of Fig. 2.
    precision: the block's :class:`Precision` (a group's blocks carry
      their own; :func:`with_precision`).
    reversible_backward: a reversible group's backward, ``"vanilla"``
      (:func:`reverse_vjp`) or ``"pareprop"``
      (:mod:`petra_jax.engine.reversible_backward`); a group takes its
      first block's.
  """
  name: str
  module: nn.Module | None
  reversible: bool
  blocks: tuple["Stage", ...] = ()
  pre: "Reshuffle | None" = None
  precision: Precision = FLOAT32
  reversible_backward: str = "vanilla"

  def __post_init__(self):  # an NNX module converted once (nnx_modules.as_linen)
    from petra_jax.engine import nnx_modules  # pylint: disable=g-import-not-at-top
    object.__setattr__(self, "module", nnx_modules.as_linen(self.module, self.name))

  def init(self, key: jax.Array, x: PyTree) -> dict:
    """Initialises ``{"params": ..., "batch_stats": ...}`` for input ``x``."""
    if self.blocks:
      params, stats = {}, {}
      for i, block in enumerate(self.blocks):
        v = block.init(jax.random.fold_in(key, i), x)
        params[f"block_{i}"], stats[f"block_{i}"] = v["params"], v["batch_stats"]
        x = jax.tree.map(lambda s: jax.numpy.zeros(s.shape, s.dtype), trace([block], x)[0][1])
      return {"params": params, "batch_stats": stats}
    x_in = _reshuffle(self, x)[0] if self.reversible else x
    variables = dict(self.module.init(key, x_in, train=True))
    variables.setdefault("batch_stats", {})
    return variables


class Reshuffle(Protocol):
  """A parameter-free linear map ``P`` with ``P^T P = I``, before a coupling.

  A permutation (then ``P^T = P^{-1}``) or an injection such as zero-padding
  channels. ``transpose`` is ``P^T``: it rebuilds ``x`` exactly from ``P x``
  (:func:`inverse`) and is ``P``'s vjp (:func:`reverse_vjp`), so the stage's
  backward still evaluates ``F`` once. Both map activation pytrees:
  ``(x1, x2, *carried)`` in and out.
  """

  def apply(self, x: PyTree) -> PyTree:
    """``P x``."""

  def transpose(self, y: PyTree) -> PyTree:
    """``P^T y``."""


def _reshuffle(stage: Stage, x):
  """``P x`` for a stage with a ``pre``, else ``x``."""
  return x if stage.pre is None else stage.pre.apply(x)


def _unshuffle(stage: Stage, y):
  """``P^T y`` for a stage with a ``pre``, else ``y``."""
  return y if stage.pre is None else stage.pre.transpose(y)


def has_reversible(stages: Sequence[Stage]) -> bool:
  """Whether any block of ``stages`` is reversible (Eq. 5's reconstruction applies)."""
  return any(b.reversible for s in stages for b in (s.blocks or (s,)))


def trace(stages: Sequence[Stage], x: PyTree, key: jax.Array | None = None) -> list[tuple]:
  """Shapes through ``stages``, nothing computed (:func:`jax.eval_shape`).

  Args:
    stages: the stages in order.
    x: the first stage's input: arrays or ``jax.ShapeDtypeStruct``s, e.g.
      ``float32[B, H, W, 3]``.
    key: the initialisation key (default ``jax.random.key(0)``; only its
      type matters).

  Returns:
    Per stage ``(variables, output)``: ``{"params", "batch_stats"}`` and the
    output activation, as pytrees of ``jax.ShapeDtypeStruct``. Parameters do
    not depend on the batch size; outputs have the batch of ``x``.
  """
  key = jax.random.key(0) if key is None else key
  out = []
  for s in stages:
    one = jax.tree.map(lambda a: jax.ShapeDtypeStruct((1, *a.shape[1:]), a.dtype), x)
    variables = jax.eval_shape(functools.partial(s.init, key), one)
    x = jax.eval_shape(lambda v, x, s=s: forward(s, v["params"], v["batch_stats"], x)[0],
                       variables, x)
    out.append((variables, x))
  return out


def group(blocks: Sequence[Stage], name: str | None = None) -> Stage:
  """One stage running ``blocks`` in sequence (stage balancing).

  A group of reversible blocks only is reversible: its reconstruction runs
  the blocks' inverses in reverse order, each block's ``F`` evaluated once
  (:func:`reverse_vjp`). A group with any non-reversible block buffers its
  input and recomputes, as a single non-reversible stage does.

  Raises:
    ValueError: ``blocks`` is empty.
  """
  blocks = tuple(b for s in blocks for b in (s.blocks or (s,)))
  if not blocks:
    raise ValueError("a stage group needs at least one block.")
  if len(blocks) == 1:
    return blocks[0]
  name = name or "+".join(b.name for b in blocks)
  return Stage(name, None, all(b.reversible for b in blocks), blocks,
               reversible_backward=blocks[0].reversible_backward)


def _block_vars(params, batch_stats, i):
  return params[f"block_{i}"], batch_stats[f"block_{i}"]


def with_precision(stages: Sequence[Stage], precision: Precision) -> list[Stage]:
  """``stages`` with every block computing under ``precision``."""
  def one(s: Stage) -> Stage:
    return dataclasses.replace(s, precision=precision,
                               blocks=tuple(one(b) for b in s.blocks))
  return [one(s) for s in stages]


def _apply(stage: Stage, params, batch_stats, x, train):
  """``stage.module.apply`` -> ``(output, new_batch_stats)``, under the
  stage's :class:`Precision` (parameters and input cast to ``compute``, the
  output to ``streams``)."""
  module, precision = stage.module, stage.precision
  if not precision.is_float32:
    params, x = cast(params, precision.compute), cast(x, precision.compute)
  out, stats = _apply_module(module, params, batch_stats, x, train)
  if not precision.is_float32:
    out = cast(out, precision.streams)
  return out, stats


def _apply_module(module, params, batch_stats, x, train):
  """``module.apply`` -> ``(output, new_batch_stats)``."""
  variables = {"params": params}
  if batch_stats:
    variables["batch_stats"] = batch_stats
  if not train:
    return module.apply(variables, x, train=False), batch_stats
  out, mutated = module.apply(variables, x, train=True, mutable=["batch_stats"])
  return out, mutated.get("batch_stats", {})


def forward(stage: Stage, params, batch_stats, x, *, train: bool = True):
  """Stage forward ``x_j = F_j(x_{j-1}, theta_j)`` (paper Eq. 1).

  Args:
    stage: the stage.
    params, batch_stats: its variables.
    x: input activation (image ``[B, H, W, 3]`` or streams ``(x1, x2)``).
    train: BatchNorm uses batch statistics when True, running ones otherwise.

  Returns:
    ``(y, new_batch_stats)``: the output activation and the running statistics
    updated by this evaluation (unchanged when ``train`` is False).
  """
  if stage.blocks:
    new_stats = {}
    for i, block in enumerate(stage.blocks):
      x, new_stats[f"block_{i}"] = forward(block, *_block_vars(params, batch_stats, i), x,
                                           train=train)
    return x, new_stats
  if not stage.reversible:
    return _apply(stage, params, batch_stats, x, train)
  x1, x2, *carried = _reshuffle(stage, x)
  f, new_stats = _apply(stage, params, batch_stats, x1, train)
  return (x2 + f, x1, *carried), new_stats


def inverse(stage: Stage, params, batch_stats, y):
  """Reconstruction ``x = F_j^{-1}(y, theta_j)`` of a reversible stage.

  Returns the streams ``(x1, x2) = (y2, y1 - F(y2))`` (any carried arrays
  passed through), mapped back by ``P^T`` for a stage with a ``pre``.

  Raises:
    ValueError: if the stage is not reversible.
  """
  if not stage.reversible:
    raise ValueError(f"stage {stage.name!r} is not reversible")
  if stage.blocks:
    for i in reversed(range(len(stage.blocks))):
      y = inverse(stage.blocks[i], *_block_vars(params, batch_stats, i), y)
    return y
  y1, y2, *carried = y
  f, _ = _apply(stage, params, batch_stats, y2, True)
  return _unshuffle(stage, (y2, y1 - f, *carried))


def reverse_vjp(stage: Stage, params, batch_stats, y, dy):
  """Reverse-backward of a reversible stage (paper Eq. 5, rows 2-4).

  With ``y = (y1, y2)`` the stage's output (as rebuilt by the next stage) and
  ``dy = (dy1, dy2)`` its cotangent ``delta_{j+1}``::

    x~ = F^{-1}(y, theta)          = (y2, y1 - F(y2))
    delta_j = d_x F(x~, theta)^T dy = (dy2 + J_F(y2)^T dy1, dy1)
    Delta_j = d_theta F(x~, theta)^T dy = d_theta F(y2)^T dy1

  ``F`` is evaluated once: its vjp is recorded while reconstructing. With a
  ``pre`` ``P`` (the stage is ``x -> C(P x)``), both ``x~`` and ``delta_j``
  are mapped back by ``P^T``, ``P``'s inverse and vjp; arrays carried after
  the streams pass through with their cotangents.

  Args:
    stage: a reversible stage.
    params, batch_stats: the stage's *current* variables (``theta_j^t``).
    y: streams ``(y1, y2)``, each ``[B, H, W, C]`` (then any carried arrays).
    dy: cotangent streams, same structure.

  Returns:
    ``(x_tilde, dx, dparams, new_batch_stats)``: the reconstructed input
    streams, their cotangent, the parameter gradient (a pytree like
    ``params``) and the running statistics of the reconstruction.
  """
  if stage.blocks and stage.reversible_backward == "pareprop":
    from petra_jax.engine import reversible_backward  # pylint: disable=g-import-not-at-top
    return reversible_backward.pareprop_vjp(stage, params, batch_stats, y, dy)
  if stage.blocks:  # block by block, last first: x~ of one is y of the previous
    grads, stats = {}, {}
    for i in reversed(range(len(stage.blocks))):
      key = f"block_{i}"
      y, dy, grads[key], stats[key] = reverse_vjp(
          stage.blocks[i], params[key], batch_stats[key], y, dy)
    return y, dy, grads, stats
  x_tilde, backward = reconstruct_with_vjp(stage, params, batch_stats, y)
  return (x_tilde, *backward(dy))


def reconstruct_with_vjp(stage: Stage, params, batch_stats, y):
  """A single reversible block's reconstruction and its pending backward.

  Returns ``(x_tilde, backward)``: ``x~`` as :func:`inverse`, and
  ``backward(dy) -> (dx, dparams, new_batch_stats)``, Eq. 5's rows 3-4 from
  the vjp recorded while reconstructing (``F`` evaluated once).
  """
  y1, y2, *carried = y
  f, f_vjp, new_stats = jax.vjp(lambda p, x1: _apply(stage, p, batch_stats, x1, True),
                                params, y2, has_aux=True)

  def backward(dy):
    dy1, dy2, *dcarried = dy
    dparams, dx1 = f_vjp(dy1)
    return _unshuffle(stage, (dy2 + dx1, dy1, *dcarried)), dparams, new_stats
  return _unshuffle(stage, (y2, y1 - f, *carried)), backward


def reverse_vjp_stashed(stage: Stage, params, vjp_params, batch_stats, y, dy):
  """Reconstruct with the current weights, vjp with the stashed ones.

  The "approximate input" configuration of paper Table 4 (line 4):
  ``x~ = F^{-1}(y, theta^t)`` and the derivatives at ``(x~, theta^{t-tau})``.
  ``F`` is evaluated twice (once per weight set).

  Returns:
    ``(x_tilde, dx, dparams, new_batch_stats)`` as :func:`reverse_vjp`.
  """
  if stage.blocks:
    grads, stats = {}, {}
    for i in reversed(range(len(stage.blocks))):
      key = f"block_{i}"
      y, dy, grads[key], stats[key] = reverse_vjp_stashed(
          stage.blocks[i], params[key], vjp_params[key], batch_stats[key], y, dy)
    return y, dy, grads, stats
  y1, y2, *carried = y
  dy1, dy2, *dcarried = dy
  f_now, _ = _apply(stage, params, batch_stats, y2, True)
  x_tilde = _unshuffle(stage, (y2, y1 - f_now, *carried))
  _, vjp, new_stats = jax.vjp(
      lambda p, x1: _apply(stage, p, batch_stats, x1, True), vjp_params, y2,
      has_aux=True)
  dparams, dx1 = vjp(dy1)
  return x_tilde, _unshuffle(stage, (dy2 + dx1, dy1, *dcarried)), dparams, new_stats


def recompute_vjp(stage: Stage, params, batch_stats, x, dy, *, input_grad: bool = True):
  """Backward of a non-reversible stage by recomputation (Alg. 1, l. 15-17).

  Args:
    stage: any stage.
    params, batch_stats: the stage's current variables.
    x: the buffered input activation.
    dy: cotangent of the stage's output.
    input_grad: whether to compute ``dx`` (stage 0 does not need it).

  Returns:
    ``(dx, dparams, new_batch_stats)``; ``dx`` is None if not ``input_grad``.
  """
  if input_grad:
    _, vjp, new_stats = jax.vjp(
        lambda p, x: forward(stage, p, batch_stats, x), params, x, has_aux=True)
    dparams, dx = vjp(dy)
  else:
    _, vjp, new_stats = jax.vjp(
        lambda p: forward(stage, p, batch_stats, x), params, has_aux=True)
    (dparams,), dx = vjp(dy), None
  return dx, dparams, new_stats


def cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
  """Mean softmax cross-entropy: ``logits [B, K]`` (computed in float32),
  ``labels int32 [B]``."""
  return optax.softmax_cross_entropy_with_integer_labels(
      logits.astype(jax.numpy.float32), labels).mean()


def composed_loss(stages: Sequence[Stage], params: Sequence, batch_stats: Sequence,
                  images: jax.Array, labels: jax.Array):
  """Mean cross-entropy of the stages composed: the model's loss (paper Eq. 2).

  Args:
    stages: the model's ``J`` stages.
    params, batch_stats: one pytree per stage.
    images: ``float32[B, H, W, C]``; labels: ``int32[B]``.

  Returns:
    ``(loss, new_batch_stats)``: a float32 scalar and the running statistics
    of each stage after this (training-mode) forward.
  """
  x, new_stats = images, []
  for stage, p, bs in zip(stages, params, batch_stats):
    x, stats = forward(stage, p, bs, x)
    new_stats.append(stats)
  return cross_entropy(x, labels), new_stats


def loss_vjp(stage: Stage, params, batch_stats, x, labels):
  """Last stage: forward, loss and backward at once (Alg. 1, l. 27-30).

  Returns:
    ``(loss, dx, dparams, new_batch_stats)`` with ``loss`` a float32 scalar
    (mean cross-entropy over the micro-batch) and ``dx = nabla_x L``.
  """
  def loss_fn(p, x):
    logits, new_stats = forward(stage, p, batch_stats, x)
    return cross_entropy(logits, labels), new_stats

  (loss, new_stats), (dparams, dx) = jax.value_and_grad(
      loss_fn, argnums=(0, 1), has_aux=True)(params, x)
  return loss, dx, dparams, new_stats
