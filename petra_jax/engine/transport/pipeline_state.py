"""What the engine carries between ticks: stage states and messages in flight."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from petra_jax.engine.arrays import packing
from petra_jax.engine.transport.messages import Deferred
from petra_jax.engine.arrays import quantize as quantize_lib


class ScheduleError(RuntimeError):
  """A task ran before the message it consumes arrived (a broken schedule)."""


def _messages(where: str, routed: bool = False):
  return dataclasses.field(default_factory=list if where == "per_stage" else dict,
                           metadata={"messages": where, "routed": routed})


@dataclasses.dataclass
class PipelineState:
  """Everything the next tick depends on; create it with :meth:`empty`.

  Message fields hold ``{micro_batch: payload}``; metadata ``messages`` is
  ``per_stage`` (one dict per stage) or ``last_stage``.

  Attributes:
    stage_states: per stage a :class:`StageState`, a :class:`packing.PackedState`
      or None (another process's stage).
    grad_inbox: ``(y_j or None, delta_{j+1})`` each stage runs backward on.
    weight_stash: the forward's weights (or a method's per-micro-batch keep).
    origin: the micro-batch that key 0 of the boxes stands for: 0 on the host executor; inside
      a compiled period that needs it (:func:`absolute`), a traced int32 scalar.
  """
  stage_states: list
  tick: int = 0
  origin: Any = 0
  inbox: list = _messages("per_stage", routed=True)
  grad_inbox: list = _messages("per_stage", routed=True)
  buffers: list = _messages("per_stage")
  weight_stash: list = _messages("per_stage")
  labels: dict = _messages("last_stage")

  @classmethod
  def empty(cls, train_states: list, tick: int = 0) -> "PipelineState":
    """A state with no micro-batch in flight."""
    J = len(train_states)
    per_stage = {name: [{} for _ in range(J)] for name, each in _MESSAGE_BOXES if each}
    return cls(stage_states=list(train_states), tick=tick, **per_stage)

  def successor(self) -> "PipelineState":
    """The same contents in new containers (arrays shared)."""
    boxes = {name: [b.copy() for b in getattr(self, name)] if each
             else getattr(self, name).copy() for name, each in _MESSAGE_BOXES}
    return PipelineState(stage_states=list(self.stage_states), tick=self.tick,
                         origin=self.origin, **boxes)

  @property
  def train_states(self) -> list:
    """Per stage, its :class:`StageState` (unpacked into fresh arrays) or None."""
    return [packing.unpack(s) for s in self.stage_states]

  def block_until_ready(self) -> "PipelineState":
    """Waits until every array the state holds (stage states, messages) is computed; returns
    the state."""
    jax.block_until_ready([self.stage_states] + [getattr(self, n) for n, _ in _MESSAGE_BOXES])
    return self

  def in_flight(self) -> int:
    """Micro-batches fed whose backward has not reached stage 0 yet."""
    waiting = set(self.labels)
    for name, each in _MESSAGE_BOXES:
      if each:
        for box in getattr(self, name):
          waiting |= set(box)
    return len(waiting)

  def stored_bytes(self) -> list[int]:
    """Bytes each stage keeps in buffers and weight stashes."""
    return [quantize_lib.nbytes(list(b.values())) + quantize_lib.nbytes(list(w.values()))
            for b, w in zip(self.buffers, self.weight_stash)]


def absolute(state: PipelineState, m):
  """Micro-batch ``m``'s index in the run (``m`` is a key of ``state``'s boxes): what a
  per-micro-batch random key folds in, so that every executor draws the same numbers."""
  return state.origin + m


def period_origins(s: int, periods: int, shift: int, where) -> jax.Array:
  """``int32[periods]``: ``s + i * shift``, the :attr:`PipelineState.origin` of each of
  ``periods`` periods that move the keys by ``shift``, put on ``where`` (a device or sharding;
  one explicit transfer)."""
  return jax.device_put(s + shift * np.arange(periods, dtype=np.int32), where)


def message_fields() -> list[dataclasses.Field]:
  """The fields of :class:`PipelineState` that hold messages."""
  return [f for f in dataclasses.fields(PipelineState) if "messages" in f.metadata]


_MESSAGE_BOXES = tuple((f.name, f.metadata["messages"] == "per_stage") for f in message_fields())


def take(box: dict, m: int, what: str, j: int):
  """Pops micro-batch ``m``'s entry of ``box``.

  Raises:
    ScheduleError: no entry for ``m``, or a cross-process message of this tick.
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
