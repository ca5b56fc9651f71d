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
  """``fn`` jitted for packed states too, through ``wrap`` if given."""
  fn = packing.on_packed(fn)
  return jax.jit(fn if wrap is None else wrap(fn), donate_argnums=donate_argnums)


class StageSteps:
  """Every stage's jitted steps: which backward a stage runs, on which arguments, donating which.

  Args:
    method: a :class:`petra_jax.engine.methods.Method` row.
    bn_stats: one of :data:`BN_POLICIES`.
    predictors: per stage, None or ``(params, opt_state) -> params``.
    wrap: applied to the steps before they are jitted.
  """

  def __init__(self, stages: Sequence[Stage], method, bn_stats: str,
               predictors: Optional[Sequence[Optional[Callable]]] = None,
               donate_messages: bool = True, wrap: Optional[Callable] = None):
    self.stages, self.method = list(stages), method
    self.donate_messages, self._wrap = donate_messages, wrap
    self._predictors = list(predictors or [None] * len(stages))
    self._predict = [None if p is None else _jit(functools.partial(predict_step, p), wrap=wrap)
                     for p in self._predictors]
    self._params, self._stats = _jit(params_step), _jit(stats_step, donate_argnums=0)
    self.num_stages = len(stages)
    self.stats_in_forward = bn_stats == "forward"
    self.reconstructs = [method.reconstructs_stage(s.reversible) for s in stages]
    self._forward = [_jit(functools.partial(forward_step, s), wrap=wrap) for s in stages]
    self._eval = [_jit(functools.partial(eval_step, s)) for s in stages]
    self._eval_all = jax.jit(functools.partial(eval_all_step, self.stages))
    self._backward = [_jit(self._backward_fn(j), donate_argnums=self._donated(j), wrap=wrap)
                      for j in range(self.num_stages)]
    self._fused = [self._fused_jit(j) for j in range(self.num_stages - 1)]
    self._backprop = jax.jit(functools.partial(backprop_step, self.stages), donate_argnums=0)

  def _fused_jit(self, j: int):
    fn = functools.partial(fused_step, functools.partial(forward_step, self.stages[j]),
                           self._backward_fn(j), self._predictors[j], self.stats_in_forward,
                           self.method.stashes_weights)
    donated = self._donated(j)
    donated = (0, 2, 3) if donated != 0 else 0
    return _jit(fn, donate_argnums=donated, wrap=self._wrap)

  def jit(self, fn: Callable, donate_argnums=()) -> Callable:
    """``fn(state, *args)`` jitted as every step is: on packed states too, through the
    pipeline's ``step_wrap``, donating ``donate_argnums`` (a schedule's own steps)."""
    return _jit(fn, donate_argnums, self._wrap)

  def _backward_fn(self, j: int, grads_only: bool = False):
    """Stage ``j``'s backward step (or its gradient only) on :meth:`backward_args`."""
    s, take = self.stages[j], not self.stats_in_forward
    if j == self.num_stages - 1:
      return functools.partial(loss_grads if grads_only else loss_step, s)
    if self.reconstructs[j]:
      return functools.partial(reverse_grads, s) if grads_only else functools.partial(
          reverse_backward_step, s, take)
    return functools.partial(recompute_grads, s, j > 0) if grads_only else functools.partial(
        recompute_backward_step, s, take, j > 0)

  def _donated(self, j: int):
    messages = self.donate_messages and self.reconstructs[j] and j < self.num_stages - 1
    return (0, 1, 2) if messages else 0

  def backward_args(self, j: int, *, x=None, y=None, dy=None, labels=None,
                    stashed=None) -> tuple:
    """``(x, labels)`` (last), ``(y, dy)`` (reconstructing) or ``(x, dy)``; + ``stashed``."""
    if j == self.num_stages - 1:
      return (x, labels)
    args = (y, dy) if self.reconstructs[j] else (x, dy)
    return args + (stashed,) if self.method.stashes_weights else args

  def backward(self, j: int, train_state: StageState, *args):
    """Stage ``j``'s backward (donating the state).

    Returns ``(state, x~, dx)`` reconstructing, ``(state, dx, loss)`` last, else ``(state, dx)``.
    """
    return self._backward[j](train_state, *args)

  def forward_backward(self, j: int, train_state: StageState, x, *args) -> tuple:
    """:func:`fused_step` of stage ``j``, donating ``train_state``."""
    return self._fused[j](train_state, x, *args)

  def gradient(self, j: int, train_state: StageState, *args) -> PyTree:
    """The gradient stage ``j``'s backward would apply, without applying it or donating."""
    if not hasattr(self, "_gradient"):
      self._gradient = [_jit(self._backward_fn(i, grads_only=True))
                        for i in range(self.num_stages)]
    out = self._gradient[j](train_state, *args)
    return out[2] if self.reconstructs[j] or j == self.num_stages - 1 else out[1]

  def forward_params(self, j: int, train_state: StageState):
    """The weights stage ``j``'s forward uses: predicted, or the current ones."""
    predicted = self.predicted_params(j, train_state)
    return train_state.params if predicted is None else predicted

  def predicted_params(self, j: int, train_state: StageState):
    """Stage ``j``'s predicted weights, or None without a predictor."""
    predict = self._predict[j]
    return None if predict is None else predict(train_state)

  def current_params(self, j: int, train_state: StageState):
    """A copy of stage ``j``'s current weights."""
    return self._params(train_state)

  def with_stats(self, j: int, train_state: StageState, batch_stats):
    """``train_state`` (donated, packed or not) with ``batch_stats``."""
    if isinstance(train_state, StageState):
      return train_state.replace(batch_stats=batch_stats)
    return self._stats(train_state, batch_stats)

  def forward(self, j: int, train_state: StageState, x, params=None):
    """Stage ``j``'s jitted forward: ``(y, batch_stats)``, at ``params`` if given."""
    if params is None:
      return self._forward[j](train_state, x)
    return self._forward[j](train_state, x, params)

  def jitted_steps(self, j: int) -> tuple:
    """Stage ``j``'s jitted ``(forward, backward)``."""
    return self._forward[j], self._backward[j]

  def evaluate_all(self, train_states: Sequence, x):
    """Every stage's forward with the running statistics, in one call (stages on one device)."""
    return self._eval_all(list(train_states), x)

  def evaluate(self, j: int, train_state: StageState, x):
    """Stage ``j``'s forward with the running BatchNorm statistics."""
    return self._eval[j](train_state, x)

  def backprop(self, train_states: list, images, labels):
    """``jax.grad`` of the composed model and every update: ``(new_states, loss)``."""
    return self._backprop(train_states, images, labels)


class OneStage:
  """Stage ``j``'s jitted steps of a :class:`StageSteps` (what its tasks call)."""

  def __init__(self, steps: StageSteps, j: int):
    self._steps, self._j = steps, j
    self.reconstructs = steps.reconstructs[j]
    self.stats_in_forward = steps.stats_in_forward

  def forward(self, train_state, x, params=None):
    """:meth:`StageSteps.forward`."""
    return self._steps.forward(self._j, train_state, x, params)

  def backward(self, train_state, *args):
    """:meth:`StageSteps.backward`."""
    return self._steps.backward(self._j, train_state, *args)

  def jit(self, fn: Callable, donate_argnums=()) -> Callable:
    """:meth:`StageSteps.jit`."""
    return self._steps.jit(fn, donate_argnums)

  def backward_args(self, **kwargs) -> tuple:
    """:meth:`StageSteps.backward_args`."""
    return self._steps.backward_args(self._j, **kwargs)

  def forward_backward(self, train_state, x, *args) -> tuple:
    """:meth:`StageSteps.forward_backward`."""
    return self._steps.forward_backward(self._j, train_state, x, *args)

  def predicted_params(self, train_state):
    """:meth:`StageSteps.predicted_params`."""
    return self._steps.predicted_params(self._j, train_state)

  def current_params(self, train_state):
    """:meth:`StageSteps.current_params`."""
    return self._steps.current_params(self._j, train_state)

  def with_stats(self, train_state, batch_stats):
    """:meth:`StageSteps.with_stats`."""
    return self._steps.with_stats(self._j, train_state, batch_stats)

  def backprop(self, train_states: list, images, labels):
    """:meth:`StageSteps.backprop` (every stage's update)."""
    return self._steps.backprop(train_states, images, labels)
