"""The training methods: what each stage keeps and which schedule it runs.

One :class:`Method` record per ``config.method``; the engine, the memory
model, the benchmarks, the studies and the config validation all read
:data:`METHODS`. Between a micro-batch's forward and its backward
(paper Table 4; the last stage keeps nothing, a non-reversible stage always
keeps its input):

============== ========== ============ ============= ==================================
method         schedule   input buffer weight stash  reversible stages
============== ========== ============ ============= ==================================
backprop       sequential (whole graph) no           ``jax.grad`` of the composed model
revprop        drained    no           no            reconstruct; every delay 0
petra          stream     no           no            reconstruct with current weights
approximate_   stream     no           yes           reconstruct (current), vjp with
input                                                the stashed weights
dsp            stream     yes          no            current weights (Xu et al., 2020)
delayed        stream     yes          yes           stashed weights (PipeDream)
gpipe          gpipe      yes          no            exact; flushed every update
1f1b           1f1b       yes          no            exact; flushed every update
============== ========== ============ ============= ==================================

Local methods (:data:`LOCAL_METHODS`; no backward message carries a
gradient, so they are kept apart from :data:`METHODS`, the end-to-end ones
every backward-message test and benchmark iterates):

================ ========== ===================================================
method           schedule   what a stage updates on
================ ========== ===================================================
local            forward    its auxiliary loss (DGL, Belilovsky et al., 2020);
                            forward messages only, no delay
forward_gradient stream     its guess scaled by the directional derivative of
                            the loss along it, returned as scalars
                            (Fournier et al., 2023;
                            :mod:`petra_jax.engine.forward_gradient`)
================ ========== ===================================================

``gpipe`` and ``1f1b`` store every stage's input, as GPipe with
re-materialisation and PipeDream-Flush do, rather than reconstruct: their
gradients are then exact (no reconstruction round-off, so their losses equal
``backprop``'s), and the memory benchmark compares PETRA with the schedules as
pipeline libraries ship them.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple


class Keeps(NamedTuple):
  """What a stage holds between a micro-batch's forward and its backward."""
  input: bool
  weights: bool


@dataclasses.dataclass(frozen=True)
class Method:
  """One row of the tables above.

  Attributes:
    name: the ``config.method`` value.
    schedule: a kind of :class:`petra_jax.engine.schedule.Schedule`.
    stashes_weights: every stage keeps the weights its forward used.
    reconstructs: reversible stages rebuild their input from their output
      with their current weights (paper Eq. 5).
    updates: the task plan: ``"backward"`` (gradients carried back),
      ``"local"`` (auxiliary losses) or ``"forward_gradient"`` (guesses
      scaled by scalars sent back).
  """
  name: str
  schedule: str
  stashes_weights: bool
  reconstructs: bool
  updates: str = "backward"

  @property
  def delayed(self) -> bool:
    """Whether gradients arrive ``tau_j > 0`` ticks after their forward."""
    return self.schedule == "stream"

  @property
  def pipelined(self) -> bool:
    """Whether the method runs stage by stage (not ``jax.grad`` of the model)."""
    return self.schedule != "sequential"

  def reconstructs_stage(self, reversible: bool) -> bool:
    """Whether a stage rebuilds its input in the backward (Eq. 5)."""
    return reversible and self.reconstructs


def keeps(method: Method, reversible: bool, perturb: str = "activity",
          emulate: bool = False) -> Keeps:
  """What a stage keeps between forward and backward: the one rule the engine,
  the memory model and the studies read.

  Args:
    method: the method.
    reversible: whether the stage is reversible.
    perturb, emulate: ``forward_gradient``'s options (its ``activity``
      update, or emulation, runs a vjp at the kept input).
  """
  if method.updates == "local":
    return Keeps(False, False)
  if method.updates == "forward_gradient":
    return Keeps(perturb == "activity" or emulate, True)
  return Keeps(not method.reconstructs_stage(reversible), method.stashes_weights)


METHODS: dict[str, Method] = {m.name: m for m in (
    Method("backprop", "sequential", stashes_weights=False, reconstructs=False),
    Method("revprop", "drained", stashes_weights=False, reconstructs=True),
    Method("petra", "stream", stashes_weights=False, reconstructs=True),
    Method("approximate_input", "stream", stashes_weights=True, reconstructs=True),
    Method("dsp", "stream", stashes_weights=False, reconstructs=False),
    Method("delayed", "stream", stashes_weights=True, reconstructs=False),
    Method("gpipe", "gpipe", stashes_weights=False, reconstructs=False),
    Method("1f1b", "1f1b", stashes_weights=False, reconstructs=False),
)}
DELAYED = tuple(name for name, m in METHODS.items() if m.delayed)
LOCAL_METHODS: dict[str, Method] = {m.name: m for m in (
    Method("local", "forward", stashes_weights=False, reconstructs=False, updates="local"),
    Method("forward_gradient", "stream", stashes_weights=False, reconstructs=False,
           updates="forward_gradient"),
)}
ALL_METHODS: dict[str, Method] = {**METHODS, **LOCAL_METHODS}


def require_reversible(method: str, model: str, has_reversible: bool) -> None:
  """Stops a method that reconstructs inputs on a model with no reversible stage.

  Args:
    method: the ``config.method`` name.
    model: the model's name, for the message.
    has_reversible: whether any of the model's blocks is reversible.

  Raises:
    ValueError: ``method`` needs a reversible model and ``has_reversible`` is
      false; the message lists the methods the model supports.
  """
  if get(method).reconstructs and not has_reversible:
    others = [n for n, m in ALL_METHODS.items() if not m.reconstructs]
    raise ValueError(f"method {method!r} reconstructs inputs and needs a reversible model, "
                     f"and {model!r} has no reversible stage: use one of {others}, or a RevNet.")


def get(name: str) -> Method:
  """The method called ``name``.

  Raises:
    ValueError: unknown name; the message lists the known ones.
  """
  if name not in ALL_METHODS:
    raise ValueError(f"Unknown method {name!r}; choose one of {tuple(ALL_METHODS)}.")
  return ALL_METHODS[name]
