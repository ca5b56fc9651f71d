"""The compiled executor across devices: steady periods as one SPMD program.

Stage ``j`` lives on device ``j`` of a ``stage`` mesh axis (one process, one stage per
device). One program runs on every device (``jax.shard_map``): ``lax.switch`` on
``lax.axis_index("stage")`` runs that device's stage with the very task functions the host
executor calls (their jitted steps inline, paper Alg. 1: a forward on the newest micro-batch, a
reconstructing backward, Eq. 5, on an older one); ``lax.ppermute`` moves the activations
forward (``j -> j + 1``) and the cotangent messages ``(x~ or None, delta)`` back
(``j -> j - 1``) after every tick, as on the host; ``lax.scan`` runs ``N`` periods per
dispatch. A period is the stream's steady tick (PETRA, the delayed and the local methods) or a
flushed schedule's whole round (GPipe, 1F1B, ZB-H1, revprop), its ticks unrolled; a message
that arrives before the tick that consumes it (a round's cotangent) waits on its device.
Stages differ (stem, reversible blocks, head), so what a device carries is packed into a
layout common to every device (:func:`packing.padded`: one flat buffer per dtype, padded to
the largest stage): ``local`` (its stage state, the inputs or weights it keeps, the last
stage's labels, the messages that wait), ``fwd`` (the activation that arrived) and ``bwd``
(the cotangent that arrived); each tick of a round has its own layouts. Keys are a period's
frame, ``m - s``, as in :mod:`petra_jax.engine.compiled`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from petra_jax.engine import schedules as schedule_lib
from petra_jax.engine.arrays import packing
from petra_jax.engine.methods.tasks import TickOutput
from petra_jax.engine.stages import input_checks
from petra_jax.engine.transport.pipeline_state import PipelineState, ScheduleError, period_origins
from petra_jax.engine.transport.resident import Resident
from petra_jax.engine.transport.rings import rekey

AXIS = "stage"
_KEPT = ("buffers", "weight_stash")  # per-stage boxes a stage keeps over ticks
_WAITING = ("waiting_fwd", "waiting_bwd")  # messages that arrived and wait (a round's)


class Part(NamedTuple):
  """Stage ``j``'s share of a :class:`PipelineState` at a period's start, keyed ``m - s``.

  ``local``: ``(stage state, {box: {m: payload}})`` (its kept inputs and weights; the last
  stage's labels); ``fwd``: its inbox ``{m: x_j}``; ``bwd``: its grad_inbox
  ``{m: (x~_{j+1} or None, delta_{j+1})}``.
  """
  local: tuple
  fwd: dict
  bwd: dict


def split(state: PipelineState, s: int) -> list[Part]:
  """Each stage's :class:`Part` of ``state``, keys moved by ``-s`` (no array touched)."""
  J, parts = len(state.stage_states), []
  for j in range(J):
    kept = {name: rekey(getattr(state, name)[j], -s) for name in _KEPT}
    kept.update({name: {} for name in _WAITING})
    if j == J - 1:
      kept["labels"] = rekey(state.labels, -s)
    parts.append(Part((state.stage_states[j], kept), rekey(state.inbox[j], -s),
                      rekey(state.grad_inbox[j], -s)))
  return parts


def join(parts: list[Part], s: int, tick: int) -> PipelineState:
  """The :class:`PipelineState` at ``tick`` whose stages' shares are ``parts`` keyed ``m - s``."""
  state = PipelineState.empty([p.local[0] for p in parts], tick)
  for j, p in enumerate(parts):
    for name in _KEPT:
      getattr(state, name)[j] = rekey(p.local[1][name], s)
    state.inbox[j] = rekey({**p.local[1][_WAITING[0]], **p.fwd}, s)
    state.grad_inbox[j] = rekey({**p.local[1][_WAITING[1]], **p.bwd}, s)
  state.labels = rekey(parts[-1].local[1]["labels"], s)
  return state


def _plain(part: Part) -> Part:
  """``part`` with a packed stage state unpacked (inside a trace: static slices)."""
  st, kept = part.local
  st = st.unpacked() if isinstance(st, packing.PackedState) else st
  return Part((st, kept), part.fwd, part.bwd)


def _signature(parts: list[Part]) -> tuple:
  """What a program depends on: the parts' plain structures, shapes and dtypes (a packed
  stage state read from its packer, so packed and plain states share one program)."""
  def one(tree):
    leaves, treedef = jax.tree.flatten(tree)
    return treedef, tuple((tuple(a.shape), np.dtype(a.dtype)) for a in leaves)
  out = []
  for part in parts:
    st, kept = part.local
    if isinstance(st, packing.PackedState):
      k = st.packer
      st = (k.treedef, tuple((shape, k.dtypes[g]) for shape, (g, _, _) in zip(k.shapes, k.slots)))
    else:
      st = one(st)
    out.append((st, one((kept, part.fwd, part.bwd))))
  return tuple(out)


def _values(box: dict) -> tuple:
  return tuple(box[m] for m in sorted(box))


@dataclasses.dataclass(frozen=True)
class Layout:
  """Stage ``j``'s three layouts (:class:`packing.Padded`) and its arriving messages' keys."""
  local: packing.Padded
  fwd: packing.Padded
  bwd: packing.Padded
  fwd_keys: tuple
  bwd_keys: tuple

  def pack(self, part: Part) -> tuple:
    """``(local, fwd, bwd)`` buffers of ``part`` (a jitted conversion's body)."""
    part = _plain(part)
    return (self.local.pack(part.local), self.fwd.pack(_values(part.fwd)),
            self.bwd.pack(_values(part.bwd)))

  def unpack(self, local: tuple, fwd: tuple, bwd: tuple) -> Part:
    """The :class:`Part` the three buffers hold."""
    return Part(self.local.unpack(local), dict(zip(self.fwd_keys, self.fwd.unpack(fwd))),
                dict(zip(self.bwd_keys, self.bwd.unpack(bwd))))


def layouts(parts: list[Part]) -> list[Layout]:
  """Every stage's :class:`Layout` from its (abstract, plain) part.

  Raises:
    ValueError: a leaf of an extended dtype (:func:`packing.padded`).
  """
  local = packing.padded([p.local for p in parts])
  fwd = packing.padded([_values(p.fwd) for p in parts])
  bwd = packing.padded([_values(p.bwd) for p in parts])
  return [Layout(a, b, c, tuple(sorted(p.fwd)), tuple(sorted(p.bwd)))
          for a, b, c, p in zip(local, fwd, bwd, parts)]


def _same(a, b) -> bool:
  """Whether two pytrees have one structure and leaves of one shape and dtype."""
  return jax.tree.structure(a) == jax.tree.structure(b) and all(
      (x.shape, x.dtype) == (y.shape, y.dtype)
      for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


class Program(NamedTuple):
  """One built stage-mesh program: ``fn``, each stage's ``layouts`` and jitted ``packs`` /
  ``unpacks``, the frame micro-batches of a period's losses (``mbs``), and the plain parts
  (``abstract``, ``jax.ShapeDtypeStruct`` leaves) its carry holds at a period's start."""
  fn: Callable
  layouts: list
  packs: list
  unpacks: list
  mbs: tuple
  abstract: list


def _feed_images(state: PipelineState, m: int, batches) -> None:
  """Stage 0's feed inside the program: micro-batch ``m``'s images only (the last stage's
  branch takes the labels of the same tick itself, :meth:`StageMesh.stage_tick`)."""
  state.inbox[0][m] = batches(m)


def _zeros_of(layout: packing.Padded) -> tuple:
  """The buffers of ``layout`` holding nothing (what an edge device sends past the edge)."""
  return tuple(jnp.zeros((size,), dtype) for dtype, size in zip(layout.dtypes, layout.sizes))


class StageMesh:
  """The steady periods of ``pipe`` (one stage per device) as one SPMD program.

  Args:
    pipe: a pipeline whose ``J`` stages are on ``J`` distinct devices of this process.
    period: its schedule's period (:class:`petra_jax.engine.periods.Period`: the stream's
      steady tick, or a flushed schedule's round).
    needs_origin: whether its tasks draw per-micro-batch keys (every device then gets each
      period's :attr:`PipelineState.origin`).
    unroll: periods per iteration of the scan's loop (``lax.scan``'s ``unroll``): a device's
      local buffer is copied once per iteration, not once per period.
  """

  def __init__(self, pipe, period, needs_origin: bool = False, unroll: int = 1):
    self.pipe, self.period, self.needs_origin = pipe, period, needs_origin
    self.unroll = unroll
    self.devices = list(pipe.devices)
    self.mesh = Mesh(np.array(self.devices), (AXIS,))
    self.sharding = NamedSharding(self.mesh, P(AXIS))
    self._plan = pipe.plan(_feed_images, in_program=True)
    # Where a fed micro-batch's labels go: the last stage; for the local methods (a loss on
    # every stage, paper App. C) stage 0 too, which sends them on with the activations.
    J = pipe.num_stages
    self.labels_home = (J - 1,) if pipe.method.updates == "backward" else (0, J - 1)
    self._programs: dict = {}  # (parts' structure, leaf shapes, periods) -> Program or None
    self._zeros: dict = {}
    self.conversions = 0  # jitted calls outside the program: a part packed or unpacked

  def stage_tick(self, j: int, u: int, part: Part, images: tuple, labels: tuple, origin=None,
                 mbs: Optional[list] = None) -> tuple:
    """Stage ``j``'s tasks of tick ``u`` of the period on its plain ``part``, fed ``images``
    and ``labels`` (one per micro-batch the period feeds; ``origin``: the period's
    :attr:`PipelineState.origin`, or None for 0): ``(local after, {m: x_{j+1}} to
    j + 1, {m: (x~_j or None, delta_j)} to j - 1, [float32 losses])``, keys moved by
    ``-shift`` after the period's last tick; ``mbs`` receives the losses' frame micro-batches.
    A message that arrived and waits for a later tick (a round's) stays in ``local``.

    Raises:
      ScheduleError: a task's message has not arrived.
    """
    J, period, (st, kept) = self.pipe.num_stages, self.period, part.local
    state = PipelineState.empty([None] * J)
    state.stage_states[j], state.origin = st, 0 if origin is None else origin
    for name in _KEPT:
      getattr(state, name)[j] = dict(kept[name])
    fed = {m: q for q, m in enumerate(period.fed) if m == schedule_lib.fed(period.ticks[u])}
    if j == J - 1:  # what the host's feed sends the last stage on this tick
      state.labels = {**kept["labels"], **{m: labels[q] for m, q in fed.items()}}
    elif j == 0 and self.labels_home[0] == 0:  # local losses: stage 0 sends them on
      state.labels = {m: labels[q] for m, q in fed.items()}
    state.inbox[j] = {**kept[_WAITING[0]], **part.fwd}
    state.grad_inbox[j] = {**kept[_WAITING[1]], **part.bwd}
    mine = tuple(task for task in period.ticks[u] if task.stage == j)
    outputs = self.pipe.run_tasks(state, mine, {m: images[q] for m, q in fed.items()}.__getitem__,
                                  self._plan)
    s = period.shift if u == len(period.ticks) - 1 else 0
    kept = {name: rekey(getattr(state, name)[j], -s) for name in _KEPT}
    kept[_WAITING[0]] = rekey(state.inbox[j], -s)
    kept[_WAITING[1]] = rekey(state.grad_inbox[j], -s)
    if j == J - 1:
      kept["labels"] = rekey(state.labels, -s)
    if mbs is not None:
      mbs[:] = [o.micro_batch for o in outputs]
    return ((state.stage_states[j], kept), rekey(state.inbox[j + 1], -s) if j < J - 1 else {},
            rekey(state.grad_inbox[j - 1], -s) if j > 0 else {},
            [o.loss.astype(jnp.float32) for o in outputs])

  def _trace(self, parts: list, x: tuple) -> Optional[tuple]:
    """``(layouts per tick boundary, losses per tick, frame micro-batches of the losses)`` of
    one period from ``parts`` (abstract), or None if it does not map every stage's share to
    the same structure (not a steady state) or a task's message is missing."""
    J, boundaries, counts, mbs = len(parts), [parts], [], []
    for u in range(len(self.period.ticks)):
      outs = []
      for j in range(J):
        seen: list = []
        try:
          outs.append(jax.eval_shape(functools.partial(self.stage_tick, j, u, mbs=seen),
                                     boundaries[-1][j], *x))
        except ScheduleError:
          return None
        if j == J - 1:
          counts.append(len(seen))
          mbs += seen
      boundaries.append([Part(outs[j][0], outs[j - 1][1] if j > 0 else {},
                              outs[j + 1][2] if j < J - 1 else {}) for j in range(J)])
    if not all(_same(a, b) and sorted(a.fwd) == sorted(b.fwd) and sorted(a.bwd) == sorted(b.bwd)
               for a, b in zip(boundaries[-1], parts)):
      return None
    return [layouts(b) for b in boundaries[:-1]], counts, tuple(mbs)

  def _branch(self, j: int, u: int, lays: list, following: list, num_losses: int) -> Callable:
    """Device ``j``'s tick ``u`` on its flat buffers (``lays``: the tick's layouts;
    ``following``: the next tick's): ``(local, fwd, bwd, x) -> (local, to j + 1, to j - 1,
    float32[num_losses])``, messages packed in the receiver's layout."""
    J, lay = len(lays), lays[j]

    def branch(local, fwd, bwd, x):
      local, ahead, back, losses = self.stage_tick(j, u, lay.unpack(local, fwd, bwd), *x)
      ahead = (following[j + 1].fwd.pack(_values(ahead)) if j < J - 1
               else _zeros_of(following[0].fwd))
      back = (following[j - 1].bwd.pack(_values(back)) if j > 0
              else _zeros_of(following[0].bwd))
      losses = jnp.stack(losses) if losses else jnp.zeros((num_losses,), jnp.float32)
      return following[j].local.pack(local), ahead, back, losses
    return branch

  def _program_fn(self, ticks: list, counts: list, periods: int) -> Callable:
    """The jitted program: ``periods`` periods of every stage, ``(carry, images, labels,
    origins int32[periods] or None) -> (carry, losses)``; the carry (``(local, fwd, bwd)``, global ``dtype[J * size]`` buffers
    sharded on the stage axis) donated; ``sum(counts) * periods`` float32 scalars. Within a
    period the ticks are unrolled, each a ``lax.switch`` on the stage and two ``ppermute``s
    (``ticks[u]``: the layouts at tick ``u``'s start; the period's end is its start)."""
    J, U = len(ticks[0]), len(ticks)
    branches = [[self._branch(j, u, ticks[u], ticks[(u + 1) % U], counts[u]) for j in range(J)]
                for u in range(U)]
    ahead, back = [(j, j + 1) for j in range(J - 1)], [(j + 1, j) for j in range(J - 1)]

    def per_device(local, fwd, bwd, images, labels, origins):
      stage = jax.lax.axis_index(AXIS)

      def body(carry, x):
        losses = []
        for u in range(U):
          local, fwd, bwd, tick_losses = jax.lax.switch(stage, branches[u], *carry, x)
          carry = (local, tuple(jax.lax.ppermute(b, AXIS, ahead) for b in fwd),
                   tuple(jax.lax.ppermute(b, AXIS, back) for b in bwd))
          losses.append(tick_losses)
        return carry, jnp.concatenate(losses)
      xs = (*jax.tree.map(lambda *a: jnp.stack(a), *zip(images, labels)), origins)
      carry, losses = jax.lax.scan(body, (local, fwd, bwd), xs, length=periods,
                                   unroll=min(self.unroll, periods))
      return (*carry, jax.lax.psum(jnp.where(stage == J - 1, losses, 0.0), AXIS))

    mapped = jax.shard_map(per_device, mesh=self.mesh, in_specs=(P(AXIS),) * 5 + (P(),),
                           out_specs=(P(AXIS),) * 3 + (P(),), check_vma=False)
    n = sum(counts)

    def run(carry, images, labels, origins):
      *carry, losses = mapped(*carry, images, labels, origins)
      return tuple(carry), tuple(losses[i, q] for i in range(periods) for q in range(n))
    return jax.jit(run, donate_argnums=0)

  def _program(self, parts: list, x: tuple, periods: int) -> Optional[Program]:
    """The :class:`Program` for ``parts``' structure (built once), or None if not steady."""
    key = (_signature(parts), jax.tree.map(lambda a: (a.shape, a.dtype), x), periods)
    if key not in self._programs:
      abstract = jax.eval_shape(lambda p: [_plain(q) for q in p], parts)
      traced = self._trace(abstract, x)
      if traced is None:
        self._programs[key] = None
      else:
        ticks, counts, mbs = traced
        lays = ticks[0]
        self._programs[key] = Program(
            self._program_fn(ticks, counts, periods), lays,
            [jax.jit(lay.pack) for lay in lays], [jax.jit(lay.unpack) for lay in lays], mbs,
            abstract)
    return self._programs[key]

  def _global(self, x: jax.Array, homes: tuple) -> jax.Array:
    """``x [B, ...]`` as the shard of devices ``homes`` of a ``[J * B, ...]`` array on the
    stage axis (zeros, allocated once, on the other devices; nothing copied)."""
    placed = {self.devices[h]: jax.device_put(x, self.devices[h]) for h in homes}
    shards = []
    for device in self.devices:
      if device in placed:
        shards.append(placed[device])
        continue
      key = (x.shape, x.dtype, device)
      if key not in self._zeros:
        self._zeros[key] = jax.device_put(np.zeros(x.shape, x.dtype), device)
      shards.append(self._zeros[key])
    return jax.make_array_from_single_device_arrays(
        (len(self.devices) * x.shape[0], *x.shape[1:]), self.sharding, shards)

  def _to_global(self, program: Program, parts: list) -> tuple:
    """The program's carry: each stage's part packed on its device, the shards joined."""
    per_stage = [pack(part) for pack, part in zip(program.packs, parts)]
    self.conversions += len(parts)
    return tuple(tuple(jax.make_array_from_single_device_arrays(
        (len(parts) * bufs[0].shape[0],), self.sharding, list(bufs))
        for bufs in zip(*(stage[kind] for stage in per_stage)))
        for kind in range(3))

  def unpack(self, program: Program, carry: tuple) -> list[Part]:
    """Each stage's :class:`Part` from the program's carry (its shards unpacked)."""
    shards = [[{s.device: s.data for s in a.addressable_shards} for a in kind] for kind in carry]
    self.conversions += len(self.devices)
    return [unpack(*(tuple(by[d] for by in kind) for kind in shards))
            for unpack, d in zip(program.unpacks, self.devices)]

  def run(self, state: PipelineState, s: int, periods: int, batches) -> Optional[tuple]:
    """``periods`` steady periods from ``state`` (keys ``m - s``) in one call.

    Args:
      batches: ``m -> (images [B, ...], labels [B, ...])``.

    Returns:
      ``(state, outputs, ticks)``, or None where the state is not steady (nothing ran).
    """
    period = self.period
    checked = input_checks.checked(batches, self.pipe.input_spec)
    fed = [[checked(m + s + i * period.shift) for m in period.fed] for i in range(periods)]
    x = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype),
                     (tuple(f[0] for f in fed[0]), tuple(f[1] for f in fed[0])))
    x += (jax.ShapeDtypeStruct((), jnp.int32) if self.needs_origin else None,)
    # The carry the last call left, if nobody read it since: taken as it is.
    claimed = state.claim(self, s) if isinstance(state, Resident) else None
    parts = None if claimed else split(state, s)
    program = self._program(claimed[0].abstract if claimed else parts, x, periods)
    if program is None:
      return None
    carry = claimed[1] if claimed else self._to_global(program, parts)
    images = tuple(tuple(self._global(f[0], (0,)) for f in row) for row in fed)
    labels = tuple(tuple(self._global(f[1], self.labels_home) for f in row) for row in fed)
    if claimed is not None:
      state.donate()
    origins = (period_origins(s, periods, period.shift, NamedSharding(self.mesh, P()))
               if self.needs_origin else None)
    carry, losses = program.fn(carry, images, labels, origins)
    n = len(program.mbs)
    outputs = [TickOutput(m + s + i * period.shift, losses[i * n + q])
               for i in range(periods) for q, m in enumerate(program.mbs)]
    ticks = periods * len(period.ticks)
    end = s + periods * period.shift
    tick = state.tick + ticks
    return Resident(self, program, carry, end, tick,
                    lambda: join(self.unpack(program, carry), end, tick)), outputs, ticks
