"""Forward gradients with local guesses: the per-stage functions (Fournier et al., ICML 2023).

Stage ``j`` guesses ``v_j`` (``"local"``: its auxiliary-loss gradient;
``"random"``: Gaussian) and measures the projection of the true gradient::

    g~_j = <g_j, v_j> / (||v_j||^2 + eps) v_j          (paper Sec. 3)

``<g_j, v_j>`` is a jvp whose tangent rides forward to the last stage, which
returns per-sample scalars ``s[b]`` (derivative of ``l_b`` along the tangent).
``perturb="weights"``: ``v_j`` in parameter space; ``"activity"``: in the
output space ``[B, ...]``, the update a vjp along ``w v_j``, with ``w`` per
micro-batch (``projection="batch"``) or per sample (``"sample"``).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp
import optax

from petra_jax.engine.methods import auxiliary
from petra_jax.engine.methods.auxiliary import block_params
from petra_jax.engine.stages.stage import forward, linearizing

GUESSES = ("local", "random")
PERTURBS = ("weights", "activity")
PROJECTIONS = ("batch", "sample")


@dataclasses.dataclass(frozen=True)
class Options:
  """``config.forward_gradient`` and the run's ``seed``; raises ValueError on a bad option."""
  guess: str = "local"
  perturb: str = "activity"
  emulate: bool = False
  eps: float = 1e-16
  projection: str = "batch"
  seed: int = 0

  def __post_init__(self):
    check_options(self.guess, self.perturb, self.emulate, self.eps, self.projection)


def check_options(guess: str, perturb: str, emulate, eps, projection: str = "batch") -> None:
  """Raises ValueError naming every bad ``config.forward_gradient`` option."""
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
  """``(guess, head_grads)``: like the block's params (``weights``) or ``y [B, ...]``."""
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
  """The forward with ``tangents`` (like ``x``, ``[n, B, ...]``) pushed through it.

  Returns ``(y, batch_stats, pushed [n, B, ...] or None, own J_theta F v_j or None)``.
  """
  block = block_params(params)
  with linearizing():
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
  """``float32[n, B]``: derivative of sample ``b``'s loss along tangent ``i`` (``[n, B, ...]``)."""
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
  """The estimate, like the block's params; ``x`` buffered input, ``scalars float32[B]``."""
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
  """``(scalars float32[B], dx)`` from the exact gradient ``dy = dL/dy_j`` (``emulate=True``)."""
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
