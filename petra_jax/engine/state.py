"""What the engine carries between ticks, and what a tick hands back.

* :class:`StageState`: one stage's parameters, BatchNorm statistics and optax
  state (a Flax ``TrainState``);
* :class:`PipelineState`: every stage's state plus the messages in flight,
  the buffered inputs and stashed weights (what the next tick depends on,
  and what a checkpoint saves, by :func:`message_fields`);
* :class:`TickOutput`, :class:`TaskResult`: a tick's losses, a task's result;
* :class:`Observer`: the interface of diagnostics called around tasks
  (:mod:`petra_jax.engine.observers`);
* :func:`copy_tree`: the one jitted copy of a pytree (inputs that a
  donating step would otherwise consume);
* :func:`take`: pops a message, or says which one the schedule lacks.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, NamedTuple, Optional

import flax.struct
import jax
import jax.numpy as jnp
import optax

from petra_jax.engine import packing
from petra_jax.engine import quantize as quantize_lib
from petra_jax.engine.schedule import Task

if TYPE_CHECKING:
  from petra_jax.engine.pipeline import Pipeline

PyTree = Any


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

  Stage states: ``stage_states`` holds each stage's state as the engine
  last left it, a :class:`StageState` or, in a pipeline that packs them
  (:attr:`petra_jax.engine.pipeline.Pipeline.packs`), the same packed
  (:class:`petra_jax.engine.packing.PackedState`, what its hot-path steps
  take and return, :meth:`packed`). Everything else reads and writes
  :attr:`train_states`: always :class:`StageState`\\ s (packed ones are
  unpacked in place on reading, and packed again by the next hot-path step
  that needs them).

  Attributes:
    stage_states: per stage, its state on its device, packed or not (None
      for another process's stage).
    tick: ticks run so far.
    inbox: the input each stage runs forward (or ``loss``) on.
    grad_inbox: ``(y_j or None, delta_{j+1})`` each stage runs backward on
      (``y_j``, its output, only for a reconstructing stage).
    buffers: the inputs each stage kept for its backward.
    weight_stash: the parameters each stage's forward used (methods that
      stash weights).
    labels: labels in flight to the last stage.
  """
  stage_states: list
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
    return cls(stage_states=list(train_states), tick=tick, **per_stage)

  def successor(self) -> "PipelineState":
    """A new state with the same contents in new containers (lists and
    dicts; the arrays are shared): what a tick fills, leaving ``self``'s
    containers as they were."""
    boxes = {name: [b.copy() for b in getattr(self, name)] if per_stage
             else getattr(self, name).copy() for name, per_stage in _MESSAGE_BOXES}
    return PipelineState(stage_states=list(self.stage_states), tick=self.tick, **boxes)

  @property
  def train_states(self) -> list:
    """Per stage, its :class:`StageState` on its device (None for another
    process's stage); a packed one is unpacked in place first (one jitted
    call, off the hot path). The list itself: assigning ``train_states[j]``
    sets stage ``j``'s state."""
    slots = self.stage_states
    for j, s in enumerate(slots):
      if isinstance(s, packing.PackedState):
        slots[j] = packing.unpack(s)
    return slots

  @train_states.setter
  def train_states(self, states: list) -> None:
    self.stage_states = states

  def packed(self, j: int):
    """Stage ``j``'s state packed (packed in place first if it is not; a
    state that cannot be packed, or whose packing would not pay,
    :func:`petra_jax.engine.packing.pack`, is returned as it is): what a
    pipeline that packs passes its hot-path steps."""
    s = self.stage_states[j]
    if not isinstance(s, packing.PackedState):
      s = self.stage_states[j] = packing.pack(s)
    return s

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
    return [quantize_lib.nbytes(list(b.values())) + quantize_lib.nbytes(list(w.values()))
            for b, w in zip(self.buffers, self.weight_stash)]


def message_fields() -> list[dataclasses.Field]:
  """The fields of :class:`PipelineState` that hold messages."""
  return [f for f in dataclasses.fields(PipelineState) if "messages" in f.metadata]


# (name, whether per stage) of every message field: read on every tick.
_MESSAGE_BOXES = tuple((f.name, f.metadata["messages"] == "per_stage") for f in message_fields())


class Deferred:
  """A message from another process that arrives at the end of its tick.

  Multi-process ticks dispatch every local computation first and the
  cross-process transfers after (:meth:`petra_jax.engine.messages.Messenger.flush`),
  so a process never waits for a message it does not need yet. Until then
  the receiving box holds this placeholder; :func:`resolve` swaps in the
  payload (``value``) when the tick ends.
  """
  __slots__ = ("args", "value")

  def __init__(self, args: tuple):
    self.args, self.value = args, None


def resolve(boxes) -> None:
  """Replaces every :class:`Deferred` in the per-stage ``boxes`` (lists of
  ``{micro-batch: payload}``) by its transferred payload."""
  for box in boxes:
    for m, v in box.items():
      if isinstance(v, Deferred):
        box[m] = v.value


def take(box: dict, m: int, what: str, j: int):
  """Pops micro-batch ``m``'s entry of ``box`` (stage ``j``'s ``what``).

  Raises:
    ScheduleError: ``box`` has no entry for ``m``, or only a cross-process
      message of the current tick (not transferred yet).
  """
  try:
    v = box.pop(m)
  except KeyError:
    raise ScheduleError(f"stage {j} has no {what} for micro-batch {m}: the schedule runs "
                        "a task before the message it consumes was sent.") from None
  if isinstance(v, Deferred):
    raise ScheduleError(f"stage {j}'s {what} for micro-batch {m} comes from another process "
                        "on this very tick: a schedule's tasks consume messages of earlier "
                        "ticks only.")
  return v


@jax.jit
def copy_tree(tree: PyTree) -> PyTree:
  """A fresh copy of every array of ``tree``, on the same devices (what a
  donating step may consume while the original is still needed)."""
  return jax.tree.map(jnp.copy, tree)


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
