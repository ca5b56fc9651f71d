"""What one stage's tasks need, built once per stage by the Pipeline: :class:`StageContext`.

Task builders (:mod:`tasks`, :mod:`local_learning`, :mod:`forward_gradient_tasks`,
:mod:`zero_bubble`) read a stage's context only, never the Pipeline.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple, Optional

import jax

from petra_jax.engine.arrays import packing
from petra_jax.engine.transport import transfers as transport
from petra_jax.engine.transport.pipeline_state import PipelineState
from petra_jax.engine.stages.stage import Stage
from petra_jax.engine.stages.steps import StageSteps



class Keeps(NamedTuple):
  """What a stage holds between a micro-batch's forward and its backward (paper Table 4)."""
  input: bool
  weights: bool


Route = Callable[[Any, int], Any]  # (payload, micro-batch m) -> payload on the receiver


@dataclasses.dataclass(frozen=True)
class StageContext:
  """Stage ``j`` of ``J`` as its tasks see it.

  Attributes:
    j: the stage's index; ``last``: whether it is ``J - 1`` (the loss stage).
    stage: the :class:`Stage` (its module, for the local methods' own steps).
    steps: its jitted steps (:class:`petra_jax.engine.stages.steps.StageSteps`).
    owned: whether this process runs it.
    keeps: what it holds between forward and backward (paper Table 4).
    send: its output to ``j + 1`` (None on the last stage).
    send_back: ``(x, delta, m) -> (x or None, delta)`` on ``j - 1`` (None on
      stage 0); ``x`` travels only when stage ``j - 1`` reconstructs.
    route_back: any payload to ``j - 1`` as is (None on stage 0; methods
      that send no cotangent).
    encode: ``(x, m) -> x`` in the ``buffer`` format (a kept input).
    feed: stage 0's ``(state, m, batches)``: images in, labels to the last stage.
    state_of: ``state -> its state`` as the steps take it (packed or not).
    device: its (first) device; ``loss_home``: the last stage's loss to stage 0's
      process (None unless several processes report losses).
    options: the method's options (``forward_gradient``: :class:`forward_gradient.Options`).
    backprop: stage 0's ``(train_states, images, labels) -> (train_states, loss)``, the
      whole model's update (method ``backprop``; None on the other stages).
  """
  j: int
  last: bool
  stage: Stage
  steps: StageSteps
  owned: bool
  keeps: Keeps
  send: Optional[Route]
  send_back: Optional[Callable]
  route_back: Optional[Route]
  encode: Callable
  feed: Optional[Callable]
  state_of: Callable
  device: jax.Device
  loss_home: Optional[Callable] = None
  options: Any = None
  backprop: Optional[Callable] = None


def feeder(first, last, owns_first: bool, owns_last: bool) -> Callable:
  """``(state, m, batches)``: micro-batch ``m``'s images to stage 0, labels to the last stage."""
  def feed(state: PipelineState, m: int, batches) -> None:
    images, labels = batches(m)
    state.inbox[0][m] = (transport.send_if_elsewhere(images, first.batch, first.batch_sharding)
                         if owns_first else None)
    if owns_last:
      state.labels[m] = transport.send_if_elsewhere(labels, last.batch, last.batch_sharding)
  return feed


def state_getter(j: int, pack: bool) -> Callable:
  """``state -> stage j's state`` as the steps take it (packed on first use where ``pack``)."""
  if not pack:
    return lambda state: state.stage_states[j]

  def get(state: PipelineState):
    s = state.stage_states[j]
    if not isinstance(s, packing.PackedState):
      s = state.stage_states[j] = packing.pack(s)
    return s
  return get


def back_route(route: Optional[Route], with_input: bool) -> Optional[Route]:
  """``(x, dx, m) -> (x or None, dx)`` on stage ``j - 1`` through ``route``."""
  if route is None:
    return None
  return lambda x, dx, m: route((x if with_input else None, dx), m)
