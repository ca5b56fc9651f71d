"""The training methods: what each stage keeps and which schedule it runs.

Paper Table 4, between a micro-batch's forward and backward (a non-reversible
stage always keeps its input): backprop is ``jax.grad``; revprop has no delay;
petra reconstructs with current weights; approximate_input also stashes weights;
dsp keeps inputs; delayed inputs and weights; gpipe, 1f1b and zb_h1 (zero bubble)
keep inputs, exact, flushed every update. :data:`LOCAL_METHODS` send no gradient back.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Mapping

from petra_jax.engine.methods import forward_gradient_tasks, local_learning, tasks, zero_bubble
from petra_jax.engine.methods.context import Keeps
from petra_jax.engine.schedules import (Drained, ForwardOnly, GPipe, OneFOneB, Sequential, Stream,
                                        TaskKind, TickTable, ZeroBubbleH1)

# Task builders ``StageContext -> task`` per task kind.
BACKWARD_TASKS = {TaskKind.FORWARD: tasks.forward_task, TaskKind.BACKWARD: tasks.backward_task,
                  TaskKind.LOSS: tasks.loss_task, TaskKind.BACKPROP: tasks.backprop_task}
LOCAL_TASKS = {TaskKind.FORWARD: local_learning.forward_task, TaskKind.LOSS: local_learning.loss_task}
FORWARD_GRADIENT_TASKS = {TaskKind.FORWARD: forward_gradient_tasks.forward_task,
                          TaskKind.BACKWARD: forward_gradient_tasks.backward_task,
                          TaskKind.LOSS: forward_gradient_tasks.loss_task}


@dataclasses.dataclass(frozen=True)
class Method:
  """One method: its ``schedule`` family, whether it stashes weights or ``reconstructs`` (Eq. 5).

  ``updates``: ``"backward"`` (cotangents travel back), ``"local"`` or
  ``"forward_gradient"``; ``probed``: whether the gradient-quality probe
  (paper App. B) can observe it (one whole vjp per stage and micro-batch);
  ``tasks``: per task kind, its builder ``StageContext -> task``.
  """
  name: str
  schedule: type[TickTable]
  stashes_weights: bool
  reconstructs: bool
  updates: str = "backward"
  probed: bool = True
  tasks: Mapping[str, Callable] = dataclasses.field(default_factory=lambda: BACKWARD_TASKS,
                                                    compare=False)

  @property
  def delayed(self) -> bool:
    """Whether gradients arrive ``tau_j > 0`` ticks after their forward."""
    return self.schedule.delayed

  @property
  def pipelined(self) -> bool:
    """Whether the method runs stage by stage (not ``jax.grad`` of the model)."""
    return self.schedule.pipelined

  def reconstructs_stage(self, reversible: bool) -> bool:
    """Whether a stage rebuilds its input in the backward (Eq. 5)."""
    return reversible and self.reconstructs


def keeps(method: Method, reversible: bool, perturb: str = "activity",
          emulate: bool = False) -> Keeps:
  """What a stage keeps between its forward and its backward."""
  if method.updates == "local":
    return Keeps(False, False)
  if method.updates == "forward_gradient":
    return Keeps(perturb == "activity" or emulate, True)
  return Keeps(not method.reconstructs_stage(reversible), method.stashes_weights)


METHODS: dict[str, Method] = {m.name: m for m in (
    Method("backprop", Sequential, stashes_weights=False, reconstructs=False, probed=False),
    Method("revprop", Drained, stashes_weights=False, reconstructs=True),
    Method("petra", Stream, stashes_weights=False, reconstructs=True),
    Method("approximate_input", Stream, stashes_weights=True, reconstructs=True),
    Method("dsp", Stream, stashes_weights=False, reconstructs=False),
    Method("delayed", Stream, stashes_weights=True, reconstructs=False),
    Method("gpipe", GPipe, stashes_weights=False, reconstructs=False),
    Method("1f1b", OneFOneB, stashes_weights=False, reconstructs=False),
    Method("zb_h1", ZeroBubbleH1, stashes_weights=False, reconstructs=False, probed=False,
           tasks=zero_bubble.TASKS),
)}
DELAYED = tuple(name for name, m in METHODS.items() if m.delayed)
LOCAL_METHODS: dict[str, Method] = {m.name: m for m in (
    Method("local", ForwardOnly, stashes_weights=False, reconstructs=False, updates="local",
           probed=False, tasks=LOCAL_TASKS),
    Method("forward_gradient", Stream, stashes_weights=False, reconstructs=False,
           updates="forward_gradient", probed=False, tasks=FORWARD_GRADIENT_TASKS),
)}
ALL_METHODS: dict[str, Method] = {**METHODS, **LOCAL_METHODS}


def require_reversible(method: str, model: str, has_reversible: bool) -> None:
  """Stops a method that reconstructs inputs on a model with no reversible stage.

  Raises:
    ValueError: ``method`` reconstructs and ``has_reversible`` is false.
  """
  if get(method).reconstructs and not has_reversible:
    others = [n for n, m in ALL_METHODS.items() if not m.reconstructs]
    raise ValueError(f"method {method!r} reconstructs inputs and needs a reversible model, "
                     f"and {model!r} has no reversible stage: use one of {others}, or a RevNet.")


def get(name: str) -> Method:
  """The method called ``name``.

  Raises:
    ValueError: unknown name.
  """
  if name not in ALL_METHODS:
    raise ValueError(f"Unknown method {name!r}; choose one of {tuple(ALL_METHODS)}.")
  return ALL_METHODS[name]
