"""The compiled executor: a schedule's steady-state periods as one jitted ``lax.scan``.

The host executor (:meth:`Pipeline.run_tick`) dispatches each task of each
stage on every tick: about two jitted calls per stage and tick, so on an
accelerator the host sets the pace. Here one *period* of the tick table is
traced once into one program, with the very task functions the host executor
calls (their jitted steps inline): for the stream (PETRA and the delayed
methods, paper Alg. 1) one steady-state tick, where every stage runs a
forward and a backward; for a flushed schedule (GPipe, 1F1B, ZB-H1,
revprop's drained round, backprop's step) one whole round, which starts and
ends with nothing in flight. ``N`` periods run as one ``lax.scan``: one
dispatch per ``N`` periods. Filling and draining (ticks unlike the period)
run on the host executor. A call of ``N`` periods returns its carry as the scan left it (the
rings below, :class:`~petra_jax.engine.transport.resident.Resident`): the next call takes it
as it is, and only a read of the state converts it back into plain messages (one jitted call).
The first call from plain messages converts them into rings in a call of its own, so both run
the same scan program (compiled once).

Each iteration of the scan's loop runs ``U`` periods as one (:func:`periods.unrolled`,
:func:`periods.periods_per_iteration`). A value that a tick hands to another carry slot (an
activation to the next stage's inbox, a stored input passed on to the stage below) costs
XLA a copy out of its slot and one into the next at every iteration, because it cannot
order the slot's last read before its new write; between the periods of one iteration
it is a plain value. Fewer copies per tick, a larger program, and ``U - 1`` more slots in
each ring (docs/performance.md). The stage-mesh program (its carry one flat buffer per
device, no rings) unrolls its scan instead.

Why one program is exact: in the steady state, tick ``t`` runs tick ``t0``'s
tasks with every micro-batch shifted by ``s = t - t0`` (a round: by ``k``),
and the messages in flight at its start (activations waiting one tick,
cotangents, kept inputs, stashed weights, labels) are ``t0``'s shifted by
``s``. The scan's carry holds them keyed by ``m - s``, so every period sees
the same keys and the same program runs all of them; after a period the keys
move down by its micro-batches. Whether a state has that shape is checked
once per carry structure by tracing (:func:`jax.eval_shape`), not assumed.

Supported: one process, every stage on one device (or one group of
``data_parallel`` devices), or one stage per device (one SPMD program over a
``stage`` mesh axis, :mod:`petra_jax.engine.stage_mesh`);
every method, unquantised messages, no observers. Anything else raises
:class:`Unsupported` naming what is missing. A task that draws a per-micro-batch key
(``forward_gradient``'s random guesses) reads the run's micro-batch index from the state's
``origin``, which the program takes per period (:func:`needs_origin`).
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp

from petra_jax.engine import schedules as schedule_lib
from petra_jax.engine import stage_mesh
from petra_jax.engine.periods import (ORDER_WRITES, PERIODS_PER_DISPATCH, UNROLL_TICKS, grouped,
                                      period_of, periods_per_iteration, unrolled)
from petra_jax.engine.methods.tasks import TickOutput
from petra_jax.engine.stages import input_checks
from petra_jax.engine.transport import rings
from petra_jax.engine.transport.carry import from_carry, join, split, to_carry, unaliased
from petra_jax.engine.transport.ordered_writes import ordered_writes
from petra_jax.engine.transport.pipeline_state import PipelineState, ScheduleError, period_origins
from petra_jax.engine.transport.resident import Resident

EXECUTORS = ("auto", "compiled", "host")


class Unsupported(ValueError):
  """The compiled executor cannot run this pipeline (the message names what is missing)."""


def unsupported(pipe) -> Optional[str]:
  """Why ``pipe`` cannot run compiled, or None if it can."""
  if pipe.multiprocess:
    return "its stages live in several processes"
  if pipe.observers:
    return "observers (gradient-quality or reconstruction probes) run around every task"
  if pipe.formats.active:
    return "quantised messages (--config.messages.*) draw per-micro-batch rounding keys"
  return _across_devices(pipe)


def needs_origin(pipe) -> bool:
  """Whether ``pipe``'s tasks fold the run's micro-batch index into a key (``forward_gradient``'s
  random guesses): a compiled period then takes its origin, the micro-batch its key 0 is."""
  return pipe.method.updates == "forward_gradient" and pipe.forward_gradient.guess == "random"


def _across_devices(pipe) -> Optional[str]:
  """What the stage-mesh program (:mod:`stage_mesh`) lacks for ``pipe``'s placement, or None
  (one device or one data-parallel group: the one-program executor)."""
  places, J = len(set(pipe.placements)), pipe.num_stages
  if places == 1:
    return None
  if pipe.placements[0].size > 1:
    return (f"its stages are on {places} groups of {pipe.placements[0].size} data-parallel "
            "devices (the stage-mesh program takes one device per stage)")
  if places < J:
    return (f"its {J} stages are on {places} devices (the stage-mesh program runs one stage "
            "per device)")
  return None


def require_supported(pipe) -> None:
  """Raises :class:`Unsupported` (one line, naming the host executor) if ``pipe`` cannot run."""
  why = unsupported(pipe)
  if why is not None:
    raise Unsupported(f"the compiled executor cannot run method {pipe.method.name!r} here: "
                      f"{why}; use --config.executor=host.")


def _shifted(tick, s: int) -> tuple:
  """``tick``'s tasks as plain tuples, micro-batches shifted by ``s`` (equal to the tasks)."""
  return tuple((j, kind, m + s) for j, kind, m in tick)


_from_rings = jax.jit(rings.from_rings)


class Program(NamedTuple):
  """One built program: ``fn(donated, kept, inputs, origins) -> (carry, losses)`` from a plain
  carry (``to_carry``; its two parts: :meth:`CompiledExecutor._arguments`); ``held(ring_carry,
  inputs, origins)``, the same periods from the ring carry a call of ``fn`` or ``held`` returned
  (None for a one-period program, whose carry stays plain); ``mbs``: the frame micro-batches of
  a period's losses. A ring program's ``fn`` is a small jitted conversion into rings, then
  ``held``: one scan program per structure, compiled by the first call."""
  fn: Callable
  held: Optional[Callable]
  mbs: tuple


def _traced_feed(state: PipelineState, m: int, batches) -> None:
  """Stage 0's feed inside the program: micro-batch ``m``'s arrays, on their one device."""
  images, labels = batches(m)
  state.inbox[0][m] = images
  state.labels[m] = labels


class CompiledExecutor:
  """Runs a :class:`Pipeline`'s ticks, its steady-state periods ``N`` at a time in one call.

  Args:
    pipe: a pipeline :func:`unsupported` accepts.
    periods_per_dispatch: ``N``, periods per ``lax.scan`` (a stream's period is one tick).
    unroll_ticks: ticks per iteration of the scan's loop, in whole periods, at least one
      (:func:`periods_per_iteration`).
    order_writes: order each carried slot's new value after the reads of its old one, so that
      XLA updates the carry in place instead of copying it in and out of the loop
      (:func:`~petra_jax.engine.transport.ordered_writes.ordered_writes`; the values are
      the same). The one-device program only: the stage-mesh program has no such copies.

  Raises:
    Unsupported: ``pipe`` cannot run compiled.
    ValueError: ``periods_per_dispatch < 1`` or ``unroll_ticks < 1``.
  """

  name = "compiled"

  def __init__(self, pipe, periods_per_dispatch: int = PERIODS_PER_DISPATCH,
               unroll_ticks: int = UNROLL_TICKS, order_writes: bool = ORDER_WRITES):
    require_supported(pipe)
    for name, value in (("periods_per_dispatch", periods_per_dispatch),
                        ("unroll_ticks", unroll_ticks)):
      if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}.")
    self.pipe, self.n, self.order_writes = pipe, periods_per_dispatch, order_writes
    self.period = period_of(pipe.method.schedule, pipe.num_stages, pipe.accumulation_steps)
    self.unroll = periods_per_iteration(self.period, unroll_ticks, periods_per_dispatch)
    self._family = schedule_lib.family(pipe.method.schedule)
    self._plan = pipe.plan(_traced_feed)
    # The local methods' labels ride beside the activations: the only buffers a carry shares.
    self._labels_ride = pipe.method.updates != "backward"
    self._needs_origin = needs_origin(pipe)
    self.mesh = (stage_mesh.StageMesh(pipe, self.period, self._needs_origin, self.unroll)
                 if len(set(pipe.placements)) > 1 else None)
    self._programs: dict = {}  # (carry treedef, leaf shapes, periods) -> Program or None
    self.dispatches = 0  # compiled calls made (a counter for tests and benchmarks)
    self.conversions = 0  # held ring carries converted back into plain states (the same)

  def describe(self) -> str:
    """One phrase for the run's summary."""
    family = self.pipe.method.schedule
    unit = "rounds" if family.round_size(self.pipe.accumulation_steps) else "ticks"
    where = "" if self.mesh is None else f", one SPMD program over {len(self.mesh.devices)} devices"
    ordered = ", writes ordered" if self.order_writes and self.mesh is None else ""
    return (f"compiled ({self.n} steady-state {unit} per call, {self.unroll} per loop "
            f"iteration{where}{ordered})")

  def _body(self, out_mbs: list) -> Callable:
    """One period: ``(carry, (origin or None, inputs)) -> (carry, losses)``; records the
    losses' micro-batches."""
    period, pipe, plan = self.period, self.pipe, self._plan

    def body(carry, x):
      origin, inputs = x
      state = from_carry(carry, 0, 0, 0 if origin is None else origin)
      batch = dict(zip(period.fed, inputs))
      outputs = []
      for tick in period.ticks:
        outputs += pipe.run_tasks(state, tick, batch.__getitem__, plan)
      out_mbs[:] = [o.micro_batch for o in outputs]
      return to_carry(state, period.shift), tuple(o.loss for o in outputs)
    return body

  def _program(self, carry, inputs, periods: int):
    """The jitted program for ``periods`` periods from ``carry``'s structure, or None if the
    period does not map that structure to itself (not a steady state)."""
    leaves, treedef = jax.tree.flatten(carry)
    key = (treedef, tuple((x.shape, x.dtype) for x in leaves), periods)
    if key not in self._programs:
      self._programs[key] = self._build(carry, inputs, periods)
    return self._programs[key]

  def _build(self, carry, inputs, periods: int):
    out_mbs: list = []
    body = self._body(out_mbs)
    origin = jax.ShapeDtypeStruct((), jnp.int32) if self._needs_origin else None
    try:
      out = jax.eval_shape(body, carry, (origin, inputs[0]))
    except ScheduleError:
      return None
    if jax.tree.structure(out[0]) != jax.tree.structure(carry) or any(
        (a.shape, a.dtype) != (b.shape, b.dtype)
        for a, b in zip(jax.tree.leaves(out[0]), jax.tree.leaves(carry))):
      return None
    mbs = tuple(out_mbs)
    if periods == 1:
      def run_one(donated, kept, inputs_per_period, origins):
        return body(join(donated, kept),
                    (None if origins is None else origins[0], inputs_per_period[0]))
      return Program(jax.jit(run_one, donate_argnums=0), None, mbs)
    u = self.unroll
    iteration = unrolled(self.period, u)  # one iteration of the loop
    reads = rings.read_sets(iteration, self.pipe, self._plan, carry, grouped(inputs, u)[0])
    ring_body = rings.ring_body(iteration, self.pipe, self._plan, reads)
    if self.order_writes:
      ring_body = ordered_writes(ring_body, lambda node: isinstance(node, rings.Ring))

    def run_held(ring_carry, inputs_per_period, origins):
      xs = (None if origins is None else origins[::u],
            jax.tree.map(lambda *a: jnp.stack(a), *grouped(inputs_per_period, u)))
      ring_carry, losses = jax.lax.scan(ring_body, ring_carry, xs, length=periods // u)
      return ring_carry, tuple(loss[i] for i in range(periods // u) for loss in losses)

    held = jax.jit(run_held, donate_argnums=0)
    to_rings = jax.jit(lambda stage_states, boxes: rings.to_rings(
        (stage_states, boxes), reads, iteration.shift), donate_argnums=0)

    def run(stage_states, boxes, inputs_per_period, origins):
      return held(to_rings(stage_states, boxes), inputs_per_period, origins)
    return Program(run, held, mbs)

  def steady_periods(self, schedule, t: int, limit: int,
                     last_micro_batch: Optional[int] = None) -> tuple[int, int]:
    """``(periods, shift)``: how many periods (at most ``N``) from tick ``t`` match the
    period shifted by ``shift + i * period.shift`` micro-batches, end by tick ``limit`` and
    feed no micro-batch after ``last_micro_batch``."""
    P, period = len(self.period.ticks), self.period
    s = self._first_shift(schedule, t)
    if s is None:
      return 0, 0
    last = float("inf") if last_micro_batch is None else last_micro_batch
    last_fed, is_period = max(period.fed, default=-1), self._period_test(schedule)
    count = 0
    while count < self.n and t + (count + 1) * P <= limit:
      shift = s + count * period.shift
      if last_fed + shift > last or not is_period(t + count * P, shift):
        break
      count += 1
    return count, s

  def _knows(self, schedule) -> bool:
    """Whether ``schedule`` says itself which ticks are steady (a :class:`Schedule` or
    :class:`Chained` of this period's family), so that no tick need be built to compare."""
    return getattr(schedule, "family", None) is self._family

  def _first_shift(self, schedule, t: int) -> Optional[int]:
    """The shift of the period that would start at tick ``t``, or None if none can."""
    if self._knows(schedule):
      found = schedule.steady(t)
      return found[1] if found is not None and found[0] == 0 else None
    first = schedule[t] if t < len(schedule) else ()
    if not first or len(first) != len(self.period.ticks[0]):
      return None
    return first[0].micro_batch - self.period.ticks[0][0].micro_batch

  def _period_test(self, schedule) -> Callable[[int, int], bool]:
    """``(t, shift) ->`` whether ticks ``t .. t + P - 1`` of ``schedule`` are the period's,
    shifted by ``shift``."""
    ticks = self.period.ticks
    if self._knows(schedule):
      steady, P = schedule.steady, len(ticks)
      if P == 1:
        return lambda t, shift: steady(t) == (0, shift)
      return lambda t, shift: all(steady(t + u) == (u, shift) for u in range(P))
    return lambda t, shift: all(schedule[t + u] == _shifted(tick, shift)
                                for u, tick in enumerate(ticks))

  def advance(self, state: PipelineState, schedule, t: int, batches,
              limit: Optional[int] = None, last_micro_batch: Optional[int] = None) -> tuple:
    """Runs ticks from ``t`` (``state.tick == t``): ``N`` periods in one call where the table
    and the state are steady, else one tick on the host executor.

    Args:
      schedule: the tick table (``schedule[t]``: tick ``t``'s tasks).
      batches: ``m -> (images float32[B, H, W, C], labels int32[B])``.
      limit: run no tick at or after it (default: the table's end).
      last_micro_batch: feed no micro-batch after it (a compiled call ends there).

    Returns:
      ``(state, outputs, ticks run)``; ``state``'s arrays are donated.
    """
    limit = len(schedule) if limit is None else limit
    periods, s = self.steady_periods(schedule, t, limit, last_micro_batch)
    if periods:
      result = self._run_compiled(state, s, self.n if periods == self.n else 1, batches)
      if result is not None:
        return result
    state, outputs = self.pipe.run_tick(state, schedule[t], batches)
    return state, outputs, 1

  def _run_compiled(self, state: PipelineState, s: int, periods: int, batches):
    if self.mesh is not None:
      result = self.mesh.run(state, s, periods, batches)
      self.dispatches += result is not None
      return result
    period, checked = self.period, input_checks.checked(batches, self.pipe.input_spec)
    inputs = tuple(tuple(checked(m + s + i * period.shift) for m in period.fed)
                   for i in range(periods))
    origins = (period_origins(s, periods, period.shift, self.pipe.placements[0].replicated)
               if self._needs_origin else None)
    claimed = state.claim(self, s) if isinstance(state, Resident) else None
    if claimed is not None and claimed[0].held is not None and periods > 1:
      program, carry = claimed
      state.donate()
      carry, losses = program.held(carry, inputs, origins)
    else:
      carry = to_carry(state, s)
      program = self._program(carry, inputs, periods)
      if program is None:
        return None
      carry, losses = program.fn(*self._arguments(program, carry), inputs, origins)
    self.dispatches += 1
    return self._result(state.tick, program, carry, losses, s, periods)

  def _arguments(self, program: "Program", carry: tuple) -> tuple:
    """``(donated, kept)``: a ring program's are ``carry``'s stage states and boxes (it donates
    the stage states only: its boxes become rings, which no input buffer can hold); a
    one-period program donates all but what the caller fed (``split``)."""
    if program.held is not None:
      return carry
    donated, kept = split(carry)
    return (unaliased(donated, kept) if self._labels_ride else donated), kept

  def _result(self, tick: int, program: "Program", carry, losses, s: int, periods: int):
    """``(state, outputs, ticks)`` of a call that ran ``periods`` periods from shift ``s``."""
    period, mbs = self.period, program.mbs
    end = s + periods * period.shift
    outputs = [TickOutput(m + s + i * period.shift, losses[i * len(mbs) + q])
               for i in range(periods) for q, m in enumerate(mbs)]
    ticks = periods * len(period.ticks)
    if program.held is None:
      return from_carry(carry, end, tick + ticks), outputs, ticks
    return Resident(self, program, carry, end, tick + ticks,
                    lambda: self._convert(carry, end, tick + ticks)), outputs, ticks

  def _convert(self, ring_carry, s: int, tick: int) -> PipelineState:
    """A held ring carry as a plain :class:`PipelineState` (one jitted call)."""
    self.conversions += 1
    return from_carry(_from_rings(ring_carry), s, tick)


class HostExecutor:
  """Today's loop behind :meth:`CompiledExecutor.advance`'s interface: one tick per call."""

  name = "host"

  def __init__(self, pipe, why_not_compiled: Optional[str] = None):
    self.pipe, self.why_not_compiled = pipe, why_not_compiled

  def describe(self) -> str:
    """One phrase for the run's summary."""
    why = self.why_not_compiled
    return "host (a jitted call per task)" + (f"; not compiled: {why}" if why else "")

  def advance(self, state: PipelineState, schedule, t: int, batches,
              limit: Optional[int] = None, last_micro_batch: Optional[int] = None) -> tuple:
    """Runs tick ``t`` with :meth:`Pipeline.run_tick`: ``(state, outputs, 1)``."""
    del limit, last_micro_batch
    state, outputs = self.pipe.run_tick(state, schedule[t], batches)
    return state, outputs, 1


def executor(pipe, name: str = "auto", periods_per_dispatch: int = PERIODS_PER_DISPATCH,
             unroll_ticks: int = UNROLL_TICKS, order_writes: bool = ORDER_WRITES):
  """The executor called ``name`` (:data:`EXECUTORS`) for ``pipe`` (the last three arguments:
  :class:`CompiledExecutor`'s).

  ``auto``: compiled on an accelerator where :func:`unsupported` finds nothing missing, else
  host. On the CPU, XLA lays out one program holding every stage worse than it lays out each
  step alone (transposes; inside the scan, slow convolutions): there the host executor is the
  faster one for any model whose steps outweigh their dispatch (docs/performance.md).

  Raises:
    Unsupported: ``compiled`` for a pipeline it cannot run.
    ValueError: an unknown name.
  """
  if name not in EXECUTORS:
    raise ValueError(f"Unknown executor {name!r}; choose one of {EXECUTORS}.")
  if name == "host":
    return HostExecutor(pipe)
  if name == "auto" and unsupported(pipe) is not None:
    return HostExecutor(pipe, unsupported(pipe))
  if name == "auto" and pipe.devices[0].platform == "cpu":
    return HostExecutor(pipe, "on the CPU the host executor is faster (--config.executor="
                              "compiled to choose it)")
  return CompiledExecutor(pipe, periods_per_dispatch, unroll_ticks, order_writes)
