"""The training methods: what each stage keeps and which schedule it runs.

Paper Table 4, between a micro-batch's forward and backward (a non-reversible
stage always keeps its input): backprop is ``jax.grad``; revprop has no delay;
petra reconstructs with current weights; approximate_input also stashes weights;
dsp keeps inputs; delayed inputs and weights; gpipe and 1f1b keep inputs, exact,
flushed every update. :data:`LOCAL_METHODS` send no gradient back.
"""

from __future__ import annotations

import dataclasses
from petra_jax.engine.context import Keeps


@dataclasses.dataclass(frozen=True)
class Method:
  """One method: its ``schedule`` kind, whether it stashes weights or ``reconstructs`` (Eq. 5).

  ``updates``: ``"backward"``, ``"local"`` or ``"forward_gradient"``.
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
  """What a stage keeps between its forward and its backward."""
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
