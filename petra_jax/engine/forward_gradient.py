"""Forward gradients with local guesses: the per-stage functions.

Fournier, Rivaud, Belilovsky, Eickenberg, Oyallon, "Can Forward Gradient
Match Backpropagation?" (ICML 2023). Stage ``j`` guesses its gradient
``v_j`` (``guess="local"``: the gradient of its auxiliary loss,
:mod:`petra_jax.models.auxiliary`; ``"random"``: a standard Gaussian draw),
and only the projection of the true gradient ``g_j`` on it is measured::

    g~_j = <g_j, v_j> / (||v_j||^2 + eps) v_j          (paper, Sec. 3)

``<g_j, v_j>`` is the directional derivative of the loss along ``v_j``: a
Jacobian-vector product (:func:`jax.linearize`) whose tangent rides forward
with the activations through every later stage; the last stage turns each
tangent into per-sample scalars (:func:`loss_scalars`).

Two perturbations (``perturb``):

* ``weights``: ``v_j`` lives in parameter space (one direction per
  micro-batch); the tangent stage ``j`` starts is ``J_theta F_j v_j``. The
  update is ``c / (||v||^2 + eps) v`` with ``c = mean_b s_b = <g_j, v_j>``.
  (The authors project per-sample weight gradients; one direction per
  micro-batch needs no per-sample gradients.)
* ``activity``: ``v_j`` lives in the stage's output space ``[B, ...]`` (the
  tangent is ``v_j`` itself) and the update is the vjp of the stage at its
  buffered input along a cotangent ``w v_j``. Two projections
  (``projection``):

  - ``batch`` (default): one direction for the whole micro-batch, ``w =
    mean_b s_b / (||v_j||^2 + eps)``. ``mean_b s_b`` is exactly the
    derivative of ``L`` along ``v_j``, also through train-mode BatchNorm,
    so ``|w| ||v_j|| <= ||dL/dy_j||``: the step is never longer than the
    true gradient's.
  - ``sample``: per sample (the paper's), ``w_b = (s_b / B) /
    (||v_j[b]||^2 + eps)``. ``s_b / B`` equals ``<dL/dy_j[b], v_j[b]>`` only
    when later stages do not mix samples; train-mode BatchNorm does (one jvp
    cannot separate samples), and then a sample with a small guess
    (``||v_j[b]||`` near 0, e.g. a local guess on a sample the auxiliary
    head already fits) receives the other samples' terms divided by its
    own small norm: steps far longer than the gradient, which made
    ``guess=local`` diverge on RevNet18 in 10 stages (docs/local_learning.md).

``emulate=True`` takes the scalars from the exact gradient instead
(:func:`emulated_scalars`; what the authors' experiments do): with nothing
delayed its update equals the forward-mode one to round-off (``weights``;
``activity`` without sample-mixing layers downstream).

Scalars have one unit throughout: ``s[b]``, the derivative of sample ``b``'s
loss ``l_b`` along the tangent (``L = mean_b l_b``).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp
import optax

from petra_jax.engine import auxiliary
from petra_jax.engine.auxiliary import block_params
from petra_jax.engine.stage import forward, linearizing

GUESSES = ("local", "random")
PERTURBS = ("weights", "activity")
PROJECTIONS = ("batch", "sample")


@dataclasses.dataclass(frozen=True)
class Options:
  """``config.forward_gradient``, and the run's ``seed`` (random guesses draw
  from ``fold_in(fold_in(key(seed + 3), m), j)``). Checked on creation.

  Raises:
    ValueError: a bad option (:func:`check_options`).
  """
  guess: str = "local"
  perturb: str = "activity"
  emulate: bool = False
  eps: float = 1e-16
  projection: str = "batch"
  seed: int = 0

  def __post_init__(self):
    check_options(self.guess, self.perturb, self.emulate, self.eps, self.projection)


def check_options(guess: str, perturb: str, emulate, eps, projection: str = "batch") -> None:
  """The one check of ``config.forward_gradient``.

  Raises:
    ValueError: one message naming every bad option and its choices.
  """
  bad = []
  if guess not in GUESSES:
    bad.append(f"forward_gradient.guess={guess!r} (choose one of {GUESSES})")
  if perturb not in PERTURBS:
    bad.append(f"forward_gradient.perturb={perturb!r} (choose one of {PERTURBS})")
  if not isinstance(emulate, bool):
    bad.append(f"forward_gradient.emulate={emulate!r} (True or False)")
  if not isinstance(eps, (int, float)) or isinstance(eps, bool) or eps < 0:
    bad.append(f"forward_gradient.eps={eps!r} (a number >= 0)")
  if projection not in PROJECTIONS:
    bad.append(f"forward_gradient.projection={projection!r} (choose one of {PROJECTIONS})")
  if bad:
    raise ValueError("Bad forward-gradient options: " + "; ".join(bad)
                     + ". Pass --config.forward_gradient.<option>=<a listed value>.")


def local_guess(stage, params, batch_stats, x, labels, perturb: str):
  """The auxiliary-loss gradient as the guess, and the head's gradient.

  Returns:
    ``(guess, head_grads)``: for ``weights`` a pytree like the block's
    parameters (head excluded), for ``activity`` one like the stage's
    output ``y`` (``[B, ...]``, per sample); ``head_grads`` like
    ``params[AUX_KEY]`` (the head trains on its own loss).
  """
  if perturb == "weights":
    grads = jax.grad(lambda p: auxiliary.aux_loss(
        stage, p, forward(stage, p, batch_stats, x)[0], labels))(params)
    return block_params(grads), grads[auxiliary.AUX_KEY]
  y = forward(stage, params, batch_stats, x)[0]
  gy, gh = jax.grad(lambda y, h: auxiliary.aux_loss(stage, {auxiliary.AUX_KEY: h}, y, labels),
                    argnums=(0, 1))(y, params[auxiliary.AUX_KEY])
  return gy, gh


def random_guess(key: jax.Array, like):
  """A standard Gaussian draw shaped like the pytree ``like``."""
  leaves, tree = jax.tree.flatten(like)
  keys = jax.random.split(key, len(leaves))
  return jax.tree.unflatten(tree, [jax.random.normal(k, a.shape, jnp.float32)
                                   for k, a in zip(keys, leaves)])


def push(stage, params, batch_stats, x, tangents: Optional[object], param_tangent=None):
  """The stage's forward, with the incoming tangents pushed through it.

  One :func:`jax.linearize` of ``(theta, x) -> y``: the primal once, then
  its linear map per tangent (``jax.vmap`` over the stack).

  Args:
    tangents: ``n`` input tangents stacked on a leading axis (a pytree like
      ``x`` with shapes ``[n, B, ...]``), or None.
    param_tangent: for ``weights``, ``v_j`` (like the block's parameters):
      its output tangent ``J_theta F v_j`` is returned too.

  Returns:
    ``(y, batch_stats, pushed, own)``: ``pushed`` shaped ``[n, B, ...]``
    like ``y`` (None without tangents), ``own`` like ``y`` (None without
    ``param_tangent``).
  """
  block = block_params(params)
  with linearizing():  # BatchNorm's custom vjp has no jvp
    y, lin, stats = jax.linearize(lambda p, x: forward(stage, p, batch_stats, x), block, x,
                                  has_aux=True)
  zero_p = jax.tree.map(jnp.zeros_like, block)
  zero_x = jax.tree.map(jnp.zeros_like, x)
  pushed = None if tangents is None else jax.vmap(lambda t: lin(zero_p, t))(tangents)
  own = None if param_tangent is None else lin(param_tangent, zero_x)
  return y, stats, pushed, own


def stack(pushed, own):
  """``pushed`` ``[n, ...]`` with ``own`` appended: ``[n + 1, ...]``."""
  own = jax.tree.map(lambda a: a[None], own)
  if pushed is None:
    return own
  return jax.tree.map(lambda a, b: jnp.concatenate([a, b]), pushed, own)


def per_sample_losses(stage, params, batch_stats, x, labels) -> jax.Array:
  """``float32[B]``: each sample's cross-entropy after the last stage."""
  logits = forward(stage, params, batch_stats, x)[0]
  return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), labels)


def loss_scalars(stage, params, batch_stats, x, labels, tangents) -> jax.Array:
  """``float32[n, B]``: ``s[i, b]``, the derivative of sample ``b``'s loss
  along tangent ``i`` (the last stage's input tangents, ``[n, B, ...]``)."""
  with linearizing():
    _, lin = jax.linearize(lambda x: per_sample_losses(stage, params, batch_stats, x, labels), x)
  return jax.vmap(lin)(tangents)


def _dot(a, b) -> jax.Array:
  return sum(jnp.vdot(u, v) for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def _per_sample_dot(a, b) -> jax.Array:
  """``[B]``: per-sample inner products of two activation pytrees."""
  return sum(jnp.sum((u * v).reshape(u.shape[0], -1), axis=1)
             for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def estimate(stage, params, batch_stats, x, guess, scalars, perturb: str, eps: float,
             projection: str = "batch"):
  """The forward-gradient estimate of the block's parameter gradient.

  Args:
    params, batch_stats: the stage's current variables.
    x: its buffered input (``activity``; None for ``weights``).
    guess: ``v_j`` (see :func:`local_guess`).
    scalars: ``float32[B]``: ``s[b]`` of this stage's tangent.
    projection: ``activity`` only: ``batch`` or ``sample`` (module docstring).

  Returns:
    A pytree like the block's parameters (head excluded).
  """
  if perturb == "weights":
    c = jnp.mean(scalars)
    return jax.tree.map(lambda v: c / (_dot(guess, guess) + eps) * v, guess)
  if projection == "batch":
    w = jnp.full_like(scalars, jnp.mean(scalars) / (_dot(guess, guess) + eps))
  else:
    w = scalars / scalars.shape[0] / (_per_sample_dot(guess, guess) + eps)
  cot = jax.tree.map(lambda v: w.reshape((-1,) + (1,) * (v.ndim - 1)) * v, guess)
  _, vjp = jax.vjp(lambda p: forward(stage, p, batch_stats, x)[0], block_params(params))
  return vjp(cot)[0]


def emulated_scalars(stage, params, batch_stats, x, dy, guess, perturb: str):
  """The scalars from the exact gradient (``emulate=True``).

  Args:
    x: the stage's buffered input; dy: ``dL/dy_j`` (backprop's cotangent).

  Returns:
    ``(scalars float32[B], dx)``: for ``weights`` ``<g_j, v_j>`` in every
    entry, for ``activity`` ``B <dL/dy_j[b], v_j[b]>``; ``dx = dL/dx_j``.
  """
  _, vjp = jax.vjp(lambda p, x: forward(stage, p, batch_stats, x)[0], block_params(params), x)
  g, dx = vjp(dy)
  batch = jax.tree.leaves(dy)[0].shape[0]
  if perturb == "weights":
    return jnp.full((batch,), _dot(g, guess)), dx
  return batch * _per_sample_dot(dy, guess), dx


def with_head(grads, params, head_grads):
  """``grads`` of the block, with the head's (when the stage has one)."""
  if auxiliary.AUX_KEY not in params:
    return grads
  return {**grads, auxiliary.AUX_KEY: head_grads}
