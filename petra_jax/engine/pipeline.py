"""The engine: runs a schedule's tasks on stages placed on their own devices.

:meth:`Pipeline.run_tick` runs one tick of a :class:`Schedule`; each task
calls its stage's task, built from the stage's :class:`StageContext` by the
method row's ``tasks`` (``backward``: reconstruct and vjp, paper Eq. 5; loss,
Alg. 1 l. 27-30). A tick dispatches its compute first, its moves after.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional, Sequence

import jax
import jax.numpy as jnp

from petra_jax.engine.methods import context as context_lib
from petra_jax.engine.methods import forward_gradient as fg_lib
from petra_jax.engine.stages import input_checks
from petra_jax.engine.methods import local_learning
from petra_jax.engine.methods import tasks
from petra_jax.engine.transport import transfers as transport
from petra_jax.engine import methods as methods_lib
from petra_jax.engine.stages import objective as objective_lib
from petra_jax.engine.stages import stage_checks
from petra_jax.engine.transport import placement as placement_lib
from petra_jax.engine.arrays import quantize as quantize_lib
from petra_jax.engine import schedules as schedule_lib
from petra_jax.engine.stages import stage as stage_lib
from petra_jax.engine.transport.messages import Messenger, resolve
from petra_jax.engine.transport.pipeline_state import PipelineState
from petra_jax.engine.schedules import Schedule, TaskKind
from petra_jax.engine.stages.stage import Stage
from petra_jax.engine.stages.stage_state import StageState
from petra_jax.engine.stages.steps import BN_POLICIES, PipelineSteps
from petra_jax.engine.methods.tasks import TaskResult, TickOutput

Batches = Callable[[int], tuple]  # m -> (images [B, H, W, C], labels [B])
_LOSS_SPEC = jax.ShapeDtypeStruct((), jnp.float32)

@dataclasses.dataclass(frozen=True)
class Regime:
  """How ticks run: ``fuse`` forward+backward in one call, ``pack`` states, ``defer`` moves."""
  fuse: bool
  pack: bool
  defer: bool


def regime(method: methods_lib.Method, observers: bool, multiprocess: bool,
           data_parallel: int, num_places: int) -> Regime:
  """Decides :class:`Regime` (fuse: one process, no observers; pack: D = 1)."""
  fast = (method.updates == "backward" and method.pipelined and not observers
          and not multiprocess)
  return Regime(fuse=fast, pack=fast and data_parallel == 1, defer=num_places > 1)


def assign_devices(num_stages: int, devices: Sequence[jax.Device]) -> list:
  """Contiguous blocks of stages per device: stage ``j`` -> ``devices[j*n//J]``."""
  return [p.device for p in placement_lib.assign(num_stages, devices)]


def _init_state(stage: Stage, tx, x_spec, key: jax.Array) -> StageState:
  """``stage``'s ``StageState`` at step 0 for an input like ``x_spec`` (a ``ShapeDtypeStruct``
  pytree): ``stage.init(key, zeros)`` and ``tx.init`` of its parameters."""
  zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), x_spec)
  v = stage.init(key, zeros)
  return StageState.create(v["params"], v["batch_stats"], tx)


class Pipeline:
  """A method's stages on their devices, and the tasks of its schedule.

  Args:
    stages: at least 2; the last computes the loss.
    tx: the optax optimizer of every stage, or one per stage.
    method: a name in :data:`methods.ALL_METHODS`.
    accumulation_steps: ``k``, micro-batches per update.
    bn_stats: ``"backward"`` (paper Sec. 4) or ``"forward"``.
    observers: :class:`petra_jax.engine.observers.Observer` s called around every task.
    predictors: per stage, None or ``(params, opt_state) -> params``.
    data_parallel: ``D``, devices per stage.
    objective: an :class:`objective.Objective`: what the last stage's logits are checked against.
    task: the deprecated old name of ``objective`` (a ``DeprecationWarning``).

  Raises:
    ValueError: fewer than 2 stages, a reversible first or last stage, an
      unknown ``bn_stats`` or method, a reconstructing method without
      reversible stages, ``backprop`` on several device groups, or devices
      not a multiple of ``D``.
  """

  def __init__(self, stages: Sequence[Stage], tx, devices: Optional[Sequence[jax.Device]] = None,
               *, method: str = "petra", accumulation_steps: int = 1,
               bn_stats: str = "backward", observers: Sequence = (),
               predictors: Optional[Sequence[Optional[Callable]]] = None,
               formats: Optional[quantize_lib.MessageFormats] = None,
               send_losses: bool = True, data_parallel: int = 1,
               forward_gradient: Optional[fg_lib.Options] = None,
               step_wrap: Optional[Callable] = None,
               objective: objective_lib.Objective = objective_lib.CLASSIFICATION,
               task: Optional[objective_lib.Objective] = None):
    self.method = methods_lib.get(method)
    self.objective = objective_lib.deprecated_keyword(objective, task)
    _check(stages, self.method, bn_stats)
    self.input_spec = None  # stage 0's input, declared by init
    self.stages = list(stages)
    self.num_stages = J = len(stages)
    self.accumulation_steps = accumulation_steps
    self.forward_gradient = forward_gradient or fg_lib.Options()
    # (an optax GradientTransformation is itself a tuple: test for one first)
    self.txs = [tx] * J if hasattr(tx, "update") else list(tx)
    if len(self.txs) != J:
      raise ValueError(f"{len(self.txs)} optimizers for {J} stages: give one, or one per stage.")
    self.placements = placement_lib.assign(J, devices or jax.local_devices(), data_parallel)
    self.devices = [p.device for p in self.placements]
    if not self.method.pipelined and len(set(self.placements)) > 1:
      raise ValueError("backprop runs on one device (or one group of data_parallel devices): "
                       "build the Pipeline with devices=[d] (or D devices).")
    self.owned = [transport.is_local(d) for d in self.devices]
    self.multiprocess = not all(self.owned)
    self.send_losses = send_losses
    self.formats = formats or quantize_lib.MessageFormats()
    self.observers = list(observers)
    self.regime = regime(self.method, bool(self.observers), self.multiprocess, data_parallel,
                         len(set(self.placements)))
    self.messages = Messenger(self.stages, self.placements, self.owned, self.formats)
    self.messages.defer = self.regime.defer
    self.steps = PipelineSteps(stages, self.method, bn_stats, predictors,
                               donate_messages=self.formats.backward == "none", wrap=step_wrap)
    self.reconstructs = [s.reconstructs for s in self.steps]
    o = self.forward_gradient
    self.keeps = [methods_lib.keeps(self.method, s.reversible, o.perturb, o.emulate)
                  for s in stages]
    if self.method.updates != "backward":
      local_learning.check_setup(self.method, self.stages, self.formats.quantized, self.multiprocess,
                        self.forward_gradient.guess)
    self.contexts = [self._context(j) for j in range(J)]
    self._tasks = self._plan()
    self._run_task = self._run_observed if self.observers else self._run_plain
    self._pairs = ([tasks.pair_task(c) for c in self.contexts[:-1]] if self.regime.fuse
                   else None)

  def _context(self, j: int) -> context_lib.StageContext:
    """Stage ``j``'s :class:`StageContext` (built once)."""
    J, p, msg = self.num_stages, self.placements, self.messages
    send = msg.route("forward", j, j + 1) if j < J - 1 else None
    route_back = send_back = None
    if j > 0:
      back = self.reconstructs[j - 1]
      route_back = msg.route("backward", j, j - 1, first=back)
      send_back = context_lib.back_route(route_back, back)
    feed = (context_lib.feeder(p[0], p[-1], self.owned[0], self.owned[-1]) if j == 0
            else None)
    loss_home = None
    if j == J - 1 and self.multiprocess and self.send_losses:
      loss_home = lambda loss: msg.move(loss, j, 0, _LOSS_SPEC)  # noqa: E731
    return context_lib.StageContext(
        j=j, last=j == J - 1, stage=self.stages[j], steps=self.steps[j],
        owned=self.owned[j], keeps=self.keeps[j], send=send, send_back=send_back,
        route_back=route_back,
        encode=lambda x, m: msg.encode("buffer", x, j, m), feed=feed,
        state_of=context_lib.state_getter(j, self.regime.pack), device=self.devices[j],
        loss_home=loss_home, options=self.forward_gradient,
        backprop=self.steps.backprop if j == 0 else None)

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
    return self.owned[0]

  @property
  def owns_output(self) -> bool:
    """Whether this process runs the last stage (labels, logits, losses)."""
    return self.owned[-1]

  def init(self, seed: int, sample_input: jax.Array) -> PipelineState:
    """Initialises this process's stages and the transport.

    Args:
      seed: the parameters' seed (stage ``j`` folds in ``j``).
      sample_input: a micro-batch of stage 0's input, ``float32[B, H, W, C]`` (text: token
        ids ``int32[B, T]``); its shape and dtype become what :meth:`run_tick` and
        :meth:`predict` accept.

    Returns:
      The :class:`PipelineState` at tick 0: every stage's ``StageState`` (None for a stage
      another process owns) on its placement, nothing in flight.

    Raises:
      ValueError: a stage that fails :func:`~petra_jax.check_stages` on ``sample_input``.
    """
    self.input_spec = input_checks.declared(sample_input, self.objective)  # what run_tick and predict take
    one = jax.ShapeDtypeStruct((1, *sample_input.shape[1:]), sample_input.dtype)
    outputs = stage_checks.checked_outputs(self.stages, one, objective=self.objective)
    inputs = [one] + outputs[:-1]

    def init_all(key):  # one program: a compile per stage costs more (RevNet18: docs/performance.md)
      return [_init_state(stage, self.txs[j], x, jax.random.fold_in(key, j))
              if self.owned[j] else None for j, (stage, x) in enumerate(zip(self.stages, inputs))]

    states = jax.jit(init_all)(jax.random.key(seed, impl="rbg"))
    self.messages.start(seed, sample_input, self.multiprocess)
    states = [transport.send(s, p.replicated) if s is not None else None
              for s, p in zip(states, self.placements)]
    return PipelineState.empty(states)

  def schedule(self, num_micro_batches: int) -> Schedule:
    """This method's tick table over ``num_micro_batches`` micro-batches."""
    return Schedule(self.method.schedule, self.num_stages, num_micro_batches,
                    self.accumulation_steps)

  def message_specs(self, sample_input) -> list:
    """Each stage's input shapes, then the logits' (:meth:`Messenger.message_specs`)."""
    return self.messages.message_specs(sample_input)

  def run_tick(self, state: PipelineState, tick: schedule_lib.Tick,
               batches: Optional[Batches] = None) -> tuple[PipelineState, list[TickOutput]]:
    """Runs one tick's tasks in order; ``state``'s arrays are donated.

    Args:
      state: the state after the previous tick (``state.tick`` is this tick's index).
      tick: the tick's tasks (``schedule[t]`` of :meth:`schedule`).
      batches: ``m -> (images float32[B, H, W, C], labels int32[B])`` (text: ids and
        targets ``int32[B, T]``); needed by ticks that feed a micro-batch.

    Returns:
      ``(new_state, outputs)``: the :class:`TickOutput` (micro-batch, float32 loss) of the
      tick's ``loss``/``backprop`` tasks.

    Raises:
      ScheduleError: a task's input has not arrived.
      ValueError: images or labels unlike the model's declared input
        (:mod:`~petra_jax.engine.stages.input_checks`: layout, dtype, label form).
    """
    if batches is not None:
      batches = input_checks.checked(batches, self.input_spec)
    # New containers around the same arrays: the tasks pop and insert messages in place, and the
    # caller's state must stay as it was (its arrays are donated, its dicts are not).
    state = state.successor()
    outputs = self.run_tasks(state, tick, batches)
    if self.regime.defer:
      # Messages sent this tick were Deferred receipts: they move together at the tick's end
      # (local ones in one device_put, then the transfers between processes), so a message is
      # consumed on the next tick, never on the one that sent it.
      self.messages.flush()
      resolve(state.inbox)
      resolve(state.grad_inbox)
    state.tick += 1
    return state, outputs

  def run_tasks(self, state: PipelineState, tick: schedule_lib.Tick,
                batches: Optional[Batches], plan: Optional[tuple] = None) -> list[TickOutput]:
    """Runs ``tick``'s tasks in order on ``state``, in place; returns the tick's losses.

    A forward directly followed by the same stage's backward runs as one fused
    call where the regime fuses. ``plan``: ``(tasks, pairs)`` of :meth:`plan`
    to run instead of this pipeline's own (the compiled executor's traced feed);
    ``batches`` is called unchecked.
    """
    tasks_by_kind, pairs = (self._tasks, self._pairs) if plan is None else plan
    run = self._run_task if plan is None else (
        lambda st, task, b: tasks_by_kind[task.kind][task.stage](st, task.micro_batch, b))
    outputs, losses = [], self.method.schedule.losses
    i, n = 0, len(tick)
    while i < n:
      task = tick[i]
      if pairs is not None and task.kind == TaskKind.FORWARD and i + 1 < n:
        # One call for a stage's forward and backward of the same tick: half the dispatches,
        # and XLA may overlap them (they touch different micro-batches).
        after = tick[i + 1]
        if after.stage == task.stage and after.kind == TaskKind.BACKWARD:
          pairs[task.stage](state, task.micro_batch, after.micro_batch, batches)
          i += 2
          continue
      result = run(state, task, batches)
      if result.loss is not None or (self.multiprocess and task.kind in losses):
        outputs.append(TickOutput(task.micro_batch, result.loss))
      i += 1
    return outputs

  def run(self, state: PipelineState, ticks, batches: Batches):
    """Runs every tick of ``ticks`` with :meth:`run_tick`.

    Returns:
      ``(new_state, outputs)``: the state after the last tick and every tick's
      :class:`TickOutput`, in order.

    Raises:
      ScheduleError, ValueError: as :meth:`run_tick`.
    """
    outputs = []
    for tick in ticks:
      state, out = self.run_tick(state, tick, batches)
      outputs += out
    return state, outputs

  def _run_plain(self, state, task, batches) -> TaskResult:
    return self._tasks[task.kind][task.stage](state, task.micro_batch, batches)

  def _run_observed(self, state, task, batches) -> TaskResult:
    for obs in self.observers:
      obs.before_task(self, state, task)
    result = self._tasks[task.kind][task.stage](state, task.micro_batch, batches)
    for obs in self.observers:
      obs.after_task(self, state, task, result)
    return result

  def _plan(self, contexts: Optional[Sequence] = None) -> dict:
    """``{kind: [stage j's task or None]}`` from the method row's ``tasks``."""
    J, family = self.num_stages, self.method.schedule
    contexts = self.contexts if contexts is None else contexts
    out = {}
    for kind, build in self.method.tasks.items():
      out[kind] = [None] * J
      for j in family.stages(kind, J):
        out[kind][j] = build(contexts[j])
    return out

  def plan(self, feed: Callable, in_program: bool = False) -> tuple:
    """``(tasks, pairs)`` as the pipeline's own, with stage 0's ``feed`` replaced.

    ``feed(state, m, batches)`` puts micro-batch ``m``'s input in ``state.inbox[0]``
    (and its labels in ``state.labels``: the compiled executor's traced feed). States
    are taken as they are, never packed (packing pays for dispatches, not in a program).
    ``in_program``: messages are left where they are made (the compiled executor's
    stage-mesh program moves them itself with ``lax.ppermute``).
    """
    stay = lambda x, m: x  # noqa: E731
    contexts = [dataclasses.replace(c, feed=feed if c.feed is not None else None,
                                    state_of=context_lib.state_getter(c.j, False))
                for c in self.contexts]
    if in_program:
      contexts = [dataclasses.replace(
          c, send=c.send and stay, route_back=c.route_back and stay,
          send_back=c.send_back and context_lib.back_route(stay, self.reconstructs[c.j - 1]))
          for c in contexts]
    pairs = [tasks.pair_task(c) for c in contexts[:-1]] if self.regime.fuse else None
    return self._plan(contexts), pairs

  def predict(self, state: PipelineState, images) -> Optional[jax.Array]:
    """Logits from the stages' current weights and running statistics (evaluation mode).

    Args:
      state: a :class:`PipelineState` (in-flight messages are ignored).
      images: ``float32[B, H, W, C]`` (text: token ids ``int32[B, T]``).

    Returns:
      ``float32[B, K]`` logits (text: ``[B, T, V]``); None on a process without the last
      stage. Every process must call it.

    Raises:
      ValueError: ``images`` unlike the input :meth:`init` declared.
    """
    input_checks.check_images(images, self.input_spec, "predict")
    J = self.num_stages
    specs = self.message_specs(images) if self.multiprocess else [None] * (J + 1)
    x = transport.send(images, self.placements[0].batch) if self.owned[0] else None
    if len(set(self.placements)) == 1 and not self.multiprocess:  # one program
      return self.steps.evaluate_all(state.stage_states, x)
    for j in range(J):
      if j > 0:
        x = self.messages.move(x, j - 1, j, specs[j])
      if self.owned[j]:
        x = self.steps[j].evaluate(state.stage_states[j], x)
    return x if self.owned[-1] else None


def _check(stages: Sequence[Stage], method: methods_lib.Method, bn_stats: str) -> None:
  """The constructor's argument checks (see :class:`Pipeline`)."""
  schedule_lib.require_stages(len(stages))
  if stages[0].reversible or stages[-1].reversible:
    raise ValueError("the first stage (input) and the last (loss) cannot be reversible.")
  if bn_stats not in BN_POLICIES:
    raise ValueError(f"Unknown bn_stats policy {bn_stats!r}; choose one of {BN_POLICIES}.")
  methods_lib.require_reversible(method.name, "this model", stage_lib.has_reversible(stages))
