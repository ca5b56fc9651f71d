"""Method ``local``'s tasks: decoupled greedy learning (Belilovsky et al., ICML 2020).

Stage ``j < J-1`` updates ``(theta_j, head_j)`` on its auxiliary loss and
sends ``(y, labels int32[B])`` forward; the last stage trains on the real
loss. Nothing travels backward.
"""

from __future__ import annotations

import functools
from typing import Callable, Sequence

import jax

from petra_jax.engine.methods import auxiliary
from petra_jax.engine.arrays import quantize as quantize_lib
from petra_jax.engine.transport.pipeline_state import PipelineState, take
from petra_jax.engine.stages.stage import forward
from petra_jax.engine.stages.stage_state import StageState
from petra_jax.engine.methods.context import StageContext
from petra_jax.engine.methods.tasks import NOTHING, TaskResult


def local_grads(stage, state: StageState, x, labels):
  """Stage forward and the gradient of its auxiliary loss (``labels int32[B]``).

  Returns:
    ``(y, aux_loss float32, grads like state.params, batch_stats)``.
  """
  x = quantize_lib.dequantize(x)

  def loss_fn(params):
    y, stats = forward(stage, params, state.batch_stats, x)
    return auxiliary.aux_loss(stage, params, y, labels), (y, stats)

  (loss, (y, stats)), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
  return y, loss, grads, stats


def local_step(stage, state: StageState, x, labels):
  """:func:`local_grads` and the update: ``(new_state, y, aux_loss)``."""
  y, loss, grads, stats = local_grads(stage, state, x, labels)
  return state.apply_gradients(grads, stats), y, loss


def check_transport(name: str, quantized: Sequence[str], multiprocess: bool) -> None:
  """The local methods' rule (``local``, ``forward_gradient``): their messages travel
  unquantised, in one process. ``quantized``: the quantised payload kinds
  (:attr:`petra_jax.engine.arrays.quantize.MessageFormats.quantized`).

  Raises:
    ValueError: naming the flags that lift it.
  """
  if quantized:
    flags = " ".join(f"--config.quantize.{k}=none" for k in quantized)
    raise ValueError(f"method {name!r} does not support quantised messages (labels and "
                     f"tangents travel unquantised): pass {flags}.")
  if multiprocess:
    raise ValueError(f"method {name!r} runs in one process: launch it without "
                     "launch/*.sh or jax.distributed.")


def check_setup(method, stages: Sequence, quantized: Sequence[str], multiprocess: bool,
                guess: str) -> None:
  """Raises ValueError for quantised messages, several processes (:func:`check_transport`),
  or a missing head.

  ``method``: a :class:`petra_jax.engine.methods.Method` row that sends no
  cotangent; ``guess``: the forward-gradient guess (its heads are needed for ``"local"``).
  """
  name = method.name
  check_transport(name, quantized, multiprocess)
  if method.updates == "forward_gradient":
    if guess == "local" and not all(auxiliary.has_head(s) for s in stages[:-1]):
      raise ValueError("forward_gradient.guess='local' needs an auxiliary head on every stage "
                       "but the last: build the stages with petra_jax.models.auxiliary.with_heads.")
    return
  for s in stages[:-1]:
    if not auxiliary.has_head(s):
      raise ValueError(f"method {name!r}: stage {s.name!r} has no auxiliary head; build the "
                       "stages with petra_jax.models.auxiliary.with_heads.")


def inputs_with_labels(ctx: StageContext, state: PipelineState, m: int, batches):
  """Stage ``j``'s forward message ``(x, labels, *rest)``; stage 0 feeds it."""
  j = ctx.j
  if ctx.feed is not None:
    ctx.feed(state, m, batches)
    labels = jax.device_put(state.labels[m], ctx.device)
    return (take(state.inbox[0], m, "input", 0), labels)
  return take(state.inbox[j], m, "input", j)


def forward_task(ctx: StageContext) -> Callable:
  """Stage ``j``'s forward, auxiliary loss and update; ``(y, labels)`` to ``j+1``."""
  j, send = ctx.j, ctx.send
  step = jax.jit(functools.partial(local_step, ctx.stage), donate_argnums=0, inline=True)

  def task(state: PipelineState, m: int, batches) -> TaskResult:
    x, labels = inputs_with_labels(ctx, state, m, batches)
    state.stage_states[j], y, _ = step(state.stage_states[j], x, labels)
    state.inbox[j + 1][m] = send((y, labels), m)
    return NOTHING
  return task


def loss_task(ctx: StageContext) -> Callable:
  """The last stage's forward, loss and update; nothing is sent back."""
  j, steps = ctx.j, ctx.steps

  def task(state: PipelineState, m: int, batches) -> TaskResult:
    x, _ = take(state.inbox[j], m, "input", j)
    labels = take(state.labels, m, "labels", j)
    state.stage_states[j], _, loss = steps.backward(state.stage_states[j], x, labels)
    return TaskResult(loss=loss)
  return task
