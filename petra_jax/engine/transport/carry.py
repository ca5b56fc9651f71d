"""The plain carry of a compiled call: a :class:`PipelineState`'s stage states and message
boxes as one pytree, keyed by the period's frame, and the part of it a call may donate."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from petra_jax.engine.transport import rings
from petra_jax.engine.transport.pipeline_state import PipelineState


def to_carry(state: PipelineState, s: int) -> tuple:
  """``(stage_states, boxes)`` with every box keyed by ``m - s`` (a pytree)."""
  boxes = {}
  for name, per_stage in rings.BOXES:
    box = getattr(state, name)
    boxes[name] = [rings.rekey(b, -s) for b in box] if per_stage else rings.rekey(box, -s)
  return list(state.stage_states), boxes


def from_carry(carry: tuple, s: int, tick: int, origin=0) -> PipelineState:
  """The :class:`PipelineState` at ``tick`` of ``carry`` keyed by ``m - s`` (``origin``: the
  micro-batch of key 0, for the tasks that draw keys)."""
  stage_states, boxes = carry
  fields = {name: [rings.rekey(b, s) for b in boxes[name]] if per_stage
            else rings.rekey(boxes[name], s)
            for name, per_stage in rings.BOXES}
  return PipelineState(stage_states=list(stage_states), tick=tick, origin=origin, **fields)


def split(carry: tuple) -> tuple:
  """``(donated, kept)``: what the caller fed is not donated (it may feed one array for
  several micro-batches): the labels, and stage 0's kept inputs (its buffered images)."""
  stage_states, boxes = carry
  rest = {k: v for k, v in boxes.items() if k not in ("labels", "buffers")}
  return ((stage_states, rest, boxes["buffers"][1:]),
          (boxes["labels"], boxes["buffers"][0]))


_copies = jax.jit(lambda leaves: [jnp.copy(x) for x in leaves])


def _buffers(leaf) -> tuple:
  return tuple(shard.data.unsafe_buffer_pointer() for shard in leaf.addressable_shards)


def unaliased(donated, kept):
  """``donated`` with a copy of every leaf whose buffer another leaf of ``donated`` or ``kept``
  also holds (one call for all): a donated buffer must appear once in a call. The local
  methods carry each micro-batch's labels beside its activation, the array the caller fed."""
  seen = {b for leaf in jax.tree.leaves(kept) for b in _buffers(leaf)}
  leaves, treedef = jax.tree.flatten(donated)
  shared = []
  for i, leaf in enumerate(leaves):
    buffers = _buffers(leaf)
    if seen.intersection(buffers):
      shared.append(i)
    seen.update(buffers)
  if shared:
    for i, copy in zip(shared, _copies([leaves[i] for i in shared])):
      leaves[i] = copy
  return jax.tree.unflatten(treedef, leaves)


def join(donated: tuple, kept: tuple) -> tuple:
  """The carry :func:`split` split."""
  (stage_states, rest, later_buffers), (labels, first_buffer) = donated, kept
  return stage_states, {**rest, "labels": labels, "buffers": [first_buffer, *later_buffers]}
