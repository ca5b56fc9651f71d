"""A PETRA stage as pure functions: forward, reconstruction and reverse vjp.

Activations are ``float32`` pytrees: the image ``[B, H, W, 3]`` into stage 0,
streams ``(x1, x2, *carried)`` of ``[B, H, W, C]`` between stages. A reversible
stage holds ``F`` and an optional ``pre`` ``P`` (``P^T P = I``) and computes
``(y1, y2) = (x2 + F(x1), x1)`` on ``P x`` (paper Fig. 2); its backward
reconstructs the input with the current weights (paper Eq. 5). A non-reversible
stage recomputes from a buffered input (Alg. 1 l. 15-17). BatchNorm uses batch
statistics in training; every function returns the running statistics.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
from typing import Any, Protocol, Sequence

import flax.linen as nn
import jax

from petra_jax.engine.stages import nnx_modules
from petra_jax.engine.stages.objective import cross_entropy  # noqa: F401  (re-exported)
from petra_jax.engine.arrays.precision import FLOAT32, Precision, cast

PyTree = Any
REVERSIBLE_BACKWARDS = ("vanilla", "pareprop")
_LINEARIZING = contextvars.ContextVar("petra_jax_linearizing", default=False)


@contextlib.contextmanager
def linearizing():
  """Marks a trace for ``jax.jvp``/``jax.linearize``: custom-vjp modules trace plain JAX."""
  token = _LINEARIZING.set(True)
  try:
    yield
  finally:
    _LINEARIZING.reset(token)


def is_linearizing() -> bool:
  """Whether the current trace is inside :func:`linearizing`."""
  return _LINEARIZING.get()


@dataclasses.dataclass(frozen=True, eq=False)
class Stage:
  """One pipeline stage: one residual block, or a group of consecutive ones.

  ``module``: ``F`` on one stream (``[B, H, W, C] -> [B, H, W, C]``) if
  reversible, else the whole block; None for a group, whose ``blocks`` hold
  variables under ``"block_i"``. ``pre``: an optional :class:`Reshuffle`.
  """
  name: str
  module: nn.Module | None
  reversible: bool
  blocks: tuple["Stage", ...] = ()
  pre: "Reshuffle | None" = None
  precision: Precision = FLOAT32
  reversible_backward: str = "vanilla"

  def __post_init__(self):  # an NNX module converted once (nnx_modules.as_linen)
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

  ``transpose`` (``P^T``) is both the reconstruction of ``x`` from ``P x`` and
  ``P``'s vjp. Both map ``(x1, x2, *carried)``.
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
  """Per stage ``(variables, output)`` as ``ShapeDtypeStruct``; ``x`` e.g. ``[B, H, W, 3]``."""
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
  """One stage running ``blocks`` in sequence; reversible iff all blocks are.

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


def with_reversible_backward(stages: Sequence[Stage], backward: str) -> list[Stage]:
  """``stages`` with every block (and group) using ``backward``.

  Raises:
    ValueError: ``backward`` not in :data:`REVERSIBLE_BACKWARDS`.
  """
  if backward not in REVERSIBLE_BACKWARDS:
    raise ValueError(f"Unknown reversible backward {backward!r}; choose one of {REVERSIBLE_BACKWARDS} "
                     "(--config.model.reversible_backward=...).")
  def one(s: Stage) -> Stage:
    return dataclasses.replace(s, reversible_backward=backward,
                               blocks=tuple(one(b) for b in s.blocks))
  return [one(s) for s in stages]


def _apply(stage: Stage, params, batch_stats, x, train):
  """``(output, new_batch_stats)``, computed in ``precision.compute``, out in ``streams``."""
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
  """Stage forward ``x_j = F_j(x_{j-1}, theta_j)`` (paper Eq. 1): ``(y, new_batch_stats)``."""
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
  """Reconstruction ``(x1, x2) = (y2, y1 - F(y2))``, then ``P^T``.

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
  """Reverse-backward of a reversible stage (paper Eq. 5, rows 2-4)::

    x~ = F^{-1}(y, theta)               = (y2, y1 - F(y2))
    delta_j = d_x F(x~, theta)^T dy     = (dy2 + J_F(y2)^T dy1, dy1)
    Delta_j = d_theta F(x~, theta)^T dy = d_theta F(y2)^T dy1

  ``y``, ``dy``: streams ``[B, H, W, C]``. Returns ``(x_tilde, dx, dparams, new_batch_stats)``.
  """
  if stage.blocks and stage.reversible_backward == "pareprop":
    return pareprop_vjp(stage, params, batch_stats, y, dy)
  if stage.blocks:
    grads, stats = {}, {}
    for i in reversed(range(len(stage.blocks))):
      key = f"block_{i}"
      y, dy, grads[key], stats[key] = reverse_vjp(
          stage.blocks[i], params[key], batch_stats[key], y, dy)
    return y, dy, grads, stats
  x_tilde, backward = reconstruct_with_vjp(stage, params, batch_stats, y)
  return (x_tilde, *backward(dy))


def reconstruct_with_vjp(stage: Stage, params, batch_stats, y):
  """``(x_tilde, backward)``, ``backward(dy) -> (dx, dparams, new_batch_stats)`` (Eq. 5)."""
  y1, y2, *carried = y
  f, f_vjp, new_stats = jax.vjp(lambda p, x1: _apply(stage, p, batch_stats, x1, True),
                                params, y2, has_aux=True)

  def backward(dy):
    dy1, dy2, *dcarried = dy
    dparams, dx1 = f_vjp(dy1)
    return _unshuffle(stage, (dy2 + dx1, dy1, *dcarried)), dparams, new_stats
  return _unshuffle(stage, (y2, y1 - f, *carried)), backward


def pareprop_vjp(stage: Stage, params, batch_stats, y, dy):
  """:func:`reverse_vjp` of a group, reconstructing one block ahead of the vjp (PaReprop).

  Raises:
    ValueError: ``stage`` is not a reversible group.
  """
  if not (stage.reversible and stage.blocks):
    raise ValueError(f"PaReprop's backward needs a group of reversible blocks; stage "
                     f"{stage.name!r} is not one: use model.reversible_backward='vanilla'.")
  blocks, key = stage.blocks, lambda i: f"block_{i}"
  n = len(blocks)
  x_next, pending = reconstruct_with_vjp(
      blocks[n - 1], params[key(n - 1)], batch_stats[key(n - 1)], y)
  grads, stats = {}, {}
  for i in reversed(range(n)):
    dy, grads[key(i)], stats[key(i)] = pending(dy)
    y = x_next
    if i > 0:
      x_next, pending = reconstruct_with_vjp(
          blocks[i - 1], params[key(i - 1)], batch_stats[key(i - 1)], y)
  return y, dy, grads, stats


def reverse_vjp_stashed(stage: Stage, params, vjp_params, batch_stats, y, dy):
  """Reconstruct at ``theta^t``, vjp at ``theta^{t-tau}`` (Table 4 l. 4); as :func:`reverse_vjp`."""
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
  """Backward by recomputation from the kept input (Alg. 1 l. 15-17).

  Returns ``(dx, dparams, new_batch_stats)``; ``dx`` None without ``input_grad``.
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


def composed_loss(stages: Sequence[Stage], params: Sequence, batch_stats: Sequence,
                  images: jax.Array, labels: jax.Array):
  """Mean cross-entropy of the composed stages (paper Eq. 2): ``(loss, new_batch_stats)``.

  Args:
    stages: the model's stages, applied in order (the last gives the logits).
    params: per stage its parameters; ``batch_stats``: per stage its BatchNorm statistics.
    images: ``float32[B, H, W, C]`` (a language model: token ids ``int32[B, T]``).
    labels: ``int32[B]`` (a language model: targets ``int32[B, T]``).

  Returns:
    ``(loss, new_batch_stats)``: the float32 scalar mean over the batch, and per stage
    the statistics after this training-mode forward.
  """
  x, new_stats = images, []
  for stage, p, bs in zip(stages, params, batch_stats):
    x, stats = forward(stage, p, bs, x)
    new_stats.append(stats)
  return cross_entropy(x, labels), new_stats


def loss_vjp(stage: Stage, params, batch_stats, x, labels):
  """Last stage: forward, loss and backward (Alg. 1 l. 27-30): ``(loss, dx, dparams, stats)``."""
  def loss_fn(p, x):
    logits, new_stats = forward(stage, p, batch_stats, x)
    return cross_entropy(logits, labels), new_stats

  (loss, new_stats), (dparams, dx) = jax.value_and_grad(
      loss_fn, argnums=(0, 1), has_aux=True)(params, x)
  return loss, dx, dparams, new_stats
