"""An independent reference for every method, with real delays: a plain Python loop.

Written from the paper (Rivaud et al., ICLR 2025): Alg. 1, Eq. 5 and Table 4,
and the flushed schedules (GPipe, 1F1B) as exact backprop. It uses no engine
code for scheduling, delays, stashing or reconstruction: only each block's
Flax ``module.apply``, ``jax.vjp``/``jax.grad`` and optax. Stages
``j = 0 .. J-1``; the last computes the loss. Micro-batch ``m`` runs, stage by
stage:

* forward at stage ``j`` with the weights after ``max(m - tau_j, 0)`` of its
  gradients, ``tau_j = 2 (J-1-j)`` ticks on the stream (Alg. 1: the forward of
  ``m`` at tick ``m + j``, its backward at tick ``m + 2(J-1) - j``, forward
  before backward in a tick), ``tau_j = 0`` otherwise;
* the loss stage's forward and backward with its current weights (``m`` gradients);
* backward at stage ``j`` (current weights: after ``m`` gradients): a
  reversible stage of a reconstructing method rebuilds its input from the
  output it is sent (``x~ = (y2, y1 - F(y2))`` block by block, current
  weights) and sends ``x~`` down; every other stage uses its buffered input
  and sends that. The vjp is taken at the current or the stashed (forward's)
  weights as :data:`ROWS` says;
* every ``k`` gradients of a stage, their mean goes through its optimizer.

BatchNorm normalises with batch statistics; its running statistics take the
backward's batch statistics (paper Sec. 4: updated in the backward recomputation).
The exact rows (``backprop``, ``gpipe``, ``1f1b``, ``zb_h1``, ``revprop``) take
``jax.grad`` of the composed model instead.
"""

from __future__ import annotations

import functools
from typing import Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import optax


class Row(NamedTuple):
  """One method: ``delayed`` (stream delays ``tau_j``), ``reconstructs`` (reversible
  stages rebuild their input with current weights), ``stashed`` (the vjp at the
  forward's weights, not the current ones); ``exact``: ``jax.grad`` of the composed model."""
  delayed: bool
  reconstructs: bool
  stashed: bool
  exact: bool = False


_EXACT = Row(False, False, False, exact=True)
ROWS = {  # paper Table 4 (delayed? input buffer? weight buffer?), GPipe, 1F1B and ZB-H1
    "backprop": _EXACT, "gpipe": _EXACT, "1f1b": _EXACT, "zb_h1": _EXACT, "revprop": _EXACT,
    "petra": Row(True, True, False),              # no buffer, current weights
    "approximate_input": Row(True, True, True),   # weights stashed, input rebuilt
    "dsp": Row(True, False, False),               # input buffered, current weights
    "delayed": Row(True, False, True),            # input and weights buffered
}


def _blocks(stage) -> tuple:
  return stage.blocks or (stage,)


def _block_params(stage, tree, i):
  return tree[f"block_{i}"] if stage.blocks else tree


def _apply(block, params, stats, x):
  """``(module(x), new running statistics)`` in training mode (batch statistics)."""
  variables = {"params": params, "batch_stats": stats} if stats else {"params": params}
  out, mutated = block.module.apply(variables, x, train=True, mutable=["batch_stats"])
  return out, mutated.get("batch_stats", {})


def _block_forward(block, params, stats, x):
  """A block: the coupling ``(x2 + F(x1), x1)`` if reversible, else the module."""
  assert block.pre is None, "the reference knows no reshuffle before a coupling"
  if not block.reversible:
    return _apply(block, params, stats, x)
  x1, x2 = x
  f, new = _apply(block, params, stats, x1)
  return (x2 + f, x1), new


def stage_forward(stage, params, stats, x):
  """A stage's blocks in sequence: ``(output, new statistics)`` shaped as ``stats``."""
  new = []
  for i, block in enumerate(_blocks(stage)):
    x, s = _block_forward(block, _block_params(stage, params, i),
                          _block_params(stage, stats, i), x)
    new.append(s)
  return x, ({f"block_{i}": s for i, s in enumerate(new)} if stage.blocks else new[0])


def _cross_entropy(logits, labels):
  return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


class StageFunctions:
  """Each stage's jitted pieces for the reference (built once per model)."""

  def __init__(self, stages: Sequence):
    self.stages = list(stages)
    self.forward = [jax.jit(lambda p, s, x, st=st: stage_forward(st, p, s, x)[0])
                    for st in stages]
    self.recompute = [jax.jit(functools.partial(_recompute, st)) for st in stages]
    self.reverse = [jax.jit(functools.partial(_reverse, st)) for st in stages]
    self.loss = jax.jit(functools.partial(_loss, stages[-1]))
    self.composed = jax.jit(functools.partial(_composed, self.stages))


def _recompute(stage, params, stats, x, dy):
  """vjp of the stage at its buffered input ``x``: ``(dx, grads, new statistics)``."""
  _, vjp, new = jax.vjp(lambda p, x: stage_forward(stage, p, stats, x), params, x,
                        has_aux=True)
  grads, dx = vjp(dy)
  return dx, grads, new


def _reverse(stage, current, vjp_params, stats, y, dy):
  """Reconstruct block by block with ``current`` weights, vjp at ``vjp_params``:
  ``(x~, dx, grads, new statistics)``."""
  grads, new = {}, {}
  blocks = _blocks(stage)
  for i in reversed(range(len(blocks))):
    b, key = blocks[i], f"block_{i}"
    w, v, s = (_block_params(stage, t, i) for t in (current, vjp_params, stats))
    y1, y2 = y
    x_tilde = (y2, y1 - _apply(b, w, s, y2)[0])
    _, vjp, new[key] = jax.vjp(lambda p, x, b=b, s=s: _block_forward(b, p, s, x), v, x_tilde,
                               has_aux=True)
    grads[key], dy = vjp(dy)
    y = x_tilde
  if not stage.blocks:
    grads, new = grads["block_0"], new["block_0"]
  return y, dy, grads, new


def _loss(stage, params, stats, x, labels):
  """The loss stage's forward and backward: ``(loss, dx, grads, new statistics)``."""
  def f(p, x):
    logits, new = stage_forward(stage, p, stats, x)
    return _cross_entropy(logits, labels), new
  (loss, new), (grads, dx) = jax.value_and_grad(f, argnums=(0, 1), has_aux=True)(params, x)
  return loss, dx, grads, new


def _composed(stages, params, stats, x, labels):
  """``jax.grad`` of the composed model: ``(loss, grads, new statistics)``."""
  def f(params):
    h, new = x, []
    for st, p, s in zip(stages, params, stats):
      h, n = stage_forward(st, p, s, h)
      new.append(n)
    return _cross_entropy(h, labels), new
  (loss, new), grads = jax.value_and_grad(f, has_aux=True)(params)
  return loss, grads, new


class Result(NamedTuple):
  losses: list          # per micro-batch, float
  params: list          # per stage, after every gradient
  batch_stats: list     # per stage


def run(fns: StageFunctions, row: Row, txs: Sequence[optax.GradientTransformation], k: int,
        params0: list, stats0: list, batches: Callable, num_micro: int) -> Result:
  """Micro-batches ``0 .. num_micro-1`` under ``row`` (module docstring).

  ``txs``: per stage, the optimizer of one update (no accumulation: the mean of
  ``k`` gradients is taken here). ``batches``: ``m -> (images, labels)``.
  """
  J = len(fns.stages)
  reversible = [all(b.reversible for b in _blocks(s)) for s in fns.stages]
  versions = [[p] for p in params0]  # versions[j][n]: stage j's weights after n gradients
  stats, opt = list(stats0), [tx.init(p) for tx, p in zip(txs, params0)]
  update = [_step(tx) for tx in txs]
  pending = [[] for _ in range(J)]
  losses = []
  for m in range(num_micro):
    x, labels = batches(m)
    current = [v[m] for v in versions]
    tau = [2 * (J - 1 - j) if row.delayed else 0 for j in range(J)]
    forward_w = [versions[j][max(m - tau[j], 0)] for j in range(J)]
    if row.exact:
      loss, grads, stats = fns.composed(current, stats, x, labels)
    else:
      inputs = [x]
      for j in range(J - 1):
        inputs.append(fns.forward[j](forward_w[j], stats[j], inputs[-1]))
      grads, new = [None] * J, [None] * J
      loss, dy, grads[-1], new[-1] = fns.loss(current[-1], stats[-1], inputs[-1], labels)
      sent = inputs[-1]  # what stage j+1 sends down with its cotangent
      for j in reversed(range(J - 1)):
        vjp_w = forward_w[j] if row.stashed else current[j]
        if row.reconstructs and reversible[j]:
          sent, dy, grads[j], new[j] = fns.reverse[j](current[j], vjp_w, stats[j], sent, dy)
        else:
          sent = inputs[j]
          dy, grads[j], new[j] = fns.recompute[j](vjp_w, stats[j], sent, dy)
      stats = new
    losses.append(float(loss))
    for j in range(J):
      pending[j].append(grads[j])
      p = current[j]
      if len(pending[j]) == k:
        mean = jax.tree.map(lambda *g: sum(g) / k, *pending[j])
        p, opt[j] = update[j](mean, opt[j], p)
        pending[j] = []
      versions[j].append(p)
  return Result(losses, [v[-1] for v in versions], stats)


@functools.lru_cache(maxsize=None)
def _step(tx: optax.GradientTransformation) -> Callable:
  """Jitted ``(grads, opt_state, params) -> (params, opt_state)``: one optax step."""
  def step(grads, opt_state, params):
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state
  return jax.jit(step)


def max_rel_diff(a: Sequence, b: Sequence) -> float:
  """Max over stages of ``||a_j - b_j|| / ||b_j||``, each norm over all of stage ``j``'s
  leaves (a leaf of round-off alone, e.g. an attention key bias, whose gradient
  cancels in the softmax, counts at its size); 0 for a stage without leaves."""
  out = 0.0
  for u, v in zip(a, b):
    pairs = [(jnp.asarray(x, jnp.float32), jnp.asarray(y, jnp.float32))
             for x, y in zip(jax.tree.leaves(u), jax.tree.leaves(v))]
    num = sum(float(jnp.sum((x - y) ** 2)) for x, y in pairs)
    den = sum(float(jnp.sum(y ** 2)) for _, y in pairs)
    out = max(out, (num / den) ** 0.5 if den else 0.0)
  return out
