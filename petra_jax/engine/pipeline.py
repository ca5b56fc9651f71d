"""The engine: runs a schedule's tasks on stages placed on their own devices.

Each stage ``j`` lives on one device (``jax.device_put``) and owns a carried
:class:`StageState` (parameters, BatchNorm statistics, optax state with the
gradient accumulator). :meth:`Pipeline.run_tick` runs one tick of a
:class:`petra_jax.engine.schedule.Schedule`, one small function per task kind:

* ``forward`` (:meth:`Pipeline._forward_task`): ``x_{j+1} = F_j(x_j,
  theta_j^t)``, sent to stage ``j+1``; the input is kept if the stage buffers
  it, the weights if the method stashes them (:mod:`petra_jax.engine.methods`);
* ``backward`` (:meth:`Pipeline._backward_task`): a reconstructing stage
  rebuilds its input from its output with its *current* weights and takes
  the vjp there (paper Eq. 5); any other stage recomputes from its buffered
  input. Then the optax update; ``(x~_j, delta_j)`` goes to stage ``j-1``;
* ``loss`` (:meth:`Pipeline._loss_task`): the last stage's forward, loss and
  backward at once (Alg. 1, l. 27-30);
* ``backprop`` (:meth:`Pipeline._backprop_task`): ``jax.grad`` of the
  composed model on one device.

A task consumes a message sent on an earlier tick. A tick's forward and
backward at one stage both use ``theta_j^t`` (the forward comes first in the
table); the update follows. The jitted steps are compiled once per stage and
donate the carried state; nothing waits for the devices (losses stay device
arrays). Diagnostics (reconstruction error, gradient quality, the timeline)
are :class:`Observer`\\ s called around tasks; without observers the tick
runs no diagnostic code.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, NamedTuple, Optional, Sequence

import flax.struct
import jax
import jax.numpy as jnp
import optax

from petra_jax.engine import methods as methods_lib
from petra_jax.engine import quantize as quantize_lib
from petra_jax.engine import schedule as schedule_lib
from petra_jax.engine import transport
from petra_jax.engine.schedule import BACKPROP, BACKWARD, FORWARD, LOSS, Schedule, Task
from petra_jax.engine.stage import (Stage, composed_loss, forward, loss_vjp, recompute_vjp,
                             reverse_vjp, reverse_vjp_stashed, trace)

PyTree = Any
BN_POLICIES = ("backward", "forward")
_LOSS_SPEC = jax.ShapeDtypeStruct((), jnp.float32)
Batches = Callable[[int], tuple]  # micro-batch index -> (images [B,H,W,C], labels [B])


class ScheduleError(RuntimeError):
  """A task ran before the message it consumes arrived (a broken schedule)."""


class StageState(flax.struct.PyTreeNode):
  """Carried state of one stage (a Flax ``TrainState`` with BatchNorm statistics).

  Attributes:
    micro_batches: backward passes run at this stage (int32 scalar); with
      ``k`` accumulation steps the stage has made ``micro_batches // k``
      optimizer updates.
    params: the stage's parameters.
    batch_stats: BatchNorm running statistics.
    opt_state: the optax state: momentum and, for ``k > 1``, the
      ``optax.MultiSteps`` accumulator and counter.
    tx: the optax transformation (static).
  """
  micro_batches: jax.Array
  params: PyTree
  batch_stats: PyTree
  opt_state: optax.OptState
  tx: optax.GradientTransformation = flax.struct.field(pytree_node=False)

  @classmethod
  def create(cls, params, batch_stats, tx: optax.GradientTransformation) -> "StageState":
    return cls(micro_batches=jnp.zeros((), jnp.int32), params=params,
               batch_stats=batch_stats, opt_state=tx.init(params), tx=tx)

  def apply_gradients(self, grads, batch_stats) -> "StageState":
    """One optax step on ``grads``; ``batch_stats`` replaces the statistics."""
    updates, opt_state = self.tx.update(grads, self.opt_state, self.params)
    return self.replace(micro_batches=self.micro_batches + 1,
                        params=optax.apply_updates(self.params, updates),
                        opt_state=opt_state, batch_stats=batch_stats)


def _messages(where: str, routed: bool = False):
  return dataclasses.field(default_factory=list if where == "per_stage" else dict,
                           metadata={"messages": where, "routed": routed})


def _payload_code(kind: str, j: int) -> int:
  """``3 j + kind index``: one number per (stage, payload kind)."""
  return len(quantize_lib.KINDS) * j + quantize_lib.KINDS.index(kind)


def _payload_key(base: jax.Array, m, code) -> jax.Array:
  """``fold_in(fold_in(base, m), code)``: the stochastic-rounding key of one
  payload of micro-batch ``m`` (jittable; ``m`` and ``code`` may be traced)."""
  return jax.random.fold_in(jax.random.fold_in(base, m), code)


@dataclasses.dataclass
class PipelineState:
  """Everything the next tick depends on; create it with :meth:`empty`.

  Message fields hold ``{micro_batch: payload}`` and say where they live in
  their ``messages`` metadata (``per_stage``: a list of such dicts, one per
  stage, on that stage's device; ``last_stage``: one dict on the last
  stage's device); checkpoints save them by that metadata. In a
  multi-process run every process keeps every key of the ``routed`` fields
  (the messages every process routes: ``inbox``, ``grad_inbox``), with the
  payloads on the stage's owner only (None elsewhere); the other fields
  (``buffers``, ``weight_stash``, ``labels``) exist on the owner only.

  Attributes:
    train_states: per stage, its :class:`StageState` on its device (None for
      another process's stage).
    tick: ticks run so far.
    inbox: the input each stage runs forward (or ``loss``) on.
    grad_inbox: ``(y_j or None, delta_{j+1})`` each stage runs backward on
      (``y_j``, its output, only for a reconstructing stage).
    buffers: the inputs each stage kept for its backward.
    weight_stash: the parameters each stage's forward used (methods that
      stash weights).
    labels: labels in flight to the last stage.
  """
  train_states: list
  tick: int = 0
  inbox: list = _messages("per_stage", routed=True)
  grad_inbox: list = _messages("per_stage", routed=True)
  buffers: list = _messages("per_stage")
  weight_stash: list = _messages("per_stage")
  labels: dict = _messages("last_stage")

  @classmethod
  def empty(cls, train_states: list, tick: int = 0) -> "PipelineState":
    """A state with no micro-batch in flight."""
    J = len(train_states)
    per_stage = {f.name: [{} for _ in range(J)] for f in message_fields()
                 if f.metadata["messages"] == "per_stage"}
    return cls(train_states=list(train_states), tick=tick, **per_stage)

  def in_flight(self) -> int:
    """Micro-batches fed whose backward has not reached stage 0 yet."""
    waiting = set(self.labels)
    for f in message_fields():
      if f.metadata["messages"] == "per_stage":
        for box in getattr(self, f.name):
          waiting |= set(box)
    return len(waiting)

  def stored_bytes(self) -> list[int]:
    """Bytes each stage holds between forwards and backwards (input buffers
    and weight stashes; messages in flight excluded)."""
    def nbytes(box):
      return sum(x.nbytes for p in box.values() for x in jax.tree.leaves(p))
    return [nbytes(b) + nbytes(w) for b, w in zip(self.buffers, self.weight_stash)]


def message_fields() -> list[dataclasses.Field]:
  """The fields of :class:`PipelineState` that hold messages."""
  return [f for f in dataclasses.fields(PipelineState) if "messages" in f.metadata]


class TickOutput(NamedTuple):
  """The loss of one micro-batch (float32 scalar, still on its device)."""
  micro_batch: int
  loss: jax.Array


class TaskResult(NamedTuple):
  """What a task returns to the tick (and to observers).

  ``loss``: a ``loss``/``backprop`` task's float32 scalar; ``x_tilde``: the
  input a reconstructing ``backward`` rebuilt (paper Eq. 5).
  """
  loss: Optional[jax.Array] = None
  x_tilde: Optional[PyTree] = None


class Observer:
  """Diagnostics called around every task (all no-ops here; subclass).

  ``before_task`` runs before the task consumes its messages, ``after_task``
  after it sent its outputs; both may read ``state`` but must not change it.
  """

  def before_task(self, pipe: "Pipeline", state: PipelineState, task: Task) -> None:
    pass

  def after_task(self, pipe: "Pipeline", state: PipelineState, task: Task,
                 result: TaskResult) -> None:
    pass


# ----------------------------------------------------------------------------
# Jitted per-stage steps (module-level pure functions; one jit per stage).
# ----------------------------------------------------------------------------

def forward_step(stage: Stage, state: StageState, x, params=None):
  """``(y, batch_stats)``: the stage forward with ``theta_j^t`` (Eq. 5, row 1),
  or with ``params`` (e.g. weights predicted ahead by a delay compensation).
  ``x`` may be a quantised message (:mod:`petra_jax.engine.quantize`): it is
  dequantised first."""
  x = quantize_lib.dequantize(x)
  return forward(stage, state.params if params is None else params, state.batch_stats, x)


def reverse_grads(stage: Stage, state: StageState, y, dy, vjp_params=None):
  """Reconstruction and vjp of a reversible stage (Eq. 5, rows 2-4), no update.

  With ``vjp_params`` (stashed forward weights) the vjp is taken with them
  (Table 4's "approximate input"). ``y``, ``dy`` may be quantised messages.
  Returns ``(x~, dx, grads, batch_stats)``.
  """
  y, dy = quantize_lib.dequantize((y, dy))
  if vjp_params is None:
    return reverse_vjp(stage, state.params, state.batch_stats, y, dy)
  return reverse_vjp_stashed(stage, state.params, vjp_params, state.batch_stats, y, dy)


def recompute_grads(stage: Stage, input_grad: bool, state: StageState, x, dy, vjp_params=None):
  """Recomputation from the buffered input and vjp, no update; with
  ``vjp_params`` (``delayed``) at the stashed weights; ``x``, ``dy`` may be
  quantised. ``(dx, grads, stats)``."""
  x, dy = quantize_lib.dequantize((x, dy))
  params = state.params if vjp_params is None else vjp_params
  return recompute_vjp(stage, params, state.batch_stats, x, dy, input_grad=input_grad)


def loss_grads(stage: Stage, state: StageState, x, labels):
  """The last stage's forward, loss and backward: ``(loss, dx, grads, stats)``
  (``x`` may be a quantised message)."""
  x = quantize_lib.dequantize(x)
  return loss_vjp(stage, state.params, state.batch_stats, x, labels)


def _update(state: StageState, grads, new_stats, take_stats: bool) -> StageState:
  return state.apply_gradients(grads, new_stats if take_stats else state.batch_stats)


def reverse_backward_step(stage: Stage, take_stats: bool, state: StageState, y, dy,
                          vjp_params=None):
  """Reversible stage: reconstruct, vjp and update (Eq. 5, rows 2-5).
  Returns ``(new_state, x_tilde, dx)``."""
  x, dx, grads, stats = reverse_grads(stage, state, y, dy, vjp_params)
  return _update(state, grads, stats, take_stats), x, dx


def recompute_backward_step(stage: Stage, take_stats: bool, input_grad: bool,
                            state: StageState, x, dy, vjp_params=None):
  """Recompute, vjp and update. Returns ``(new_state, dx)`` (``dx`` None
  without ``input_grad``)."""
  dx, grads, stats = recompute_grads(stage, input_grad, state, x, dy, vjp_params)
  return _update(state, grads, stats, take_stats), dx


def loss_step(stage: Stage, state: StageState, x, labels):
  """Last stage: forward, loss, backward and update. ``(new_state, dx, loss)``."""
  loss, dx, grads, stats = loss_grads(stage, state, x, labels)
  return _update(state, grads, stats, True), dx, loss


def eval_step(stage: Stage, state: StageState, x):
  """Stage forward with the running BatchNorm statistics (evaluation)."""
  return forward(stage, state.params, state.batch_stats, x, train=False)[0]


def backprop_step(stages: Sequence[Stage], states: Sequence[StageState], images, labels):
  """Exact synchronous backprop: ``jax.grad`` of the composed model.

  Running statistics are updated by the (only) forward pass.
  Returns ``(new_states, loss)``.
  """
  (loss, new_stats), grads = jax.value_and_grad(
      lambda p: composed_loss(stages, p, [s.batch_stats for s in states], images, labels),
      has_aux=True)([s.params for s in states])
  return [_update(s, g, n, True) for s, g, n in zip(states, grads, new_stats)], loss


def relative_error(x_tilde, x) -> jax.Array:
  """``||x~ - x|| / ||x||`` over all leaves (float32 scalar), in float32;
  quantised inputs are dequantised first."""
  x_tilde, x = jax.tree.map(lambda a: a.astype(jnp.float32),
                            quantize_lib.dequantize((x_tilde, x)))
  num = sum(jnp.sum((a - b) ** 2) for a, b in zip(jax.tree.leaves(x_tilde), jax.tree.leaves(x)))
  den = sum(jnp.sum(b ** 2) for b in jax.tree.leaves(x))
  return jnp.sqrt(num / den)


def assign_devices(num_stages: int, devices: Sequence[jax.Device]) -> list:
  """Contiguous blocks of stages per device: stage ``j`` -> ``devices[j*n//J]``."""
  n = len(devices)
  return [devices[j * n // num_stages] for j in range(num_stages)]


def _take(box: dict, m: int, what: str, j: int):
  """Pops micro-batch ``m``'s entry of ``box``; ScheduleError if absent."""
  try:
    return box.pop(m)
  except KeyError:
    raise ScheduleError(f"stage {j} has no {what} for micro-batch {m}: the schedule runs "
                        "a task before the message it consumes was sent.") from None


class StageSteps:
  """Every stage's jitted steps, and the rule of what a backward takes.

  The one place that says which step a stage's backward runs (reconstruct,
  recompute or the loss), which arguments it takes and which it donates.
  The engine, :mod:`petra_jax.engine.timing`, the memory benchmark and the gradient
  probe all call stages through it. Each step is compiled once per stage.

  Args:
    stages: the model's stages.
    method: the method (what it stashes, whether it reconstructs).
    bn_stats: ``"backward"`` or ``"forward"`` (see :class:`Pipeline`).
    predictors: per stage, None or ``(params, opt_state) -> params``: the
      weights its forward uses instead of the current ones (weight
      prediction, :mod:`petra_jax.optim.compensation`). Backwards always use the
      current weights (a reconstructing stage rebuilds its input with them,
      Eq. 5) or, for methods that stash weights, the ones the forward used.
    donate_messages: whether a reconstructing backward donates its ``(y,
      dy)`` (useless when they arrive quantised: int8 or 16-bit buffers
      cannot hold the float32 results).
  """

  def __init__(self, stages: Sequence[Stage], method: methods_lib.Method, bn_stats: str,
               predictors: Optional[Sequence[Optional[Callable]]] = None,
               donate_messages: bool = True):
    self.stages, self.method = list(stages), method
    self.donate_messages = donate_messages
    self._predict = [None if p is None else jax.jit(p)
                     for p in (predictors or [None] * len(stages))]
    self.num_stages = len(stages)
    self.stats_in_forward = bn_stats == "forward"
    # Stage j rebuilds its input from its output (otherwise it buffers it).
    self.reconstructs = [s.reversible and method.reconstructs for s in stages]
    self._forward = [jax.jit(functools.partial(forward_step, s)) for s in stages]
    self._eval = [jax.jit(functools.partial(eval_step, s)) for s in stages]
    self._backward = [jax.jit(self._backward_fn(j), donate_argnums=self._donated(j))
                      for j in range(self.num_stages)]
    self._backprop = jax.jit(functools.partial(backprop_step, self.stages), donate_argnums=0)

  def _backward_fn(self, j: int, grads_only: bool = False):
    """Stage ``j``'s backward step (or, with ``grads_only``, its gradient
    without the update), on the arguments :meth:`backward_args` gives."""
    s, take = self.stages[j], not self.stats_in_forward
    if j == self.num_stages - 1:
      return functools.partial(loss_grads if grads_only else loss_step, s)
    if self.reconstructs[j]:
      return functools.partial(reverse_grads, s) if grads_only else functools.partial(
          reverse_backward_step, s, take)
    return functools.partial(recompute_grads, s, j > 0) if grads_only else functools.partial(
        recompute_backward_step, s, take, j > 0)

  def _donated(self, j: int):
    """A reconstructing backward donates its state and ``(y, dy)``; the
    others their state (a buffered input may be a probe's too)."""
    messages = self.donate_messages and self.reconstructs[j] and j < self.num_stages - 1
    return (0, 1, 2) if messages else 0

  def backward_args(self, j: int, *, x=None, y=None, dy=None, labels=None,
                    stashed=None) -> tuple:
    """The arguments of stage ``j``'s backward after its state.

    Args:
      j: the stage.
      x: its input (buffered); y: its output (a reconstructing stage rebuilds
        ``x`` from it); dy: the output's cotangent; labels: ``int32[B]``
        (last stage); stashed: the forward's weights (methods that stash).

    Returns:
      ``(x, labels)`` for the last stage, ``(y, dy)`` for a reconstructing
      stage, ``(x, dy)`` otherwise; plus ``stashed`` when the method stashes
      weights.
    """
    if j == self.num_stages - 1:
      return (x, labels)
    args = (y, dy) if self.reconstructs[j] else (x, dy)
    return args + (stashed,) if self.method.stashes_weights else args

  def backward(self, j: int, train_state: StageState, *args):
    """Runs stage ``j``'s jitted backward step (donating ``train_state``).

    Returns ``(new_state, x~, dx)`` for a reconstructing stage, ``(new_state,
    dx, loss)`` for the last one, ``(new_state, dx)`` otherwise.
    """
    return self._backward[j](train_state, *args)

  def gradient(self, j: int, train_state: StageState, *args) -> PyTree:
    """The gradient stage ``j``'s backward would apply, without applying it
    or donating anything (a separate jit, compiled on first use)."""
    if not hasattr(self, "_gradient"):
      self._gradient = [jax.jit(self._backward_fn(i, grads_only=True))
                        for i in range(self.num_stages)]
    out = self._gradient[j](train_state, *args)
    return out[2] if self.reconstructs[j] or j == self.num_stages - 1 else out[1]

  def forward_params(self, j: int, train_state: StageState):
    """The weights stage ``j``'s forward uses: predicted, or the current ones."""
    predict = self._predict[j]
    if predict is None:
      return train_state.params
    return predict(train_state.params, train_state.opt_state)

  def forward(self, j: int, train_state: StageState, x, params=None):
    """Stage ``j``'s jitted forward: ``(y, batch_stats)``, with ``params``
    if given (see :meth:`forward_params`), else the current weights."""
    if params is None:
      return self._forward[j](train_state, x)
    return self._forward[j](train_state, x, params)

  def jitted_steps(self, j: int) -> tuple:
    """Stage ``j``'s jitted ``(forward, backward)`` (e.g. to ``.lower()``
    them for XLA's memory analysis); arguments as :meth:`forward` and
    :meth:`backward`."""
    return self._forward[j], self._backward[j]

  def evaluate(self, j: int, train_state: StageState, x):
    """Stage ``j``'s forward with the running BatchNorm statistics."""
    return self._eval[j](train_state, x)

  def backprop(self, train_states: list, images, labels):
    """``jax.grad`` of the composed model and every stage's update
    (donating ``train_states``): ``(new_states, loss)``."""
    return self._backprop(train_states, images, labels)


# ----------------------------------------------------------------------------
# The engine.
# ----------------------------------------------------------------------------

class Pipeline:
  """A method's stages on their devices, and the tasks of its schedule.

  Args:
    stages: the model's stages (at least 2; the last one computes the loss).
    tx: the optax optimizer of every stage, or one per stage (e.g. a delay
      compensation that depends on ``tau_j``); states are per stage.
    devices: devices to spread the stages over in contiguous blocks (default:
      all local devices). Fewer devices than stages is fine; ``backprop``
      needs one.
    method: a name in :data:`petra_jax.engine.methods.METHODS`; ``"petra"`` is
      paper Eq. 5.
    accumulation_steps: ``k``, micro-batches per update (the round of the
      ``gpipe``/``1f1b`` schedules; ``tx`` accumulates them).
    bn_stats: ``"backward"`` (paper, Sec. 4: running statistics updated by the
      backward recomputation/reconstruction, never by the forward) or
      ``"forward"`` (the authors' code: updated by the forward).
    observers: :class:`Observer`\\ s called around every task (diagnostics).
    predictors: per stage, the weights its forward uses (see
      :class:`StageSteps`); default: the current ones.
    formats: the format of forward messages, backward messages and input
      buffers (:class:`petra_jax.engine.quantize.MessageFormats`); default: all
      float, as computed.

  Attributes:
    steps: the stages' jitted steps and backward rule (:class:`StageSteps`).
    devices: each stage's device; local: whether this process runs it.

  Raises:
    ValueError: fewer than 2 stages, a reversible first or last stage, an
      unknown ``bn_stats`` policy or method, a reconstructing method on a
      model without reversible stages, or ``backprop`` on several devices.
  """

  def __init__(self, stages: Sequence[Stage], tx, devices: Optional[Sequence[jax.Device]] = None,
               *, method: str = "petra", accumulation_steps: int = 1,
               bn_stats: str = "backward", observers: Sequence[Observer] = (),
               predictors: Optional[Sequence[Optional[Callable]]] = None,
               formats: Optional[quantize_lib.MessageFormats] = None):
    self.method = methods_lib.get(method)
    _check(stages, self.method, bn_stats)
    self.stages = list(stages)
    self.num_stages = J = len(stages)
    self.accumulation_steps = accumulation_steps
    # (an optax GradientTransformation is itself a tuple: test for one first)
    self.txs = [tx] * J if hasattr(tx, "update") else list(tx)
    if len(self.txs) != J:
      raise ValueError(f"{len(self.txs)} optimizers for {J} stages: give one, or one per stage.")
    self.devices = assign_devices(J, devices or jax.local_devices())
    if not self.method.pipelined and len(set(self.devices)) > 1:
      raise ValueError("backprop runs on one device: build the Pipeline with devices=[d].")
    # Multi-process (jax.distributed): this process runs only the stages on
    # its own devices; messages to or from the others go through transport.
    self.local = [transport.is_local(d) for d in self.devices]
    self.multiprocess = not all(self.local)
    self.formats = formats or quantize_lib.MessageFormats()
    self.steps = StageSteps(stages, self.method, bn_stats, predictors,
                            donate_messages=self.formats.backward == "none")
    self.reconstructs = self.steps.reconstructs
    self.observers = list(observers)
    self._spec_cache: dict = {}
    self._specs = [None] * (J + 1)  # message shapes; set by init()
    self._copy = jax.jit(lambda x: jax.tree.map(jnp.copy, x))
    self._encoders = {kind: jax.jit(functools.partial(self.formats.encode, kind))
                      for kind in quantize_lib.KINDS}
    # stochastic int8: the payload's key is derived inside the same jit
    self._stochastic_encoders = {
        kind: jax.jit(lambda x, base, m, code, kind=kind: self.formats.encode(
            kind, x, _payload_key(base, m, code))) for kind in quantize_lib.KINDS}
    self._message_key = jax.random.key(2)  # set from the seed by init()
    self._encoded_specs: dict = {}
    self._tasks = {FORWARD: self._forward_task, BACKWARD: self._backward_task,
                   LOSS: self._loss_task, BACKPROP: self._backprop_task}
    self._run_task = self._run_observed if self.observers else self._run_plain

  # -- where the data enters and the loss leaves ------------------------------

  @property
  def input_device(self) -> jax.Device:
    """Stage 0's device: where images are fed."""
    return self.devices[0]

  @property
  def output_device(self) -> jax.Device:
    """The last stage's device: where labels go and logits come out."""
    return self.devices[-1]

  @property
  def owns_input(self) -> bool:
    """Whether this process runs stage 0 (and so reads images)."""
    return self.local[0]

  @property
  def owns_output(self) -> bool:
    """Whether this process runs the last stage (labels, logits, losses)."""
    return self.local[-1]

  # -- set-up ----------------------------------------------------------------

  def init(self, seed: int, sample_input: jax.Array) -> PipelineState:
    """Initialises every stage on its device.

    All stages are initialised by one jitted function, with the ``"rbg"``
    PRNG (on CPU its compilation is about 3x faster than threefry's). In a
    multi-process run only this process's stages are initialised (to the
    same values as in one process); the others' entries are None.

    Args:
      seed: integer seed; stage ``j`` draws from ``fold_in(key(seed), j)``.
      sample_input: a model input ``float32[B, H, W, C]`` (only its shape and
        dtype matter).
    """
    one = jax.ShapeDtypeStruct((1, *sample_input.shape[1:]), sample_input.dtype)
    inputs = [one] + [out for _, out in trace(self.stages, one)[:-1]]

    def init_all(key):
      states = []
      for j, (stage, x) in enumerate(zip(self.stages, inputs)):
        if not self.local[j]:  # another process's stage
          states.append(None)
          continue
        zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), x)
        v = stage.init(jax.random.fold_in(key, j), zeros)
        states.append(StageState.create(v["params"], v["batch_stats"], self.txs[j]))
      return states

    states = jax.jit(init_all)(jax.random.key(seed, impl="rbg"))
    self._message_key = jax.random.key(seed + 2)
    states = [transport.send(s, d) if s is not None else None
              for s, d in zip(states, self.devices)]
    if self.multiprocess:
      self._specs = self._specs_for(sample_input)
    return PipelineState.empty(states)

  def schedule(self, num_micro_batches: int) -> Schedule:
    """This method's tick table over ``num_micro_batches`` micro-batches."""
    return Schedule(self.method.schedule, self.num_stages, num_micro_batches,
                    self.accumulation_steps)

  # -- running a schedule ------------------------------------------------------

  def run_tick(self, state: PipelineState, tick: schedule_lib.Tick,
               batches: Optional[Batches] = None) -> tuple[PipelineState, list[TickOutput]]:
    """Runs one tick's tasks in order.

    Args:
      state: the pipeline state; updated in place and returned.
      tick: the tasks (a row of :meth:`schedule`).
      batches: ``m -> (images float32[B, H, W, C], labels int32[B])``, called
        for the micro-batch stage 0 takes on this tick. Multi-process: images
        may be None on processes that do not own stage 0.

    Returns:
      ``(state, outputs)``: the losses of the micro-batches whose ``loss``
      (or ``backprop``) task ran. Multi-process: the loss is on stage 0's
      device on process 0, None on the others.

    Raises:
      ScheduleError: a task's input has not arrived.
    """
    outputs = []
    for task in tick:
      result = self._run_task(state, task, batches)
      if result.loss is not None or (task.kind == LOSS and self.multiprocess):
        outputs.append(TickOutput(task.micro_batch, result.loss))
    state.tick += 1
    return state, outputs

  def run(self, state: PipelineState, ticks, batches: Batches):
    """Runs every tick of ``ticks``; returns ``(state, outputs)``."""
    outputs = []
    for tick in ticks:
      state, out = self.run_tick(state, tick, batches)
      outputs += out
    return state, outputs

  def revprop_step(self, state: PipelineState, images, labels):
    """One micro-batch with every delay 0: this method's stage steps on the
    ``drained`` table (for ``petra``: synchronous reversible backprop;
    exact gradients for every method). Returns ``(state, loss)``.

    Raises:
      RuntimeError: micro-batches are already in flight.
    """
    if state.in_flight():
      raise RuntimeError("revprop_step needs an empty pipeline: finish the schedule first.")
    state, outs = self.run(state, Schedule("drained", self.num_stages, 1),
                           lambda m: (images, labels))
    return state, outs[0].loss

  def _run_plain(self, state, task, batches) -> TaskResult:
    return self._tasks[task.kind](state, task, batches)

  def _run_observed(self, state, task, batches) -> TaskResult:
    for obs in self.observers:
      obs.before_task(self, state, task)
    result = self._tasks[task.kind](state, task, batches)
    for obs in self.observers:
      obs.after_task(self, state, task, result)
    return result

  # -- one function per task kind ----------------------------------------------

  def _feed(self, state: PipelineState, m: int, batches: Batches):
    """Micro-batch ``m``'s images to stage 0, its labels to the last stage."""
    images, labels = batches(m)
    state.inbox[0][m] = transport.send(images, self.devices[0]) if self.local[0] else None
    if self.local[-1]:
      state.labels[m] = transport.send(labels, self.devices[-1])

  def _forward_task(self, state: PipelineState, task: Task, batches) -> TaskResult:
    j, m = task.stage, task.micro_batch
    if j == 0:
      self._feed(state, m, batches)
    x, y = _take(state.inbox[j], m, "input", j), None
    if self.local[j]:
      st = state.train_states[j]
      params = self.steps.forward_params(j, st)
      y, stats = self.steps.forward(j, st, x, None if params is st.params else params)
      if self.steps.stats_in_forward:
        state.train_states[j] = st.replace(batch_stats=stats)
      if self.method.stashes_weights:  # copied: the backward donates the live ones
        state.weight_stash[j][m] = self._copy(params)
      if not self.reconstructs[j]:
        state.buffers[j][m] = self._encode("buffer", x, j, m)
      y = self._encode("forward", y, j, m)
    state.inbox[j + 1][m] = self._move(y, j, j + 1, self._spec("forward", j + 1))
    return TaskResult()

  def _backward_task(self, state: PipelineState, task: Task, batches) -> TaskResult:
    del batches
    j, m = task.stage, task.micro_batch
    message = _take(state.grad_inbox[j], m, "cotangent", j)
    x_tilde = x = None
    if self.local[j]:
      y, dy = message
      if not self.reconstructs[j]:
        x = _take(state.buffers[j], m, "buffered input", j)
      stashed = (_take(state.weight_stash[j], m, "stashed weights", j)
                 if self.method.stashes_weights else None)
      args = self.steps.backward_args(j, x=x, y=y, dy=dy, stashed=stashed)
      if self.reconstructs[j]:
        state.train_states[j], x_tilde, dx = self.steps.backward(j, state.train_states[j], *args)
        x = x_tilde
      else:
        state.train_states[j], dx = self.steps.backward(j, state.train_states[j], *args)
    else:
      dx = None
    if j > 0:
      state.grad_inbox[j - 1][m] = self._send_back(j, m, x, dx)
    return TaskResult(x_tilde=x_tilde)

  def _loss_task(self, state: PipelineState, task: Task, batches) -> TaskResult:
    del batches
    j, m = task.stage, task.micro_batch
    x, loss, dx = _take(state.inbox[j], m, "input", j), None, None
    if self.local[j]:
      labels = _take(state.labels, m, "labels", j)
      state.train_states[j], dx, loss = self.steps.backward(j, state.train_states[j], x, labels)
    state.grad_inbox[j - 1][m] = self._send_back(j, m, x, dx)
    if self.multiprocess:  # metrics are written by process 0
      loss = self._move(loss, j, 0, _LOSS_SPEC)
    return TaskResult(loss=loss)

  def _backprop_task(self, state: PipelineState, task: Task, batches) -> TaskResult:
    m = task.micro_batch
    self._feed(state, m, batches)
    images = _take(state.inbox[0], m, "input", 0)
    labels = _take(state.labels, m, "labels", 0)
    state.train_states, loss = self.steps.backprop(state.train_states, images, labels)
    return TaskResult(loss=loss)

  # -- evaluation ------------------------------------------------------------

  def predict(self, state: PipelineState, images) -> Optional[jax.Array]:
    """Logits ``float32[B, K]`` with the current weights and running statistics.

    Args:
      images: ``float32[B, H, W, C]``. Multi-process: on processes that do
        not own stage 0, anything with its shape and dtype (e.g. a
        ``jax.ShapeDtypeStruct``); every process must call ``predict``.

    Returns:
      The logits on the last stage's device; None on processes that do not
      own the last stage.
    """
    J = self.num_stages
    specs = self._specs_for(images) if self.multiprocess else [None] * (J + 1)
    x = transport.send(images, self.devices[0]) if self.local[0] else None
    for j in range(J):
      if j > 0:
        x = self._move(x, j - 1, j, specs[j])
      if self.local[j]:
        x = self.steps.evaluate(j, state.train_states[j], x)
    return x if self.local[-1] else None

  # -- messages ----------------------------------------------------------------

  def _send_back(self, j: int, m: int, x, dx):
    """``(y_{j-1} or None, delta_j)`` of micro-batch ``m`` to stage ``j-1``:
    its output (this stage's input ``x``, reconstructed or buffered) only if
    it reconstructs."""
    payload = self._encode("backward", (x if self.reconstructs[j - 1] else None, dx), j, m)
    spec = (self._spec("backward", j) if self.reconstructs[j - 1] else None,
            self._spec("backward", j))
    return self._move(payload, j, j - 1, spec)

  def _encode(self, kind: str, x, j: int, m: int):
    """Payload ``x`` of stage ``j``, micro-batch ``m``, in the format of
    ``kind`` (forward, backward or buffer; :class:`petra_jax.engine.quantize.MessageFormats`),
    on its device; ``x`` itself when nothing is quantised (and for a
    ``"none"`` buffer). Stochastic int8 draws from :meth:`message_key`."""
    if (x is None or not self.formats.active or not self.local[j]
        or (kind == "buffer" and self.formats.buffer == "none")):
      return x
    if self.formats.stochastic_for(kind):
      return self._stochastic_encoders[kind](x, self._message_key, m, _payload_code(kind, j))
    return self._encoders[kind](x, None)

  def message_key(self, kind: str, j: int, m: int) -> jax.Array:
    """The PRNG key of the ``kind`` payload stage ``j`` sends or keeps for
    micro-batch ``m`` (stochastic int8): ``fold_in(fold_in(key(seed + 2), m),
    3 j + kind index)``, a function of the run's seed and the schedule only."""
    return _payload_key(self._message_key, m, _payload_code(kind, j))

  def _spec(self, kind: str, j: int):
    """Shapes of stage ``j``'s input as a ``kind`` message (multi-process
    receivers allocate them); None in a single-process run."""
    if self._specs[j] is None or not self.formats.active:
      return self._specs[j]
    if (kind, j) not in self._encoded_specs:
      self._encoded_specs[(kind, j)] = self.formats.spec(kind, self._specs[j])
    return self._encoded_specs[(kind, j)]

  def _move(self, x, src: int, dst: int, spec):
    """Payload ``x`` from stage ``src``'s device to stage ``dst``'s.

    Within this process ``transport.send``; across processes
    ``transport.transfer`` (``spec``: ``x``'s shapes, for the receiver).
    Every process calls it for every message, in the schedule's order.
    Returns the payload on ``dst``'s device, or None if ``dst`` is another
    process's (or neither stage is this process's: nothing is run).
    """
    if self.local[src] and self.local[dst]:
      return transport.send(x, self.devices[dst])
    if not (self.local[src] or self.local[dst]):
      return None
    x = transport.transfer(x, self.devices[src], self.devices[dst], spec)
    return x if self.local[dst] else None

  def _specs_for(self, x) -> list:
    """Shapes of the messages for a stage-0 input shaped like ``x``: ``J + 1``
    pytrees of ``jax.ShapeDtypeStruct`` (each stage's input, then the logits)."""
    key = (tuple(x.shape), jnp.dtype(x.dtype))
    if key not in self._spec_cache:
      spec = jax.ShapeDtypeStruct(x.shape, x.dtype)
      self._spec_cache[key] = [spec] + [out for _, out in trace(self.stages, spec)]
    return self._spec_cache[key]

  def message_specs(self, sample_input) -> list:
    """Public :meth:`_specs_for`: each stage's input shapes, then the logits'."""
    return self._specs_for(sample_input)


def _check(stages: Sequence[Stage], method: methods_lib.Method, bn_stats: str) -> None:
  """The constructor's argument checks (see :class:`Pipeline`)."""
  if len(stages) < 2:
    raise ValueError(f"PETRA needs at least 2 stages, got {len(stages)}.")
  if stages[0].reversible or stages[-1].reversible:
    raise ValueError("the first stage (input) and the last (loss) cannot be reversible.")
  if bn_stats not in BN_POLICIES:
    raise ValueError(f"Unknown bn_stats policy {bn_stats!r}; choose one of {BN_POLICIES}.")
  if method.needs_reversible and not any(b.reversible for s in stages for b in (s.blocks or (s,))):
    others = [n for n, m in methods_lib.METHODS.items() if not m.needs_reversible]
    raise ValueError(f"method {method.name!r} reconstructs inputs and needs reversible stages; "
                     f"this model has none: use one of {others}.")
