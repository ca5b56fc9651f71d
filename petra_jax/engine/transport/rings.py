"""Ring buffers for the compiled executor's scan carry (:mod:`petra_jax.engine.compiled`).

Between periods the carry keys every message by ``m - s``; a message held over a period then
moves to a new slot of the carry, and XLA implements a moved loop-carried value as a copy of the
whole array (on an H200, 1.4-2.3 ms of copies per RevNet18 tick at micro-batch 256:
docs/performance.md). Inside the scan each box holding several messages is therefore one stacked
array, a :class:`Ring`: the message of (start-frame) micro-batch ``m`` sits in slot ``m mod R``
and never moves; a period writes the slots it fills in place, and the messages the next period
reads are read at the end of this one, after the writes, so that every read depends on every
write into its ring (reads inside the period could run after a write, which forces XLA to copy
the ring).
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from petra_jax.engine.transport.pipeline_state import PipelineState, message_fields

BOXES = tuple((f.name, f.metadata["messages"] == "per_stage") for f in message_fields())


def rekey(box: dict, s: int) -> dict:
  """``box`` with every micro-batch key moved by ``s``."""
  return {m + s: v for m, v in box.items()}


@jax.tree_util.register_pytree_node_class
class Ring:
  """A box's messages stacked: ``data`` leaves ``[R, ...]``; ``keys`` the micro-batches (in a
  period's own frame) held at a period's start; slot of ``m`` is ``(m + offset) mod R``."""

  def __init__(self, data, keys: tuple, size: int):
    self.data, self.keys, self.size = data, keys, size

  def tree_flatten(self):
    return (self.data,), (self.keys, self.size)

  @classmethod
  def tree_unflatten(cls, aux, children):
    return cls(children[0], *aux)


def _ringable(box) -> bool:
  """Several messages of one shape: worth a ring (one message is consumed, not moved)."""
  if not isinstance(box, dict) or len(box) < 2:
    return False
  shapes = {(jax.tree.structure(v), tuple((x.shape, x.dtype) for x in jax.tree.leaves(v)))
            for v in box.values()}
  return len(shapes) == 1


def to_ring(box: dict, shift: int):
  """``box`` (keys in the start frame) as a :class:`Ring`, or ``box`` if not worth one."""
  if not _ringable(box):
    return box
  keys = tuple(sorted(box))
  size = keys[-1] - keys[0] + 1 + shift  # every key alive during one period, none sharing a slot
  slots = [None] * size
  for m, v in box.items():
    slots[m % size] = v
  like = box[keys[0]]
  slots = [jax.tree.map(jnp.zeros_like, like) if v is None else v for v in slots]
  return Ring(jax.tree.map(lambda *a: jnp.stack(a), *slots), keys, size)


def from_ring(box, offset) -> dict:
  """The messages of a :class:`Ring` after ``offset`` micro-batches (an int or a traced int32
  scalar), keyed as at its start."""
  if not isinstance(box, Ring):
    return box
  return {m: jax.tree.map(lambda a, m=m: a[(m + offset) % box.size], box.data)
          for m in box.keys}


_UNREAD = object()  # a ring's message that a period does not read (the probe trace showed it)


class _Recording(dict):
  """A box that records the micro-batches a period reads or takes from it."""

  def __init__(self, box: dict, seen: set):
    super().__init__(box)
    self.seen = seen

  def __getitem__(self, m):
    self.seen.add(m)
    return super().__getitem__(m)

  def get(self, m, default=None):
    self.seen.add(m)
    return super().get(m, default)

  def pop(self, m, *default):
    self.seen.add(m)
    return super().pop(m, *default)


def views(boxes: dict, make: Callable) -> dict:
  """``{name: make(box, (name, stage))}`` over every message box (per stage or last stage)."""
  return {name: [make(b, (name, j)) for j, b in enumerate(boxes[name])] if per_stage
          else make(boxes[name], (name, None)) for name, per_stage in BOXES}


def read(ring, wanted: set, offset) -> dict:
  """``{m: message}`` of a :class:`Ring`'s ``wanted`` keys, micro-batch ``m`` read from slot
  ``(m + offset) mod R``; ``{}`` for a dict box."""
  if not isinstance(ring, Ring):
    return {}
  return {m: jax.tree.map(lambda a, m=m: jax.lax.dynamic_index_in_dim(
      a, (m + offset) % ring.size, keepdims=False), ring.data) for m in ring.keys if m in wanted}


def _writes(ring, opened: dict, box: dict, shift: int) -> list:
  """The ``(m, message)`` of ``box`` (a period's end) that ``ring`` must take: those
  ``opened`` (its start) did not hold; an untouched message stays in its slot."""
  if not isinstance(ring, Ring):
    return []
  assert sorted(box) == [m + shift for m in ring.keys], "not a steady state"
  return [(m, v) for m, v in sorted(box.items()) if opened.get(m) is not v]


def _close_ring(ring, writes: list, box: dict, offset, shift: int):
  """``ring`` with ``writes`` in their slots; a dict box re-keyed by ``-shift``."""
  if not isinstance(ring, Ring):
    return rekey(box, -shift)
  data = ring.data
  for m, v in writes:
    data = jax.tree.map(lambda a, x, m=m: jax.lax.dynamic_update_index_in_dim(
        a, x, (m + offset) % ring.size, 0), data, v)
  return Ring(data, ring.keys, ring.size)


def read_sets(period, pipe, plan, carry, inputs) -> dict:
  """``{(box name, stage or None): micro-batches}`` one period reads or takes from each box,
  found by tracing it once abstractly on ``carry`` (keys as at a period's start)."""
  seen: dict = {}

  def probe(carry, inputs):
    stage_states, boxes = carry
    recording = views(boxes, lambda b, key: _Recording(b, seen.setdefault(key, set())))
    state = PipelineState(stage_states=list(stage_states), tick=0, **recording)
    batch = dict(zip(period.fed, inputs))
    return [pipe.run_tasks(state, tick, batch.__getitem__, plan) and None
            for tick in period.ticks]
  jax.eval_shape(probe, carry, inputs)
  return seen


def ring_body(period, pipe, plan, reads: dict) -> Callable:
  """One period on a carry ``(stage_states, boxes, ahead, offset)`` and ``(origin or None,
  inputs)`` (:func:`petra_jax.engine.compiled.needs_origin`): ``boxes`` may be rings,
  ``ahead`` holds the ring messages the period reads (``reads``, :func:`read_sets`), read at
  the end of the period before. Reading them there, after the writes, makes each read depend
  on every write into its ring: XLA then updates the ring in place instead of copying it whole
  (reads inside the period could run after a write, which forces the copy)."""

  def body(carry, x):
    (stage_states, boxes, ahead, offset), (origin, inputs) = carry, x
    opened = _zipviews(_opened, boxes, ahead)
    state = PipelineState(stage_states=list(stage_states), tick=0,
                          origin=0 if origin is None else origin,
                          **views(opened, lambda b, key: dict(b)))
    batch = dict(zip(period.fed, inputs))
    outputs = []
    for tick in period.ticks:
      outputs += pipe.run_tasks(state, tick, batch.__getitem__, plan)
    ends = views(boxes, lambda b, key: _entry(getattr(state, key[0]), key[1]))
    closed = _zipviews(lambda r, o, e: _close_ring(
        r, _writes(r, o, e, period.shift), e, offset, period.shift), boxes, opened, ends)
    following = offset + period.shift
    ahead = views(closed, lambda b, key: read(b, reads.get(key, set()), following))
    return ((list(state.stage_states), closed, ahead, following),
            tuple(o.loss for o in outputs))
  return body


def _entry(box, stage):
  return box if stage is None else box[stage]


def _zipviews(fn: Callable, *trees: dict) -> dict:
  """``fn`` over the matching boxes of several :func:`views`-shaped dicts."""
  return {name: [fn(*xs) for xs in zip(*(t[name] for t in trees))] if per_stage
          else fn(*(t[name] for t in trees)) for name, per_stage in BOXES}


def _opened(box, ahead: dict) -> dict:
  """A period's start view of ``box``: a ring's messages read ahead, :data:`_UNREAD` for the
  rest (the period does not read them); a dict box as it is."""
  if not isinstance(box, Ring):
    return box
  return {m: ahead.get(m, _UNREAD) for m in box.keys}


def to_rings(carry, reads: dict, shift: int) -> tuple:
  """``carry`` ``(stage_states, boxes)`` (keys as at a period's start) as :func:`ring_body`'s
  ``(stage_states, rings, ahead, offset)``: each box worth it a :class:`Ring` whose key 0
  sits in slot 0, the messages the first period reads (``reads``) read ahead."""
  stage_states, boxes = carry
  rings = views(boxes, lambda b, key: to_ring(b, shift))
  ahead = views(rings, lambda b, key: read(b, reads.get(key, set()), 0))
  return stage_states, rings, ahead, jnp.int32(0)


def from_rings(ring_carry: tuple) -> tuple:
  """``(stage_states, boxes)`` of :func:`ring_body`'s carry, keys as at the next period's start:
  each ring's messages read from their slots at the carry's (traced) offset."""
  stage_states, rings, _, offset = ring_carry
  return stage_states, views(rings, lambda b, key: from_ring(b, offset))
