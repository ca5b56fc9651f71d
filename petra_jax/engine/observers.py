"""Diagnostics that watch the engine at task boundaries (:class:`Observer`).

:class:`ReconstructionProbe` (paper Sec. 3.2), :class:`GradientProbe` (App. B,
Figs. 5-6) and :class:`TimelineRecorder` (Fig. 1). Results stay in the
observer, never in the pipeline state.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from petra_jax.engine.stages import diagnostics
from petra_jax.engine.arrays import quantize
from petra_jax.engine.transport import transfers as transport
from petra_jax.engine.pipeline import Pipeline
from petra_jax.engine.schedules import Task, TaskKind
from petra_jax.engine.transport.pipeline_state import PipelineState
from petra_jax.engine.methods import tasks
from petra_jax.engine.methods.tasks import TaskResult, copy_tree


class Observer:
  """Diagnostics called around every task; hooks may read ``state``, never change it."""

  def before_task(self, pipe: Pipeline, state: PipelineState, task: Task) -> None:
    pass

  def after_task(self, pipe: Pipeline, state: PipelineState, task: Task,
                 result: TaskResult) -> None:
    pass


def _probed(m: int, every_updates: int, k: int) -> bool:
  """The first micro-batch of every ``every_updates``-th update."""
  return every_updates > 0 and m % (every_updates * k) == 0


class ReconstructionProbe(Observer):
  """``||x~ - x|| / ||x||`` of reconstructing stages, every ``every_updates`` updates."""

  def __init__(self, every_updates: int, accumulation_steps: int = 1):
    self.every, self.k = every_updates, accumulation_steps
    self._inputs: dict = {}
    self._error = jax.jit(diagnostics.relative_error)
    self.results: list = []  # (micro_batch, stage, float32 device scalar)

  def before_task(self, pipe: Pipeline, state: PipelineState, task: Task) -> None:
    j, m = task.stage, task.micro_batch
    if (task.kind == TaskKind.FORWARD and pipe.steps[j].reconstructs and pipe.owned[j]
        and _probed(m, self.every, self.k)):
      self._inputs[(j, m)] = copy_tree(state.inbox[j][m])  # the backward donates it

  def after_task(self, pipe: Pipeline, state: PipelineState, task: Task,
                 result: TaskResult) -> None:
    if task.kind != TaskKind.BACKWARD:
      return
    true = self._inputs.pop((task.stage, task.micro_batch), None)
    if true is not None:
      self.results.append((task.micro_batch, task.stage, self._error(result.x_tilde, true)))

  def pop_results(self) -> list:
    """``(micro_batch, stage, error)`` measured since the last call."""
    out, self.results = self.results, []
    return out


@dataclasses.dataclass
class _Probe:
  """What one probed micro-batch gathered so far (None per stage until known)."""
  images: jax.Array
  labels: jax.Array
  forward_params: list
  backward_params: list
  grads: list
  batch_stats: list


class GradientProbe(Observer):
  """Applied, delayed and end-to-end gradients of probed micro-batches (paper App. B).

  Multi-process, each stage sends its part to stage 0's device at its backward
  (:func:`petra_jax.engine.transport.transfers.transfer`); only stage 0's process has results.
  """

  def __init__(self, every_updates: int, accumulation_steps: int = 1):
    self.every, self.k = every_updates, accumulation_steps
    self._probes: dict[int, _Probe] = {}
    self._quality = None
    self.results: list = []  # (micro_batch, {name: float32[J]})

  def _start(self, pipe: Pipeline, m: int):
    J = pipe.num_stages
    self._probes[m] = _Probe(None, None, [None] * J, [None] * J, [None] * J, [None] * J)

  def before_task(self, pipe: Pipeline, state: PipelineState, task: Task) -> None:
    j, m = task.stage, task.micro_batch
    if task.kind == TaskKind.FORWARD and j == 0 and _probed(m, self.every, self.k):
      self._start(pipe, m)
    probe = self._probes.get(m)
    if probe is None or task.kind == TaskKind.BACKPROP:
      return
    if pipe.owned[j]:
      _record(pipe, state, task, probe)
    if task.kind in (TaskKind.BACKWARD, TaskKind.LOSS) and pipe.owned[j] != pipe.owned[0]:
      _gather(pipe, state, probe, j)

  def after_task(self, pipe: Pipeline, state: PipelineState, task: Task,
                 result: TaskResult) -> None:
    j, m = task.stage, task.micro_batch
    if m not in self._probes or j != 0:
      return
    if task.kind == TaskKind.FORWARD and pipe.owned[0]:  # the micro-batch, as fed
      self._probes[m].images = quantize.dequantize(state.buffers[0][m])
    elif task.kind == TaskKind.BACKWARD:
      probe = self._probes.pop(m)
      if pipe.owned[0]:
        self._finish(pipe, state, m, probe)

  def _finish(self, pipe: Pipeline, state: PipelineState, m: int, probe: _Probe):
    if self._quality is None:
      self._quality = jax.jit(functools.partial(diagnostics.grad_quality, pipe.stages))
    stats = [s.batch_stats if pipe.owned[j] else probe.batch_stats[j]
             for j, s in enumerate(state.train_states)]
    args = transport.send((probe.grads, probe.forward_params, probe.backward_params, stats,
                           probe.images, probe.labels), pipe.devices[0])
    self.results.append((m, self._quality(*args)))

  def pop_results(self, wait: bool = False) -> list:
    """``(micro_batch, {name: float32[J]})`` computed so far (all with ``wait``)."""
    ready, pending = [], []
    for m, quality in self.results:
      done = wait or all(v.is_ready() for v in quality.values())
      (ready if done else pending).append((m, quality))
    self.results = pending
    return ready


def _record(pipe: Pipeline, state: PipelineState, task: Task, probe: _Probe) -> None:
  """Copies stage ``task.stage``'s forward weights, backward weights, gradient and labels."""
  j, m = task.stage, task.micro_batch
  params = copy_tree(state.train_states[j].params)
  if task.kind == TaskKind.FORWARD:
    probe.forward_params[j] = copy_tree(pipe.steps[j].forward_params(state.train_states[j]))
  elif task.kind == TaskKind.LOSS:
    probe.forward_params[j] = params
  if task.kind in (TaskKind.BACKWARD, TaskKind.LOSS):
    probe.backward_params[j] = params
    probe.grads[j] = pipe.steps[j].gradient(state.train_states[j], *tasks.backward_args(
        pipe.contexts[j], state, m))
    if task.kind == TaskKind.LOSS:
      probe.labels = state.labels[m]


def _gather(pipe: Pipeline, state: PipelineState, probe: _Probe, j: int) -> None:
  """Stage ``j``'s part of the probe to stage 0's device (called by both processes)."""
  src, dst = pipe.devices[j], pipe.devices[0]
  last = j == pipe.num_stages - 1
  spec = _part_spec(pipe, j, probe.images) if pipe.owned[0] else None
  if pipe.owned[j]:
    labels = jnp.asarray(probe.labels, jnp.int32) if last else None
    part = (probe.forward_params[j], probe.backward_params[j], probe.grads[j],
            state.train_states[j].batch_stats, labels)
    spec = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), part)
    transport.transfer(part, src, dst, spec)
    return
  fwd, bwd, grads, stats, labels = transport.transfer(None, src, dst, spec)
  probe.forward_params[j], probe.backward_params[j] = fwd, bwd
  probe.grads[j], probe.batch_stats[j] = grads, stats
  if last:
    probe.labels = labels


def _part_spec(pipe: Pipeline, j: int, images: jax.Array) -> tuple:
  """Shapes of :func:`_gather`'s message: params x3, statistics, labels ``int32[B]`` or None."""
  x = pipe.message_specs(images)[j]
  variables = jax.eval_shape(pipe.stages[j].init, jax.random.key(0, impl="rbg"), x)
  params, stats = variables["params"], variables["batch_stats"]
  labels = (jax.ShapeDtypeStruct(images.shape[:1], jnp.int32)
            if j == pipe.num_stages - 1 else None)
  return params, params, params, stats, labels


class TimelineRecorder(Observer):
  """Records ``(tick, stage, letter, micro_batch)`` of every task: the schedule family's
  ``letters`` ("F", "B", a ``loss`` is both; zero bubble's weight gradient "W")."""

  def __init__(self):
    self.events: list[tuple[int, int, str, int]] = []

  def after_task(self, pipe: Pipeline, state: PipelineState, task: Task,
                 result: TaskResult) -> None:
    for kind in pipe.method.schedule.letters.get(task.kind, ""):
      self.events.append((state.tick, task.stage, kind, task.micro_batch))
