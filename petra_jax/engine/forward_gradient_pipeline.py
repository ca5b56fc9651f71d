"""Method ``forward_gradient`` in the pipeline (the ``stream`` table).

Per micro-batch ``m`` (functions of :mod:`petra_jax.engine.forward_gradient`):

* ``forward`` of stage ``j < J-1`` (tick ``m + j``), with ``theta_j^t``:
  the guess ``v_j``; the forward, pushing the ``j`` tangents received from
  stages ``0..j-1`` and starting its own (``weights``: ``J_theta F_j v_j``;
  ``activity``: ``v_j``); ``(y, labels, tangents [j + 1, B, ...])`` to
  ``j+1``. It keeps ``(v_j, head gradient)`` in ``weight_stash`` and, for
  ``activity``, its input in ``buffers``.
* ``loss`` (tick ``m + J - 1``): the last stage's forward, loss and update;
  ``s = float32[J-1, B]``, each sample's loss derivative along each tangent,
  goes back to ``J-2``.
* ``backward`` of stage ``j`` (tick ``m + 2(J-1) - j``): takes row ``j`` of
  the scalars, updates along ``g~_j`` (plus the head on its own gradient)
  and passes rows ``0..j-1`` back.

Delays: stage ``j``'s guess is taken with ``theta_j^{t - tau_j}`` and applied
when its scalars return, ``tau_j = 2(J-1-j)`` ticks later
(:func:`petra_jax.engine.schedule.delay`, as PETRA); the ``activity``
update's vjp runs with the current weights at the buffered input (as
``dsp``). The configured delay compensation applies to every stage's
optimizer as for the other stream methods. BatchNorm running statistics
come from the forward (the only evaluation of a stage's real loss path).

Cost of the tangents: stage ``j`` receives ``j`` tangents, each the size
of its input activation, and sends ``j + 1``: the forward message is
``(j + 2)`` activations (plus labels), a stage runs its forward's linear map
``j + 1`` times (one :func:`jax.linearize`, the primal once), and the
heaviest stage carries ``J - 1``. That is the bound chosen: one tangent per
upstream stage, never per parameter or per sample; with ``J = 4`` stages a
message is at most 4 activations. Backward, stage ``j+1`` sends ``(j + 1) B``
float32 scalars: at most ``4 (J-1) B`` bytes per tick.

``emulate=True``: no tangents; the last stage sends ``dL/dx`` back as
``dsp`` does, each stage recomputes its vjp at the buffered input, takes
its scalars from the exact gradient (:func:`forward_gradient.emulated_scalars`)
and sends ``dL/dx_j`` on.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax

from petra_jax.engine import forward_gradient as fg
from petra_jax.engine import local
from petra_jax.engine.pipeline import Pipeline
from petra_jax.engine.schedule import BACKPROP, BACKWARD, FORWARD, LOSS
from petra_jax.engine.stage import forward
from petra_jax.engine.state import PipelineState, StageState, TaskResult, take
from petra_jax.models import auxiliary

_NOTHING = TaskResult()


def fg_forward(stage, guess_kind, perturb, emulate, state: StageState, x, labels, tangents, key):
  """Stage forward with its guess and tangents (see the module docstring).

  Returns:
    ``(new_state, y, tangents_out, guess, head_grads)``: ``new_state`` with
    this forward's BatchNorm statistics; ``tangents_out`` None when
    emulating.
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
  """``emulate=True``: scalars from the exact gradient, the update, and
  ``dL/dx`` for the previous stage: ``(new_state, dx)``."""
  scalars, dx = fg.emulated_scalars(stage, state.params, state.batch_stats, x, dy, guess,
                                    perturb)
  return fg_update(stage, perturb, eps, projection, state, scalars, guess, head, x), dx


def last_scalars(stage, state: StageState, x, labels, tangents):
  """The last stage's ``float32[J-1, B]`` scalars."""
  return fg.loss_scalars(stage, state.params, state.batch_stats, x, labels, tangents)


class ForwardGradientPipeline(Pipeline):
  """The ``forward_gradient`` method (arguments as :class:`Pipeline`, plus
  the options of ``config.forward_gradient`` and the run's ``seed``, from
  which the random guesses draw: ``fold_in(fold_in(key(seed + 3), m), j)``).

  Raises:
    ValueError: bad options (:func:`forward_gradient.check_options`), a
      local guess on a stage without a head, quantised messages, or several
      processes.
  """
  UPDATES = ("forward_gradient",)
  FUSES = False  # its own tasks (_plan)

  def __init__(self, *args, guess: str = "local", perturb: str = "activity",
               emulate: bool = False, eps: float = 1e-16, seed: int = 0,
               projection: str = "batch", **kwargs):
    fg.check_options(guess, perturb, emulate, eps, projection)
    self.guess, self.perturb, self.emulate, self.eps = guess, perturb, emulate, eps
    self.projection = projection
    self._key = jax.random.key(seed + 3)
    super().__init__(*args, **kwargs)

  def _plan(self) -> dict:
    J = self.num_stages
    local.require_local_setup(self)
    if self.guess == "local" and not all(auxiliary.has_head(s) for s in self.stages[:-1]):
      raise ValueError("forward_gradient.guess='local' needs an auxiliary head on every stage "
                       "but the last: build the stages with petra_jax.models.auxiliary.with_heads.")
    options = (self.guess, self.perturb, self.emulate)
    update = fg_emulated_update if self.emulate else fg_update
    self._fg_forward = [jax.jit(functools.partial(fg_forward, s, *options), donate_argnums=0)
                        for s in self.stages[:-1]]
    self._fg_update = [jax.jit(functools.partial(update, s, self.perturb, self.eps,
                                                 self.projection),
                               donate_argnums=0) for s in self.stages[:-1]]
    self._scalars = jax.jit(functools.partial(last_scalars, self.stages[-1]))
    return {FORWARD: [self._fg_forward_task(j) for j in range(J - 1)],
            BACKWARD: [self._fg_backward_task(j) for j in range(J - 1)],
            LOSS: [None] * (J - 1) + [self._fg_loss_task(J - 1)],
            BACKPROP: [None]}

  @property
  def keeps_input(self) -> bool:
    """Whether a stage buffers its input (``activity``, or emulating)."""
    return self.perturb == "activity" or self.emulate

  def _fg_forward_task(self, j: int) -> Callable:
    send = self.messages.route("forward", j, j + 1)

    def task(state: PipelineState, m: int, batches) -> TaskResult:
      x, labels, *rest = local.inputs_with_labels(self, state, j, m, batches)
      tangents = rest[0] if rest else None
      key = jax.random.fold_in(jax.random.fold_in(self._key, m), j)
      if self.keeps_input:  # (the forward donates its state only)
        state.buffers[j][m] = x
      state.train_states[j], y, out, guess, head = self._fg_forward[j](
          state.train_states[j], x, labels, tangents, key)
      state.weight_stash[j][m] = (guess, head)
      state.inbox[j + 1][m] = send((y, labels, out), m)
      return _NOTHING
    return task

  def _fg_loss_task(self, j: int) -> Callable:
    send = self.messages.route("backward", j, j - 1)

    def task(state: PipelineState, m: int, batches) -> TaskResult:
      x, _, tangents = take(state.inbox[j], m, "input", j)
      labels = take(state.labels, m, "labels", j)
      back = None if self.emulate else self._scalars(state.train_states[j], x, labels, tangents)
      state.train_states[j], dx, loss = self.steps.backward(j, state.train_states[j], x, labels)
      state.grad_inbox[j - 1][m] = send(dx if self.emulate else back, m)
      return TaskResult(loss=loss)
    return task

  def _fg_backward_task(self, j: int) -> Callable:
    send = None if j == 0 else self.messages.route("backward", j, j - 1)

    def task(state: PipelineState, m: int, batches) -> TaskResult:
      message = take(state.grad_inbox[j], m, "scalars", j)
      guess, head = take(state.weight_stash[j], m, "guess", j)
      x = take(state.buffers[j], m, "buffered input", j) if self.keeps_input else None
      st = state.train_states[j]
      if self.emulate:
        state.train_states[j], back = self._fg_update[j](st, message, guess, head, x)
      else:
        state.train_states[j] = self._fg_update[j](st, message[j], guess, head, x)
        back = message[:j]
      if send is not None:
        state.grad_inbox[j - 1][m] = send(back, m)
      return _NOTHING
    return task


def backward_bytes_per_tick(num_stages: int, micro_batch: int) -> int:
  """Bytes the busiest backward link carries per tick: ``4 (J-1) B``
  (float32 scalars of every upstream stage, sent by the last stage)."""
  return 4 * (num_stages - 1) * micro_batch

