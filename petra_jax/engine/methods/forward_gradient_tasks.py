"""Method ``forward_gradient``'s tasks on the ``stream`` table (math: :mod:`forward_gradient`).

``forward`` of stage ``j``: guess ``v_j``, push tangents, send
``(y, labels, tangents [j + 1, B, ...])``. ``loss``: scalars
``float32[J-1, B]`` back. ``backward`` of ``j``: update from row ``j``, rows
``0..j-1`` back. ``emulate=True`` sends ``dL/dx`` back instead.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax

from petra_jax.engine.methods import forward_gradient as fg
from petra_jax.engine.methods import local_learning
from petra_jax.engine.transport.pipeline_state import PipelineState, absolute, take
from petra_jax.engine.stages.stage import forward
from petra_jax.engine.stages.stage_state import StageState
from petra_jax.engine.methods.context import StageContext
from petra_jax.engine.methods.tasks import NOTHING, TaskResult


def fg_forward(stage, guess_kind, perturb, emulate, state: StageState, x, labels, tangents, key):
  """Stage forward with its guess and tangents.

  Returns ``(new_state, y, tangents_out or None, guess, head_grads)``.
  """
  p, bs = state.params, state.batch_stats
  if guess_kind == "local":
    guess, head = fg.local_guess(stage, p, bs, x, labels, perturb)
  else:
    head = None
    like = (fg.block_params(p) if perturb == "weights"
            else jax.eval_shape(lambda: forward(stage, p, bs, x)[0]))
    guess = fg.random_guess(key, like)
  param_tangent = guess if perturb == "weights" and not emulate else None
  y, stats, pushed, own = fg.push(stage, p, bs, x, None if emulate else tangents, param_tangent)
  out = None
  if not emulate:
    out = fg.stack(pushed, own if perturb == "weights" else guess)
  return state.replace(batch_stats=stats), y, out, guess, head


def fg_update(stage, perturb, eps, projection, state: StageState, scalars, guess, head, x):
  """Stage ``j``'s update along ``g~_j`` from its scalars ``float32[B]``."""
  grads = fg.estimate(stage, state.params, state.batch_stats, x, guess, scalars, perturb, eps,
                      projection)
  return state.apply_gradients(fg.with_head(grads, state.params, head), state.batch_stats)


def fg_emulated_update(stage, perturb, eps, projection, state: StageState, dy, guess, head, x):
  """``emulate=True``: the update from the exact gradient: ``(new_state, dx)``."""
  scalars, dx = fg.emulated_scalars(stage, state.params, state.batch_stats, x, dy, guess,
                                    perturb)
  return fg_update(stage, perturb, eps, projection, state, scalars, guess, head, x), dx


def last_scalars(stage, state: StageState, x, labels, tangents):
  """The last stage's ``float32[J-1, B]`` scalars."""
  return fg.loss_scalars(stage, state.params, state.batch_stats, x, labels, tangents)


def forward_task(ctx: StageContext) -> Callable:
  """Stage ``j``'s guess and forward; ``(y, labels, tangents)`` to ``j+1``."""
  j, o, send, keeps_input = ctx.j, ctx.options, ctx.send, ctx.keeps.input
  step = jax.jit(functools.partial(fg_forward, ctx.stage, o.guess, o.perturb, o.emulate),
                 donate_argnums=0, inline=True)
  base = jax.random.key(o.seed + 3)

  def task(state: PipelineState, m: int, batches) -> TaskResult:
    x, labels, *rest = local_learning.inputs_with_labels(ctx, state, m, batches)
    tangents = rest[0] if rest else None
    key = jax.random.fold_in(jax.random.fold_in(base, absolute(state, m)), j)
    if keeps_input:
      state.buffers[j][m] = x
    state.stage_states[j], y, out, guess, head = step(state.stage_states[j], x, labels,
                                                      tangents, key)
    state.weight_stash[j][m] = (guess, head)
    state.inbox[j + 1][m] = send((y, labels, out), m)
    return NOTHING
  return task


def loss_task(ctx: StageContext) -> Callable:
  """The last stage's update; its scalars (or ``dL/dx``) to ``j-1``."""
  j, steps, send, emulate = ctx.j, ctx.steps, ctx.route_back, ctx.options.emulate
  scalars = jax.jit(functools.partial(last_scalars, ctx.stage), inline=True)

  def task(state: PipelineState, m: int, batches) -> TaskResult:
    x, _, tangents = take(state.inbox[j], m, "input", j)
    labels = take(state.labels, m, "labels", j)
    back = None if emulate else scalars(state.stage_states[j], x, labels, tangents)
    state.stage_states[j], dx, loss = steps.backward(state.stage_states[j], x, labels)
    state.grad_inbox[j - 1][m] = send(dx if emulate else back, m)
    return TaskResult(loss=loss)
  return task


def backward_task(ctx: StageContext) -> Callable:
  """Stage ``j``'s update from its row of scalars; the earlier rows to ``j-1``."""
  j, o, send, keeps_input = ctx.j, ctx.options, ctx.route_back, ctx.keeps.input
  update = fg_emulated_update if o.emulate else fg_update
  step = jax.jit(functools.partial(update, ctx.stage, o.perturb, o.eps, o.projection),
                 donate_argnums=0, inline=True)

  def task(state: PipelineState, m: int, batches) -> TaskResult:
    message = take(state.grad_inbox[j], m, "scalars", j)
    guess, head = take(state.weight_stash[j], m, "guess", j)
    x = take(state.buffers[j], m, "buffered input", j) if keeps_input else None
    st = state.stage_states[j]
    if o.emulate:
      state.stage_states[j], back = step(st, message, guess, head, x)
    else:
      state.stage_states[j] = step(st, message[j], guess, head, x)
      back = message[:j]
    if send is not None:
      state.grad_inbox[j - 1][m] = send(back, m)
    return NOTHING
  return task
