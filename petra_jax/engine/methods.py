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


@dataclasses.dataclass(frozen=True)
class Method:
  """What a method keeps and which schedule it runs.

  Attributes:
    name: the ``config.method`` value.
    schedule: a kind of :class:`petra_jax.engine.schedule.Schedule`.
    stashes_inputs: reversible stages keep their input too (non-reversible
      ones always do).
    stashes_weights: every stage keeps a copy of the weights its forward
      used, for its backward's vjp.
    reconstructs: reversible stages rebuild their input from their output
      with their current weights (paper Eq. 5).
    updates: what a stage's update follows: ``"backward"`` (the gradient
      carried back by backward messages), ``"local"`` (its auxiliary loss)
      or ``"forward_gradient"`` (its guess, scaled by scalars sent back).
  """
  name: str
  schedule: str
  stashes_inputs: bool
  stashes_weights: bool
  reconstructs: bool
  updates: str = "backward"

  @property
  def delayed(self) -> bool:
    """Whether gradients arrive ``tau_j > 0`` ticks after their forward."""
    return self.schedule == "stream"

  @property
  def needs_reversible(self) -> bool:
    """Whether the model must have reversible stages."""
    return self.reconstructs

  def reconstructs_stage(self, reversible: bool) -> bool:
    """Whether a stage rebuilds its input in the backward (Eq. 5) rather than
    keep it: a reversible stage under a reconstructing method."""
    return reversible and self.reconstructs

  def buffers_input(self, reversible: bool) -> bool:
    """Whether a stage keeps its input between forward and backward: every
    stage that does not reconstruct. The engine and the memory model read
    this one rule. ``local`` keeps nothing (its update runs with its
    forward)."""
    return self.updates != "local" and not self.reconstructs_stage(reversible)

  @property
  def pipelined(self) -> bool:
    """Whether the method runs stage by stage (not ``jax.grad`` of the model)."""
    return self.schedule != "sequential"


METHODS: dict[str, Method] = {m.name: m for m in (
    Method("backprop", "sequential", stashes_inputs=False, stashes_weights=False,
           reconstructs=False),
    Method("revprop", "drained", stashes_inputs=False, stashes_weights=False, reconstructs=True),
    Method("petra", "stream", stashes_inputs=False, stashes_weights=False, reconstructs=True),
    Method("approximate_input", "stream", stashes_inputs=False, stashes_weights=True,
           reconstructs=True),
    Method("dsp", "stream", stashes_inputs=True, stashes_weights=False, reconstructs=False),
    Method("delayed", "stream", stashes_inputs=True, stashes_weights=True, reconstructs=False),
    Method("gpipe", "gpipe", stashes_inputs=True, stashes_weights=False, reconstructs=False),
    Method("1f1b", "1f1b", stashes_inputs=True, stashes_weights=False, reconstructs=False),
)}
DELAYED = tuple(name for name, m in METHODS.items() if m.delayed)
LOCAL_METHODS: dict[str, Method] = {m.name: m for m in (
    Method("local", "forward", stashes_inputs=False, stashes_weights=False, reconstructs=False,
           updates="local"),
    Method("forward_gradient", "stream", stashes_inputs=False, stashes_weights=False,
           reconstructs=False, updates="forward_gradient"),
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
  if get(method).needs_reversible and not has_reversible:
    others = [n for n, m in ALL_METHODS.items() if not m.needs_reversible]
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
