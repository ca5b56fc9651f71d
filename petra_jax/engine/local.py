"""Method ``local``: decoupled greedy learning in the pipeline (DGL).

Belilovsky, Eickenberg, Oyallon, "Decoupled Greedy Learning of CNNs" (ICML
2020). Each stage ``j < J-1`` carries an auxiliary head
(:mod:`petra_jax.models.auxiliary`) and updates on the gradient of its own
auxiliary loss ``L_j(h_j(F_j(x_j, theta_j)), labels)`` with respect to
``(theta_j, head_j)``; its output ``x_{j+1}``, computed with ``theta_j^t``
before the update, goes forward detached. The last stage trains on the real
loss with the gradient of its own parameters only (its input's gradient is
dropped). Nothing travels backward, and no stage waits on another's
gradient: every update has delay 0.

The schedule is the ``forward`` table (:mod:`petra_jax.engine.schedule`):
the stream without backward tasks; stage ``j`` runs micro-batch ``m`` on
tick ``m + j``. The labels ride with each forward message (stage ``j``'s
head needs them): ``(y, labels int32[B])``. Nothing is buffered between
ticks (stored bytes 0), and BatchNorm running statistics come from the one
(forward) evaluation.

This module also holds :func:`pipeline_for`, the one place the training
assembly asks which pipeline class, stages and options a method runs with.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax

from petra_jax.engine import quantize as quantize_lib
from petra_jax.engine.pipeline import Pipeline
from petra_jax.engine.schedule import BACKPROP, BACKWARD, FORWARD, LOSS
from petra_jax.engine.stage import forward
from petra_jax.engine.state import PipelineState, StageState, TaskResult, take
from petra_jax.models import auxiliary

_NOTHING = TaskResult()


def local_grads(stage, state: StageState, x, labels):
  """Stage forward and the gradient of its auxiliary loss.

  Args:
    stage: an :class:`petra_jax.models.auxiliary.AuxStage`.
    state: its state (``params`` holds the head under ``AUX_KEY``).
    x: its input activation (may be a quantised message); labels: ``int32[B]``.

  Returns:
    ``(y, aux_loss, grads, batch_stats)``: the output with the current
    weights, the float32 auxiliary loss, its gradient with respect to every
    parameter of the stage and head (a pytree like ``state.params``), and
    the running statistics of this forward.
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


class LocalPipeline(Pipeline):
  """The ``local`` method's stages and tasks (arguments as :class:`Pipeline`).

  Raises:
    ValueError: besides :class:`Pipeline`'s, a stage before the last without
      an auxiliary head, quantised messages, or several processes.
  """
  UPDATES = ("local",)
  FUSES = False  # its own tasks (_plan)

  def _plan(self) -> dict:
    J = self.num_stages
    require_local_setup(self)
    for s in self.stages[:-1]:
      if not auxiliary.has_head(s):
        raise ValueError(f"method {self.method.name!r}: stage {s.name!r} has no auxiliary head; "
                         "build the stages with petra_jax.models.auxiliary.with_heads.")
    self._local = [jax.jit(functools.partial(local_step, s), donate_argnums=0)
                   for s in self.stages[:-1]]
    return {FORWARD: [self._local_task(j) for j in range(J - 1)],
            BACKWARD: [None] * (J - 1),
            LOSS: [None] * (J - 1) + [self._last_task(J - 1)],
            BACKPROP: [None]}

  def _local_task(self, j: int) -> Callable:
    """Stage ``j``'s forward, auxiliary loss and update; ``(y, labels)`` to ``j+1``."""
    send = self.messages.route("forward", j, j + 1)

    def task(state: PipelineState, m: int, batches) -> TaskResult:
      x, labels = inputs_with_labels(self, state, j, m, batches)
      state.train_states[j], y, _ = self._local[j](state.train_states[j], x, labels)
      state.inbox[j + 1][m] = send((y, labels), m)
      return _NOTHING
    return task

  def _last_task(self, j: int) -> Callable:
    """The last stage's forward, loss and update; nothing is sent back."""
    def task(state: PipelineState, m: int, batches) -> TaskResult:
      x, _ = take(state.inbox[j], m, "input", j)
      labels = take(state.labels, m, "labels", j)
      state.train_states[j], _, loss = self.steps.backward(j, state.train_states[j], x, labels)
      return TaskResult(loss=loss)
    return task


def require_local_setup(pipe: Pipeline) -> None:
  """Stops what the local methods do not support: quantised messages (the
  labels ride with them) and several processes.

  Raises:
    ValueError: naming the setting to change.
  """
  if pipe.formats.active:
    raise ValueError(f"method {pipe.method.name!r} sends labels and tangents with its forward "
                     "messages and does not quantise them: use --config.quantize.*=none.")
  if pipe.multiprocess:
    raise ValueError(f"method {pipe.method.name!r} runs in one process: launch it without "
                     "jax.distributed.")


def inputs_with_labels(pipe: Pipeline, state: PipelineState, j: int, m: int, batches):
  """Stage ``j``'s ``(input, labels)`` for micro-batch ``m``: stage 0 feeds
  the micro-batch and reads its labels (they stay in ``state.labels`` for
  the last stage); a later stage takes its forward message ``(x, labels,
  ...)``. Returns the message's elements (``x, labels, *rest``)."""
  if j == 0:
    pipe._feed(state, m, batches)  # pylint: disable=protected-access
    labels = jax.device_put(state.labels[m], pipe.devices[0])
    return (take(state.inbox[0], m, "input", 0), labels)
  return take(state.inbox[j], m, "input", j)


def pipeline_for(config, stages, num_classes: int):
  """The pipeline class, stages and extra options of ``config.method``.

  Returns:
    ``(cls, stages, kwargs)``: :class:`Pipeline` and ``stages`` unchanged
    for the end-to-end methods; for ``local`` and ``forward_gradient`` with a
    local guess, the stages with auxiliary heads (``config.auxiliary``); for
    ``forward_gradient``, its options (``config.forward_gradient``).
  """
  name = config.method
  if name not in ("local", "forward_gradient"):
    return Pipeline, stages, {}
  fg = config.forward_gradient
  if name == "local" or fg.guess == "local":
    stages = auxiliary.with_heads(stages, config.auxiliary.head, num_classes,
                                  config.auxiliary.hidden)
  if name == "local":
    return LocalPipeline, stages, {}
  from petra_jax.engine import forward_gradient_pipeline  # pylint: disable=g-import-not-at-top
  options = dict(guess=fg.guess, perturb=fg.perturb, emulate=fg.emulate, eps=fg.eps,
                 projection=fg.projection, seed=config.seed)
  return forward_gradient_pipeline.ForwardGradientPipeline, stages, options
