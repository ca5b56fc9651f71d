"""Each stage's jitted steps (paper Eq. 5, Alg. 1 l. 27-30), and what a backward takes.

``*_grads`` are backwards without the update; inputs may be quantised messages
(dequantised first).
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp

from petra_jax.engine.arrays import packing
from petra_jax.engine.arrays import quantize as quantize_lib
from petra_jax.engine.stages.stage import (Stage, composed_loss, forward, loss_vjp, recompute_vjp,
                                    reverse_vjp, reverse_vjp_stashed)
from petra_jax.engine.stages.stage_state import StageState

PyTree = Any
BN_POLICIES = ("backward", "forward")


def forward_step(stage: Stage, state: StageState, x, params=None):
  """``(y, batch_stats)``: the forward with ``theta_j^t`` (Eq. 5 row 1) or ``params``."""
  x = quantize_lib.dequantize(x)
  return forward(stage, state.params if params is None else params, state.batch_stats, x)


def reverse_grads(stage: Stage, state: StageState, y, dy, vjp_params=None):
  """Reconstruct, vjp (Eq. 5 rows 2-4) at ``vjp_params`` if given: ``(x~, dx, grads, stats)``."""
  y, dy = quantize_lib.dequantize((y, dy))
  if vjp_params is None:
    return reverse_vjp(stage, state.params, state.batch_stats, y, dy)
  return reverse_vjp_stashed(stage, state.params, vjp_params, state.batch_stats, y, dy)


def recompute_grads(stage: Stage, input_grad: bool, state: StageState, x, dy, vjp_params=None):
  """Recompute and vjp, at ``vjp_params`` if given: ``(dx, grads, stats)``."""
  x, dy = quantize_lib.dequantize((x, dy))
  params = state.params if vjp_params is None else vjp_params
  return recompute_vjp(stage, params, state.batch_stats, x, dy, input_grad=input_grad)


def loss_grads(stage: Stage, state: StageState, x, labels):
  """The last stage's forward, loss and backward: ``(loss, dx, grads, stats)``."""
  x = quantize_lib.dequantize(x)
  return loss_vjp(stage, state.params, state.batch_stats, x, labels)


def _update(state: StageState, grads, new_stats, take_stats: bool) -> StageState:
  return state.apply_gradients(grads, new_stats if take_stats else state.batch_stats)


def reverse_backward_step(stage: Stage, take_stats: bool, state: StageState, y, dy,
                          vjp_params=None):
  """Reconstruct, vjp and update (Eq. 5 rows 2-5): ``(new_state, x_tilde, dx)``."""
  x, dx, grads, stats = reverse_grads(stage, state, y, dy, vjp_params)
  return _update(state, grads, stats, take_stats), x, dx


def recompute_backward_step(stage: Stage, take_stats: bool, input_grad: bool,
                            state: StageState, x, dy, vjp_params=None):
  """Recompute, vjp and update: ``(new_state, dx)``."""
  dx, grads, stats = recompute_grads(stage, input_grad, state, x, dy, vjp_params)
  return _update(state, grads, stats, take_stats), dx


def loss_step(stage: Stage, state: StageState, x, labels):
  """Last stage: forward, loss, backward and update: ``(new_state, dx, loss)``."""
  loss, dx, grads, stats = loss_grads(stage, state, x, labels)
  return _update(state, grads, stats, True), dx, loss


def fused_step(forward_fn: Callable, backward_fn: Callable, predict: Optional[Callable],
               stats_in_forward: bool, stash: bool, state: StageState, x, *backward_args):
  """One stage's forward then backward of one tick in one call, both at ``theta_j^t``.

  Returns:
    ``((y, forward weights or None), backward_fn's outputs)``.
  """
  params = None if predict is None else predict(state.params, state.opt_state)
  y, stats = forward_fn(state, x, params)
  kept = (state.params if params is None else params) if stash else None
  if stats_in_forward:
    state = state.replace(batch_stats=stats)
  return (y, kept), backward_fn(state, *backward_args)


def predict_step(predict: Callable, state: StageState):
  """``predict(params, opt_state)``: the forward's predicted weights."""
  return predict(state.params, state.opt_state)


def params_step(state: StageState):
  """A copy of the current weights (what a stashing forward keeps)."""
  return jax.tree.map(jnp.copy, state.params)


def stats_step(state: StageState, batch_stats) -> StageState:
  """``state`` with ``batch_stats`` (a forward's, ``"forward"`` policy)."""
  return state.replace(batch_stats=batch_stats)


def eval_all_step(stages: Sequence[Stage], states: Sequence, x):
  """Every stage's :func:`eval_step` in turn: the logits, in one program."""
  for stage, state in zip(stages, states):
    x = packing.on_packed(functools.partial(eval_step, stage))(state, x)
  return x


def eval_step(stage: Stage, state: StageState, x):
  """Stage forward with the running BatchNorm statistics (evaluation)."""
  return forward(stage, state.params, state.batch_stats, x, train=False)[0]


def backprop_step(stages: Sequence[Stage], states: Sequence[StageState], images, labels):
  """Exact backprop (``jax.grad`` of the composed model): ``(new_states, loss)``."""
  (loss, new_stats), grads = jax.value_and_grad(
      lambda p: composed_loss(stages, p, [s.batch_stats for s in states], images, labels),
      has_aux=True)([s.params for s in states])
  return [_update(s, g, n, True) for s, g, n in zip(states, grads, new_stats)], loss


def _jit(fn: Callable, donate_argnums=(), wrap: Optional[Callable] = None):
  """``fn`` jitted for packed states too, through ``wrap`` if given. Inline: inside another
  trace (the compiled executor's program) its operations join the caller's, where
  :mod:`~petra_jax.engine.transport.ordered_writes` can see which of them read a slot."""
  fn = packing.on_packed(fn)
  return jax.jit(fn if wrap is None else wrap(fn), donate_argnums=donate_argnums, inline=True)


_copy_params = _jit(params_step)  # shared by every stage (one compilation per shape)
_replace_stats = _jit(stats_step, donate_argnums=0)


class StageSteps:
  """Stage ``j``'s jitted steps (what its tasks call): which backward it runs, on which
  arguments, donating which; its forward, fused tick, prediction, evaluation and gradient.

  Args:
    stage: the :class:`Stage`; ``j`` its index of ``num_stages``.
    method: a :class:`petra_jax.engine.methods.Method` row.
    bn_stats: one of :data:`BN_POLICIES`.
    predictor: None or ``(params, opt_state) -> params`` (the forward's weights).
    donate_messages: whether a reconstructing backward donates its messages.
    wrap: applied to the steps before they are jitted (:meth:`jit`).
  """

  def __init__(self, stage: Stage, j: int, num_stages: int, method, bn_stats: str,
               predictor: Optional[Callable] = None, donate_messages: bool = True,
               wrap: Optional[Callable] = None):
    self.stage, self.j, self.method = stage, j, method
    self.last = j == num_stages - 1
    self._wrap, self._predictor = wrap, predictor
    self.stats_in_forward = bn_stats == "forward"
    self.reconstructs = method.reconstructs_stage(stage.reversible)
    self._predict = None if predictor is None else self.jit(
        functools.partial(predict_step, predictor))
    self._forward = self.jit(functools.partial(forward_step, stage))
    self._eval = _jit(functools.partial(eval_step, stage))
    donated = self._donated(donate_messages)
    self._backward = self.jit(self._backward_fn(), donated)
    self._fused = None if self.last else self._fused_jit(donated)

  def jit(self, fn: Callable, donate_argnums=()) -> Callable:
    """``fn(state, *args)`` jitted as every step is: on packed states too, through the
    pipeline's ``step_wrap``, donating ``donate_argnums`` (a schedule's own steps)."""
    return _jit(fn, donate_argnums, self._wrap)

  def _fused_jit(self, donated):
    fn = functools.partial(fused_step, functools.partial(forward_step, self.stage),
                           self._backward_fn(), self._predictor, self.stats_in_forward,
                           self.method.stashes_weights)
    return self.jit(fn, (0, 2, 3) if donated != 0 else 0)

  def _backward_fn(self, grads_only: bool = False):
    """The backward step (or its gradient only) on :meth:`backward_args`."""
    s, take, j = self.stage, not self.stats_in_forward, self.j
    if self.last:
      return functools.partial(loss_grads if grads_only else loss_step, s)
    if self.reconstructs:
      return functools.partial(reverse_grads, s) if grads_only else functools.partial(
          reverse_backward_step, s, take)
    return functools.partial(recompute_grads, s, j > 0) if grads_only else functools.partial(
        recompute_backward_step, s, take, j > 0)

  def _donated(self, donate_messages: bool):
    messages = donate_messages and self.reconstructs and not self.last
    return (0, 1, 2) if messages else 0

  def backward_args(self, *, x=None, y=None, dy=None, labels=None, stashed=None) -> tuple:
    """``(x, labels)`` (last), ``(y, dy)`` (reconstructing) or ``(x, dy)``; + ``stashed``."""
    if self.last:
      return (x, labels)
    args = (y, dy) if self.reconstructs else (x, dy)
    return args + (stashed,) if self.method.stashes_weights else args

  def backward(self, train_state: StageState, *args):
    """The backward (donating the state).

    Returns ``(state, x~, dx)`` reconstructing, ``(state, dx, loss)`` last, else ``(state, dx)``.
    """
    return self._backward(train_state, *args)

  def forward_backward(self, train_state: StageState, x, *args) -> tuple:
    """:func:`fused_step` (not on the last stage), donating ``train_state``."""
    return self._fused(train_state, x, *args)

  def gradient(self, train_state: StageState, *args) -> PyTree:
    """The gradient the backward would apply, without applying it or donating."""
    if not hasattr(self, "_gradient"):  # built on a probe's first use only
      self._gradient = _jit(self._backward_fn(grads_only=True))
    out = self._gradient(train_state, *args)
    return out[2] if self.reconstructs or self.last else out[1]

  def forward_params(self, train_state: StageState):
    """The weights the forward uses: predicted, or the current ones."""
    predicted = self.predicted_params(train_state)
    return train_state.params if predicted is None else predicted

  def predicted_params(self, train_state: StageState):
    """The predicted weights, or None without a predictor."""
    return None if self._predict is None else self._predict(train_state)

  def current_params(self, train_state: StageState):
    """A copy of the current weights."""
    return _copy_params(train_state)

  def with_stats(self, train_state: StageState, batch_stats):
    """``train_state`` (donated, packed or not) with ``batch_stats``."""
    if isinstance(train_state, StageState):
      return train_state.replace(batch_stats=batch_stats)
    return _replace_stats(train_state, batch_stats)

  def forward(self, train_state: StageState, x, params=None):
    """The jitted forward: ``(y, batch_stats)``, at ``params`` if given."""
    if params is None:
      return self._forward(train_state, x)
    return self._forward(train_state, x, params)

  def jitted_steps(self) -> tuple:
    """The jitted ``(forward, backward)``."""
    return self._forward, self._backward

  def evaluate(self, train_state: StageState, x):
    """The forward with the running BatchNorm statistics."""
    return self._eval(train_state, x)


class PipelineSteps:
  """Every stage's :class:`StageSteps` (``steps[j]``), and the two steps that span the
  stages: backprop's whole-model update and the one-program evaluation.

  Args:
    predictors: per stage, None or ``(params, opt_state) -> params``.
    The others: as :class:`StageSteps`'s.
  """

  def __init__(self, stages: Sequence[Stage], method, bn_stats: str,
               predictors: Optional[Sequence[Optional[Callable]]] = None,
               donate_messages: bool = True, wrap: Optional[Callable] = None):
    J, stages = len(stages), list(stages)
    predictors = list(predictors or [None] * J)
    self._per_stage = [StageSteps(s, j, J, method, bn_stats, predictors[j], donate_messages,
                                  wrap) for j, s in enumerate(stages)]
    self._eval_all = jax.jit(functools.partial(eval_all_step, stages))
    self._backprop = jax.jit(functools.partial(backprop_step, stages), donate_argnums=0)

  def __getitem__(self, j: int) -> StageSteps:
    return self._per_stage[j]

  def __len__(self) -> int:
    return len(self._per_stage)

  def __iter__(self):
    return iter(self._per_stage)

  def evaluate_all(self, train_states: Sequence, x):
    """Every stage's forward with the running statistics, in one call (stages on one device)."""
    return self._eval_all(list(train_states), x)

  def backprop(self, train_states: list, images, labels):
    """``jax.grad`` of the composed model and every update: ``(new_states, loss)``."""
    return self._backprop(train_states, images, labels)
