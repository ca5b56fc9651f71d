"""The engine: runs a schedule's tasks on stages placed on their own devices.

Each stage ``j`` lives on one device (``jax.device_put``) and owns a carried
:class:`petra_jax.engine.state.StageState`. :meth:`Pipeline.run_tick` runs
one tick of a :class:`petra_jax.engine.schedule.Schedule`: each task calls
its stage's function of its kind, built once with the pipeline (the
method's rules, the stage's device and routes decided there, not per task;
a message between two stages on one device is not moved):

* ``forward`` (:func:`petra_jax.engine.tasks.forward_task`): ``x_{j+1} = F_j(x_j,
  theta_j^t)``, sent to stage ``j+1``; the input is kept if the stage buffers
  it, the weights if the method stashes them (:mod:`petra_jax.engine.methods`);
* ``backward`` (:func:`petra_jax.engine.tasks.backward_task`): a reconstructing stage
  rebuilds its input from its output with its *current* weights and takes
  the vjp there (paper Eq. 5); any other stage recomputes from its buffered
  input. Then the optax update; ``(x~_j, delta_j)`` goes to stage ``j-1``;
* ``loss`` (:meth:`Pipeline._loss_task`): the last stage's forward, loss and
  backward at once (Alg. 1, l. 27-30);
* ``backprop`` (:meth:`Pipeline._backprop_task`): ``jax.grad`` of the
  composed model on one device.

Where a tick has a stage's forward then its backward (the steady state),
both run as one jitted call (:func:`petra_jax.engine.tasks.pair_task`), with
the two tasks' results; not with observers, nor across processes.

A task consumes a message sent on an earlier tick. So a tick whose
stages sit on several devices dispatches all of its computation first and
its moves after (:meth:`Messenger.flush`): the moves within a process as one
batched ``jax.device_put``, then the cross-process transfers in the tick's
task order (the same on every process), so no process waits for a message
before it has queued its own work. A tick's forward and
backward at one stage both use ``theta_j^t`` (the forward comes first in the
table); the update follows. The jitted steps (:mod:`petra_jax.engine.steps`)
are compiled once per stage and donate the carried state; messages are
encoded and moved by :mod:`petra_jax.engine.messages`; nothing waits for the
devices (losses stay device arrays, nothing is read back). Diagnostics are
:class:`petra_jax.engine.state.Observer`\\ s called around tasks; without
observers the tick runs no diagnostic code.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import jax
import jax.numpy as jnp

from petra_jax.engine import methods as methods_lib
from petra_jax.engine import nnx_modules
from petra_jax.engine import placement as placement_lib
from petra_jax.engine import quantize as quantize_lib
from petra_jax.engine import schedule as schedule_lib
from petra_jax.engine import stage as stage_lib
from petra_jax.engine import tasks, transport
from petra_jax.engine.messages import Messenger
from petra_jax.engine.schedule import BACKPROP, BACKWARD, FORWARD, LOSS, Schedule
from petra_jax.engine.stage import Stage, trace
from petra_jax.engine.state import (Observer, PipelineState, StageState, TaskResult, TickOutput,
                                    resolve, take)
from petra_jax.engine.steps import BN_POLICIES, StageSteps

_LOSS_SPEC = jax.ShapeDtypeStruct((), jnp.float32)
Batches = Callable[[int], tuple]  # micro-batch index -> (images [B,H,W,C], labels [B])


def assign_devices(num_stages: int, devices: Sequence[jax.Device]) -> list:
  """Contiguous blocks of stages per device: stage ``j`` -> ``devices[j*n//J]``."""
  return [p.device for p in placement_lib.assign(num_stages, devices)]


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
    observers: :class:`petra_jax.engine.state.Observer`\\ s called around
      every task (diagnostics).
    predictors: per stage, the weights its forward uses (see
      :class:`petra_jax.engine.steps.StageSteps`); default: the current ones.
    formats: the format of forward messages, backward messages and input
      buffers (:class:`petra_jax.engine.quantize.MessageFormats`); default: all
      float, as computed.
    send_losses: multi-process: move each loss to process 0 on the tick it is
      computed (True), or leave it on the last stage's process for the caller
      to gather (False: the training loop's ``loss_log.LossRelay``).
    data_parallel: ``D``, devices per stage (:mod:`petra_jax.engine.placement`):
      ``devices`` are cut into groups of ``D``; each stage's state is
      replicated over its group and its micro-batches sharded over it.

  Attributes:
    steps: the stages' jitted steps and backward rule
      (:class:`petra_jax.engine.steps.StageSteps`).
    messages: how payloads are encoded, shaped and moved
      (:class:`petra_jax.engine.messages.Messenger`).
    placements: each stage's :class:`petra_jax.engine.placement.Placement`
      (its device, or its group of ``D`` devices).
    devices: each stage's device (its group's first); local: whether this
      process runs it.
    reconstructs: per stage, whether its backward rebuilds its input
      (``steps.reconstructs``).
    packs: whether the tasks pass each stage's state to its steps packed
      (:mod:`petra_jax.engine.packing`: a few flat buffers, cheaper to
      dispatch; ``state.train_states`` still reads :class:`StageState`\\ s;
      states of large leaves stay unpacked, :attr:`packing.Packer.pays`).
      Off with observers (they read the states around every task), across
      processes and with ``data_parallel > 1`` (replicated states), in
      ``backprop`` (one call on every state) and in the pipelines with
      tasks of their own (``FUSES`` False).

  Raises:
    ValueError: fewer than 2 stages, a reversible first or last stage, an
      unknown ``bn_stats`` policy or method, a reconstructing method on a
      model without reversible stages, ``backprop`` on several device
      groups, or a number of devices that is not a multiple of ``D``.
  """
  UPDATES = ("backward",)  # the Method.updates this class runs (the others: engine/local.py)
  FUSES = True  # a stage's forward and backward of one tick in one call (subclasses with
                # tasks of their own, built by their _plan, set False)

  def __init__(self, stages: Sequence[Stage], tx, devices: Optional[Sequence[jax.Device]] = None,
               *, method: str = "petra", accumulation_steps: int = 1,
               bn_stats: str = "backward", observers: Sequence[Observer] = (),
               predictors: Optional[Sequence[Optional[Callable]]] = None,
               formats: Optional[quantize_lib.MessageFormats] = None,
               send_losses: bool = True, data_parallel: int = 1):
    self.method = methods_lib.get(method)
    if self.method.updates not in self.UPDATES:
      raise ValueError(f"method {method!r} runs in its own pipeline: build it with "
                       "petra_jax.engine.local.pipeline_for.")
    _check(stages, self.method, bn_stats)
    self.stages = list(stages)
    self.num_stages = J = len(stages)
    self.accumulation_steps = accumulation_steps
    # (an optax GradientTransformation is itself a tuple: test for one first)
    self.txs = [tx] * J if hasattr(tx, "update") else list(tx)
    if len(self.txs) != J:
      raise ValueError(f"{len(self.txs)} optimizers for {J} stages: give one, or one per stage.")
    self.placements = placement_lib.assign(J, devices or jax.local_devices(), data_parallel)
    self.devices = [p.device for p in self.placements]
    if not self.method.pipelined and len(set(self.placements)) > 1:
      raise ValueError("backprop runs on one device (or one group of data_parallel devices): "
                       "build the Pipeline with devices=[d] (or D devices).")
    # Multi-process (jax.distributed): this process runs only the stages on
    # its own devices; messages to or from the others go through transport.
    self.local = [transport.is_local(d) for d in self.devices]
    self.multiprocess = not all(self.local)
    self.send_losses = send_losses
    self.formats = formats or quantize_lib.MessageFormats()
    self.messages = Messenger(self.stages, self.placements, self.local, self.formats)
    # Where messages move, a tick's compute is dispatched first and its
    # moves after: one batched device_put, then the cross-process exchanges.
    self.messages.defer = len(set(self.placements)) > 1
    self.steps = StageSteps(stages, self.method, bn_stats, predictors,
                            donate_messages=self.formats.backward == "none")
    self.reconstructs = self.steps.reconstructs
    self.observers = list(observers)
    self.packs = self._packs(data_parallel)
    self._tasks = self._plan()
    self._run_task = self._run_observed if self.observers else self._run_plain
    # A stage's forward then backward in one tick run as one jitted call
    # (not with observers, which are called around each task, nor across
    # processes, whose message order every process must share).
    self._pairs = (None if self.observers or self.multiprocess or not self.FUSES
                   else [tasks.pair_task(self, j) for j in range(J - 1)])

  def _packs(self, data_parallel: int) -> bool:
    """Whether the hot path passes the stage states packed (see :attr:`packs`)."""
    return (self.FUSES and self.method.pipelined and not self.observers
            and not self.multiprocess and data_parallel == 1)

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
    nnx_modules.check_stages(self.stages, one)
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
    self.messages.start(seed, sample_input, self.multiprocess)
    states = [transport.send(s, p.replicated) if s is not None else None
              for s, p in zip(states, self.placements)]
    return PipelineState.empty(states)

  def schedule(self, num_micro_batches: int) -> Schedule:
    """This method's tick table over ``num_micro_batches`` micro-batches."""
    return Schedule(self.method.schedule, self.num_stages, num_micro_batches,
                    self.accumulation_steps)

  def message_specs(self, sample_input) -> list:
    """Each stage's input shapes, then the logits', for a stage-0 input
    shaped like ``sample_input`` (:meth:`Messenger.message_specs`)."""
    return self.messages.message_specs(sample_input)

  # -- running a schedule ------------------------------------------------------

  def run_tick(self, state: PipelineState, tick: schedule_lib.Tick,
               batches: Optional[Batches] = None) -> tuple[PipelineState, list[TickOutput]]:
    """Runs one tick's tasks in order.

    Args:
      state: the pipeline state before the tick. Its containers are left as
        they were, but its arrays are donated to the steps: use only the
        returned state afterwards.
      tick: the tasks (a row of :meth:`schedule`).
      batches: ``m -> (images float32[B, H, W, C], labels int32[B])``, called
        for the micro-batch stage 0 takes on this tick. Multi-process: images
        may be None on processes that do not own stage 0.

    Returns:
      ``(new_state, outputs)``: the state after the tick, and the losses of
      the micro-batches whose ``loss`` (or ``backprop``) task ran.
      Multi-process: the loss is on stage 0's device on process 0, None on
      the others (with ``send_losses=False``: on the last stage's device, on
      its process).

    Raises:
      ScheduleError: a task's input has not arrived.
    """
    state, outputs, run, pairs = state.successor(), [], self._run_task, self._pairs
    i, n = 0, len(tick)
    while i < n:
      task = tick[i]
      if pairs is not None and task.kind == FORWARD and i + 1 < n:
        after = tick[i + 1]
        if after.stage == task.stage and after.kind == BACKWARD:
          pairs[task.stage](state, task.micro_batch, after.micro_batch, batches)
          i += 2
          continue
      result = run(state, task, batches)
      if result.loss is not None or (self.multiprocess and task.kind == LOSS):
        outputs.append(TickOutput(task.micro_batch, result.loss))
      i += 1
    if self.messages.defer:  # the tick's moving messages, after its compute
      self.messages.flush()
      resolve(state.inbox)
      resolve(state.grad_inbox)
    state.tick += 1
    return state, outputs

  def run(self, state: PipelineState, ticks, batches: Batches):
    """Runs every tick of ``ticks`` (see :meth:`run_tick`); returns
    ``(new_state, outputs)``."""
    outputs = []
    for tick in ticks:
      state, out = self.run_tick(state, tick, batches)
      outputs += out
    return state, outputs

  def revprop_step(self, state: PipelineState, images, labels):
    """One micro-batch with every delay 0: this method's stage steps on the
    ``drained`` table (for ``petra``: synchronous reversible backprop;
    exact gradients for every method). Returns ``(new_state, loss)``.

    Raises:
      RuntimeError: micro-batches are already in flight.
    """
    if state.in_flight():
      raise RuntimeError("revprop_step needs an empty pipeline: finish the schedule first.")
    state, outs = self.run(state, Schedule("drained", self.num_stages, 1),
                           lambda m: (images, labels))
    return state, outs[0].loss

  def _run_plain(self, state, task, batches) -> TaskResult:
    return self._tasks[task.kind][task.stage](state, task.micro_batch, batches)

  def _run_observed(self, state, task, batches) -> TaskResult:
    for obs in self.observers:
      obs.before_task(self, state, task)
    result = self._tasks[task.kind][task.stage](state, task.micro_batch, batches)
    for obs in self.observers:
      obs.after_task(self, state, task, result)
    return result

  # -- one function per task kind and stage ---------------------------------

  def _plan(self) -> dict:
    """``{kind: [stage j's task function]}``: every static decision of a
    task (its device, routes, what it keeps) taken once, here. A task
    function is ``(state, m, batches) -> TaskResult``; it calls the steps
    through :class:`StageSteps`' lists, so steps replaced in place
    (:meth:`StageSteps.make_hollow`) are seen."""
    J = self.num_stages
    return {FORWARD: [tasks.forward_task(self, j) for j in range(J - 1)],
            BACKWARD: [tasks.backward_task(self, j) for j in range(J - 1)],
            LOSS: [None] * (J - 1) + [self._loss_task(J - 1)],
            BACKPROP: [self._backprop_task]}

  def _feed(self, state: PipelineState, m: int, batches: Batches):
    """Micro-batch ``m``'s images to stage 0, its labels to the last stage
    (no ``device_put`` for an array already there)."""
    images, labels = batches(m)
    first, last = self.placements[0], self.placements[-1]
    state.inbox[0][m] = (transport.send_if_elsewhere(images, first.batch, first.batch_sharding)
                         if self.local[0] else None)
    if self.local[-1]:
      state.labels[m] = transport.send_if_elsewhere(labels, last.batch, last.batch_sharding)

  def _loss_task(self, j: int) -> Callable:
    """The last stage's forward, loss and backward (Alg. 1, l. 27-30)."""
    steps, local, multiprocess = self.steps, self.local[j], self.multiprocess
    send, get = self._send_back(j), tasks.stage_state(self, j)

    def task(state: PipelineState, m: int, batches) -> TaskResult:
      x, loss, dx = take(state.inbox[j], m, "input", j), None, None
      if local:
        labels = take(state.labels, m, "labels", j)
        state.stage_states[j], dx, loss = steps.backward(j, get(state), x, labels)
      state.grad_inbox[j - 1][m] = send(x, dx, m)
      if multiprocess and self.send_losses:  # metrics are written by process 0
        loss = self.messages.move(loss, j, 0, _LOSS_SPEC)
      return TaskResult(loss=loss)
    return task

  def _backprop_task(self, state: PipelineState, m: int, batches) -> TaskResult:
    """``jax.grad`` of the composed model on one device."""
    self._feed(state, m, batches)
    images = take(state.inbox[0], m, "input", 0)
    labels = take(state.labels, m, "labels", 0)
    state.train_states, loss = self.steps.backprop(state.train_states, images, labels)
    return TaskResult(loss=loss)

  def _send_back(self, j: int) -> Optional[Callable]:
    """``(x, dx, m) ->`` ``(y_{j-1} or None, delta_j)`` of micro-batch ``m``
    on stage ``j-1``: its output (this stage's input ``x``, reconstructed
    or buffered) only if it reconstructs. None for stage 0."""
    if j == 0:
      return None
    back = self.reconstructs[j - 1]
    route = self.messages.route("backward", j, j - 1, first=back)
    return lambda x, dx, m: route((x if back else None, dx), m)

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
    specs = self.message_specs(images) if self.multiprocess else [None] * (J + 1)
    x = transport.send(images, self.placements[0].batch) if self.local[0] else None
    for j in range(J):
      if j > 0:
        x = self.messages.move(x, j - 1, j, specs[j])
      if self.local[j]:
        x = self.steps.evaluate(j, state.stage_states[j], x)  # packed or not
    return x if self.local[-1] else None


def _check(stages: Sequence[Stage], method: methods_lib.Method, bn_stats: str) -> None:
  """The constructor's argument checks (see :class:`Pipeline`)."""
  schedule_lib.require_stages(len(stages))
  if stages[0].reversible or stages[-1].reversible:
    raise ValueError("the first stage (input) and the last (loss) cannot be reversible.")
  if bn_stats not in BN_POLICIES:
    raise ValueError(f"Unknown bn_stats policy {bn_stats!r}; choose one of {BN_POLICIES}.")
  methods_lib.require_reversible(method.name, "this model", stage_lib.has_reversible(stages))
