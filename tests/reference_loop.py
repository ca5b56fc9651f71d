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
``jax.grad`` of the composed model instead. :func:`run_local` (DGL) and
:func:`run_forward_gradient` are the two methods without a cotangent;
:class:`Compensation` (weight prediction, prediction along the last update, error
feedback) and :func:`lookahead_b1` are the delay compensations, written from their
equations.
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


AUX = "aux_head"  # a stage's auxiliary head's parameters live under this key


def _block_only(tree):
  """A stage's parameters without its auxiliary head's."""
  return {key: v for key, v in tree.items() if key != AUX} if isinstance(tree, dict) else tree


def kernel_mask(params):
  """True on every leaf whose last key is ``kernel`` (decayed), False elsewhere."""
  return jax.tree_util.tree_map_with_path(
      lambda path, _: getattr(path[-1], "key", None) == "kernel", params)


class VelocityState(NamedTuple):
  velocity: object  # v, like the params


def momentum_sgd(lr: float, momentum: float, weight_decay: float = 0.0
                 ) -> optax.GradientTransformation:
  """Heavy-ball SGD written out: ``v <- mu v + (g + wd w [kernels])``, ``w <- w - lr v``.

  Its state (:class:`VelocityState`) is what :class:`Compensation` ``"velocity"``
  predicts along. Constant ``lr`` (float).
  """
  def init(params):
    return VelocityState(jax.tree.map(jnp.zeros_like, params))

  def update(grads, state, params):
    decayed = jax.tree.map(lambda g, w, m: g + weight_decay * w if m else g, grads, params,
                           kernel_mask(params))
    v = jax.tree.map(lambda v, g: momentum * v + g, state.velocity, decayed)
    return jax.tree.map(lambda v: -lr * v, v), VelocityState(v)
  return optax.GradientTransformation(init, update)


def lookahead_b1(b1: float, b1_max: float, delay: float, delay_ref: float) -> float:
  """The per-stage first-moment decay of a look-ahead: ``b1 + (b1_max - b1) min(D / D_ref, 1)``
  for a stage ``D > 0`` updates stale (Ajanthan et al., 2025, Sec. 3), ``b1`` at ``D = 0``."""
  return b1 if delay <= 0 else b1 + (b1_max - b1) * min(delay / delay_ref, 1.0)


class Compensation(NamedTuple):
  """One stage's delay compensation, ``h`` updates ahead (``h = s D_j``, ``D_j = tau_j / k``).

  ``kind``:

  * ``"none"``;
  * ``"velocity"`` (weight prediction, Kosson et al. 2021): the forward uses
    ``w - lr h v``, ``v`` the :func:`momentum_sgd` velocity (``learning_rate`` = its ``lr``);
  * ``"last_update"`` (prediction for Muon): the forward uses ``w + h u``, ``u`` the
    last update applied (zero before the first);
  * ``"error_feedback"`` (Zmushko et al.): each update ``u_t`` of the optimizer is
    applied as ``u_t + h (u_t - u_{t-1})`` (``u_t`` itself at ``t = 0``).
  """
  kind: str = "none"
  horizon: float = 0.0
  learning_rate: float = 0.0


_NONE = Compensation()


def _forward_weights(comp: Compensation, params, opt_state, last_update):
  """The weights a stage's forward uses under ``comp``, from its state at that tick."""
  if comp.kind == "velocity" and comp.horizon:
    return jax.tree.map(lambda w, v: w - comp.learning_rate * comp.horizon * v, params,
                        opt_state.velocity)
  if comp.kind == "last_update" and comp.horizon:
    return jax.tree.map(lambda w, u: w + comp.horizon * u, params, last_update)
  return params


def _fed_back(comp: Compensation, update, previous, count: int):
  """``u_t + h (u_t - u_{t-1})`` under ``"error_feedback"`` (``t = count > 0``), else ``u_t``."""
  if comp.kind != "error_feedback" or count == 0 or not comp.horizon:
    return update
  return jax.tree.map(lambda u, p: u + comp.horizon * (u - p), update, previous)


class _StageOptimizer:
  """One stage's weights over its gradients: ``k`` per update, compensated by ``comp``.

  ``snapshots[n]``: ``(params, opt_state, last applied update)`` after ``n`` gradients.
  """

  def __init__(self, tx, comp: Compensation, k: int, params0):
    self.tx, self.comp, self.k, self.step = tx, comp, k, _update_fn(tx)
    zeros = jax.tree.map(jnp.zeros_like, params0)
    self.snapshots = [(params0, tx.init(params0), zeros)]
    self.pending, self.previous, self.count = [], zeros, 0

  def params(self, n: int):
    return self.snapshots[n][0]

  def forward_params(self, n: int):
    """The weights a forward after ``n`` gradients uses (predicted under ``comp``)."""
    return _forward_weights(self.comp, *self.snapshots[n])

  def add(self, grads) -> None:
    """One more gradient; the ``k``-th since the last update makes one."""
    params, opt, last = self.snapshots[-1]
    self.pending.append(grads)
    if len(self.pending) == self.k:
      mean = jax.tree.map(lambda *g: sum(g) / self.k, *self.pending)
      update, opt = self.step(mean, opt, params)
      last = _fed_back(self.comp, update, self.previous, self.count)
      self.previous, self.count, self.pending = update, self.count + 1, []
      params = optax.apply_updates(params, last)
    self.snapshots.append((params, opt, last))


class Result(NamedTuple):
  losses: list          # per micro-batch, float
  params: list          # per stage, after every gradient
  batch_stats: list     # per stage


def run(fns: StageFunctions, row: Row, txs: Sequence[optax.GradientTransformation], k: int,
        params0: list, stats0: list, batches: Callable, num_micro: int,
        compensations: Sequence[Compensation] | None = None) -> Result:
  """Micro-batches ``0 .. num_micro-1`` under ``row`` (module docstring).

  ``txs``: per stage, the optimizer of one update (no accumulation: the mean of
  ``k`` gradients is taken here). ``batches``: ``m -> (images, labels)``.
  ``compensations``: per stage (default none); a forward's weights are predicted
  from the stage's state at the forward's tick, and a stashing row's vjp uses them.
  """
  J = len(fns.stages)
  reversible = [all(b.reversible for b in _blocks(s)) for s in fns.stages]
  comps = list(compensations or [_NONE] * J)
  opts = [_StageOptimizer(tx, c, k, p) for tx, c, p in zip(txs, comps, params0)]
  stats, losses = list(stats0), []
  for m in range(num_micro):
    x, labels = batches(m)
    current = [o.params(m) for o in opts]
    tau = [2 * (J - 1 - j) if row.delayed else 0 for j in range(J)]
    forward_w = [opts[j].forward_params(max(m - tau[j], 0)) for j in range(J)]
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
      opts[j].add(grads[j])
  return Result(losses, [o.params(num_micro) for o in opts], stats)


@functools.lru_cache(maxsize=None)
def _update_fn(tx: optax.GradientTransformation) -> Callable:
  """Jitted ``(grads, opt_state, params) -> (update, opt_state)``: one optax update."""
  return jax.jit(tx.update)


def _head_loss(stage, params, stats, x, labels):
  """A stage with an auxiliary head: ``CE(head(F(x)), labels)``, with ``(y, new statistics)``."""
  y, new = stage_forward(stage, _block_only(params), stats, x)
  logits = stage.head.apply({"params": params[AUX]}, y)
  return _cross_entropy(logits, labels), (y, new)


@functools.lru_cache(maxsize=None)
def _local_fn(stage) -> Callable:
  """Jitted ``(params, stats, x, labels) -> ((aux loss, (y, stats)), grads)``."""
  return jax.jit(jax.value_and_grad(functools.partial(_head_loss, stage), has_aux=True))


def run_local(fns: StageFunctions, txs: Sequence, k: int, params0: list, stats0: list,
              batches: Callable, num_micro: int) -> Result:
  """Decoupled greedy learning (Belilovsky et al., ICML 2020): stage ``j < J-1``
  minimises its auxiliary head's loss ``CE(h_j(F_j(x_j)), labels)`` over
  ``(theta_j, h_j)``, at its weights after ``m`` gradients, and sends
  ``x_{j+1} = F_j(x_j)`` (those weights) forward; the last stage minimises the
  real loss; no cotangent travels back. ``losses``: the last stage's."""
  J = len(fns.stages)
  opts = [_StageOptimizer(tx, _NONE, k, p) for tx, p in zip(txs, params0)]
  stats, losses = list(stats0), []
  for m in range(num_micro):
    h, labels = batches(m)
    grads = []
    for j in range(J - 1):
      (_, (y, stats[j])), g = _local_fn(fns.stages[j])(opts[j].params(m), stats[j], h, labels)
      grads.append(g)
      h = y
    loss, _, g_last, stats[-1] = fns.loss(opts[-1].params(m), stats[-1], h, labels)
    losses.append(float(loss))
    for o, g in zip(opts, grads + [g_last]):
      o.add(g)
  return Result(losses, [o.params(num_micro) for o in opts], stats)


class ForwardGradient(NamedTuple):
  """Forward gradients (Fournier et al., ICML 2023): stage ``j`` guesses ``v_j`` and
  steps along ``g~_j = <g_j, v_j> / (||v_j||^2 + eps) v_j``.

  ``guess``: ``"random"`` (standard Gaussian per leaf: the key ``fold_in(fold_in(
  key(seed + 3), m), j)`` split into one key per leaf, in the leaves' flattening
  order) or ``"local"`` (the gradient of the stage's auxiliary loss, whose head then
  learns from that loss). ``perturb``: ``"activity"`` (``v_j`` like the stage's
  output, the mean over the batch of ``<dL/dy, v>`` projected and pulled back
  through the stage's vjp) or ``"weights"`` (``v_j`` like its parameters).
  """
  guess: str = "random"
  perturb: str = "activity"
  seed: int = 0
  eps: float = 1e-16


def _dot(a, b):
  return sum(jnp.vdot(u, v) for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def _gaussian(key, like):
  leaves, tree = jax.tree.flatten(like)
  keys = jax.random.split(key, len(leaves))
  return jax.tree.unflatten(tree, [jax.random.normal(kk, a.shape, jnp.float32)
                                   for kk, a in zip(keys, leaves)])


def _jvp(f, x, t):
  """``J_f(x) t`` by transposing the vjp (the vjp of ``u -> J^T u``): forward mode
  without ``jax.jvp``, which a ``custom_vjp`` module (the models' BatchNorm) refuses."""
  y, vjp = jax.vjp(f, x)
  _, transpose = jax.vjp(vjp, jax.tree.map(jnp.zeros_like, y))
  return transpose((t,))[0]


def _fg_forward(stage, fg: ForwardGradient, params, stats, x, labels, tangents, key):
  """Stage ``j``'s forward of ``m`` at weights ``params``: ``(y, new stats, tangents
  pushed and its own appended, guess, head gradient or None)``; the tangents
  ``t_i`` of earlier stages become ``J_x F_j t_i``; its own is ``v_j`` (activity)
  or ``J_theta F_j v_j`` (weights)."""
  block = _block_only(params)
  f = lambda p, x: stage_forward(stage, p, stats, x)  # noqa: E731
  y, new = f(block, x)
  head = None
  if fg.guess == "local":
    if fg.perturb == "weights":
      gp = jax.grad(lambda p: _head_loss(stage, p, stats, x, labels)[0])(params)
      guess, head = _block_only(gp), gp[AUX]
    else:
      guess, head = jax.grad(lambda y, h: _cross_entropy(stage.head.apply({"params": h}, y),
                                                         labels), argnums=(0, 1))(y, params[AUX])
  else:
    guess = _gaussian(key, block if fg.perturb == "weights" else y)
  pushed = [_jvp(lambda x: f(block, x)[0], x, t) for t in tangents]
  own = guess if fg.perturb == "activity" else _jvp(lambda p: f(p, x)[0], block, guess)
  return y, new, pushed + [own], guess, head


def _fg_scalars(stage, params, stats, x, labels, tangents):
  """``[len(tangents)]``: the derivative of the mean loss of the last stage along each tangent."""
  loss = lambda x: _cross_entropy(stage_forward(stage, params, stats, x)[0], labels)  # noqa: E731
  return jnp.stack([_jvp(loss, x, t) for t in tangents])


def _fg_estimate(stage, fg: ForwardGradient, params, stats, x, guess, scalar, head):
  """``g~_j`` at the stage's weights ``params`` (its backward's), on its forward's input ``x``."""
  c = scalar / (_dot(guess, guess) + fg.eps)
  if fg.perturb == "weights":
    grads = jax.tree.map(lambda v: c * v, guess)
  else:
    _, vjp = jax.vjp(lambda p: stage_forward(stage, p, stats, x)[0], _block_only(params))
    grads = vjp(jax.tree.map(lambda v: c * v, guess))[0]
  return grads if head is None else {**grads, AUX: head}


@functools.lru_cache(maxsize=None)
def _fg_fns(stage, last, fg: ForwardGradient) -> tuple:
  """Jitted ``(forward, estimate)`` of a stage, or ``scalars`` of the last one."""
  if last:
    return jax.jit(functools.partial(_fg_scalars, stage))
  return (jax.jit(functools.partial(_fg_forward, stage, fg)),
          jax.jit(functools.partial(_fg_estimate, stage, fg)))


def run_forward_gradient(fns: StageFunctions, fg: ForwardGradient, txs: Sequence, k: int,
                         params0: list, stats0: list, batches: Callable,
                         num_micro: int) -> Result:
  """Forward gradients on the stream with real delays (:class:`ForwardGradient`).

  Micro-batch ``m``: stage ``j < J-1``'s forward (guess, tangents) at its weights
  after ``max(m - tau_j, 0)`` gradients, ``tau_j = 2 (J-1-j)``; the last stage
  measures every ``<g_j, v_j>`` (the jvp of its mean loss along ``t_j``) and takes
  its own gradient, at its weights after ``m`` gradients; stage ``j``'s estimate is
  taken at its weights after ``m`` gradients (its backward's tick) on the input of
  its forward. Running statistics: each stage's forwards'.
  """
  J = len(fns.stages)
  opts = [_StageOptimizer(tx, _NONE, k, p) for tx, p in zip(txs, params0)]
  stats, losses = list(stats0), []
  base = jax.random.key(fg.seed + 3)
  for m in range(num_micro):
    h, labels = batches(m)
    tangents, kept = [], []
    for j in range(J - 1):
      w = opts[j].params(max(m - 2 * (J - 1 - j), 0))
      key = jax.random.fold_in(jax.random.fold_in(base, m), j)
      forward = _fg_fns(fns.stages[j], False, fg)[0]
      y, stats[j], tangents, guess, head = forward(w, stats[j], h, labels, tangents, key)
      kept.append((h, guess, head))
      h = y
    last = opts[-1].params(m)
    scalars = _fg_fns(fns.stages[-1], True, fg)(last, stats[-1], h, labels, tangents)
    loss, _, g_last, stats[-1] = fns.loss(last, stats[-1], h, labels)
    losses.append(float(loss))
    for j, (x, guess, head) in enumerate(kept):
      estimate = _fg_fns(fns.stages[j], False, fg)[1]
      opts[j].add(estimate(opts[j].params(m), stats[j], x, guess, scalars[j], head))
    opts[-1].add(g_last)
  return Result(losses, [o.params(num_micro) for o in opts], stats)


def without_key_bias(tree):
  """``tree`` with every attention ``key`` bias removed: its gradient is zero in exact
  arithmetic (a per-query constant added to every logit, which the softmax cancels), so
  in float32 it is round-off, which an AdamW-like normalisation turns into +-lr steps."""
  if not isinstance(tree, dict):
    return tree
  return {name: ({k: v for k, v in sub.items() if k != "bias"} if name == "key"
                 and isinstance(sub, dict) else without_key_bias(sub))
          for name, sub in tree.items()}


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
