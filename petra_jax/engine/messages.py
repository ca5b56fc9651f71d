"""Messages between stages: their format, their shapes and their move.

A payload a stage sends (``forward``: its output, to stage ``j+1``;
``backward``: ``(y_{j-1} or None, delta_j)``, to stage ``j-1``) or keeps
(``buffer``: its input) is first encoded in the format of its kind
(:class:`petra_jax.engine.quantize.MessageFormats`), then moved to the
receiving stage's device: :func:`petra_jax.engine.transport.send` within
this process, :func:`petra_jax.engine.transport.transfer` across processes,
where the receiver allocates the payload from its shapes.

Shapes have one name, *message specs*: :meth:`Messenger.message_specs` gives
each stage's input (then the logits) as ``jax.ShapeDtypeStruct`` pytrees;
:meth:`Messenger.encoded_spec` the same for one stage as it travels, in the
format of its kind.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp

from petra_jax.engine import quantize as quantize_lib
from petra_jax.engine import transport
from petra_jax.engine.stage import Stage, trace

PyTree = Any


def _payload_code(kind: str, j: int) -> int:
  """``3 j + kind index``: one number per (stage, payload kind)."""
  return len(quantize_lib.KINDS) * j + quantize_lib.KINDS.index(kind)


def _payload_key(base: jax.Array, m, code) -> jax.Array:
  """``fold_in(fold_in(base, m), code)``: the stochastic-rounding key of one
  payload of micro-batch ``m`` (jittable; ``m`` and ``code`` may be traced)."""
  return jax.random.fold_in(jax.random.fold_in(base, m), code)


class Messenger:
  """Encodes, shapes and moves the payloads of one pipeline's stages.

  Args:
    stages: the model's stages (their shapes give the message specs).
    placements: each stage's :class:`petra_jax.engine.placement.Placement`
      (a payload goes to the receiver's ``batch`` placement: every payload
      is batched, ``[B, ...]``).
    local: per stage, whether this process runs it.
    formats: the format of each payload kind; default: all float, as
      computed.
  """

  def __init__(self, stages: Sequence[Stage], placements: Sequence, local: Sequence[bool],
               formats: Optional[quantize_lib.MessageFormats] = None):
    self.stages, self.placements, self.local = list(stages), list(placements), list(local)
    self.devices = [p.device for p in self.placements]
    self.formats = formats or quantize_lib.MessageFormats()
    self._encoders = {kind: jax.jit(functools.partial(self.formats.encode, kind))
                      for kind in quantize_lib.KINDS}
    # stochastic int8: the payload's key is derived inside the same jit
    self._stochastic_encoders = {
        kind: jax.jit(lambda x, base, m, code, kind=kind: self.formats.encode(
            kind, x, _payload_key(base, m, code))) for kind in quantize_lib.KINDS}
    self._base_key = jax.random.key(2)  # set from the seed by start()
    self._sample = None  # the training input's spec (multi-process runs)
    self._spec_cache: dict = {}  # (shape, dtype) -> message_specs
    self._encoded_cache: dict = {}  # (kind, j) -> encoded_spec
    # With defer (set by the pipeline when stages sit on several devices or
    # processes) a tick's moving payloads wait for flush(), at its end.
    self.defer = False
    self._deferred: list = []

  def start(self, seed: int, sample_input, multiprocess: bool) -> None:
    """Sets the run's stochastic-rounding key from ``seed`` and, in a
    multi-process run, the input shape every message spec derives from
    (``sample_input``: ``float32[B, H, W, C]``, only its shape and dtype
    matter)."""
    self._base_key = jax.random.key(seed + 2)
    self._sample = (jax.ShapeDtypeStruct(sample_input.shape, sample_input.dtype)
                    if multiprocess else None)
    self._encoded_cache = {}

  def message_specs(self, sample_input) -> list:
    """Message specs for a stage-0 input shaped like ``sample_input``.

    Returns:
      ``J + 1`` pytrees of ``jax.ShapeDtypeStruct``: each stage's input
      (float, as computed), then the logits. Cached per input shape.
    """
    key = (tuple(sample_input.shape), jnp.dtype(sample_input.dtype))
    if key not in self._spec_cache:
      spec = jax.ShapeDtypeStruct(sample_input.shape, sample_input.dtype)
      self._spec_cache[key] = [spec] + [out for _, out in trace(self.stages, spec)]
    return self._spec_cache[key]

  def encoded_spec(self, kind: str, j: int) -> Optional[PyTree]:
    """Stage ``j``'s input as a ``kind`` message travels (what a receiving
    process allocates): its message spec in ``kind``'s format. None in a
    single-process run (nothing is allocated)."""
    if self._sample is None:
      return None
    if (kind, j) not in self._encoded_cache:
      spec = self.message_specs(self._sample)[j]
      if self.formats.active:
        spec = self.formats.spec(kind, spec)
      self._encoded_cache[(kind, j)] = spec
    return self._encoded_cache[(kind, j)]

  def encode(self, kind: str, x, j: int, m: int):
    """Payload ``x`` of stage ``j``, micro-batch ``m``, in ``kind``'s format.

    ``kind`` is ``forward``, ``backward`` or ``buffer``. Returns ``x``
    itself when nothing is quantised (and for a ``"none"`` buffer, or a
    stage of another process). Stochastic int8 draws with the key
    ``fold_in(fold_in(key(seed + 2), m), 3 j + kind index)`` (kind index in
    :data:`petra_jax.engine.quantize.KINDS`): a function of the run's seed
    and the schedule only.
    """
    if (x is None or not self.formats.active or not self.local[j]
        or (kind == "buffer" and self.formats.buffer == "none")):
      return x
    if self.formats.stochastic_for(kind):
      return self._stochastic_encoders[kind](x, self._base_key, m, _payload_code(kind, j))
    return self._encoders[kind](x, None)

  def route(self, kind: str, src: int, dst: int, first: bool = True) -> Callable:
    """The one function that encodes and moves every ``kind`` payload from
    stage ``src`` to stage ``dst``, decided once (the engine builds its
    routes when it is built, not per message).

    Args:
      kind: ``forward`` or ``backward``.
      src, dst: the sending and the receiving stage.
      first: for ``backward``, whether the payload's first element (the
        sender's input, for a reconstructing receiver) travels; else it is
        None.

    Returns:
      ``(payload, m) -> payload on dst's device`` (as :meth:`encode` then
      :meth:`move`): the payload itself when nothing is encoded and both
      stages share a device; a ``jax.device_put`` when nothing is encoded
      and both are this process's; the general path otherwise.
    """
    same = self.placements[src] == self.placements[dst]
    if not self.formats.active and self.local[src] and self.local[dst]:
      if same:
        return lambda x, m: x
      if self.defer:
        return lambda x, m: self._later(x, src, dst, None)
      where = self.placements[dst].batch
      return lambda x, m: transport.send(x, where)
    moves = not same and (self.local[src] or self.local[dst])

    def general(x, m):
      spec = self.encoded_spec(kind, max(src, dst))  # the input of the later stage
      if kind == "backward":
        spec = (spec if first else None, spec)
      x = self.encode(kind, x, src, m)
      if moves and self.defer:
        return self._later(x, src, dst, spec)
      return self.move(x, src, dst, spec)
    return general

  def _later(self, x, src: int, dst: int, spec) -> Deferred:
    """Queues the move of ``x`` for :meth:`flush`; its placeholder."""
    self._deferred.append(Deferred((x, src, dst, spec)))
    return self._deferred[-1]

  def flush(self) -> None:
    """Runs the tick's deferred moves and sets each
    :class:`petra_jax.engine.state.Deferred`'s ``value``: those within this
    process as one batched ``jax.device_put``, then the cross-process
    transfers in the order they were sent (the tick's task order: the same
    on every process; None on the sending process)."""
    within = [d for d in self._deferred if self.local[d.args[1]] and self.local[d.args[2]]]
    if within:
      values = transport.send([d.args[0] for d in within],
                              [self.placements[d.args[2]].batch for d in within])
      for d, v in zip(within, values):
        d.value = v
    for d in self._deferred:
      if not (self.local[d.args[1]] and self.local[d.args[2]]):
        d.value = self.move(*d.args)
    self._deferred = []

  def move(self, x, src: int, dst: int, spec):
    """Payload ``x`` from stage ``src``'s device to stage ``dst``'s.

    Within this process ``transport.send`` (nothing when both stages share a
    device: the payload is already there); across processes
    ``transport.transfer`` (``spec``: ``x``'s shapes, for the receiver).
    Every process calls it for every message, in the schedule's order.
    Returns the payload on ``dst``'s device, or None if ``dst`` is another
    process's (or neither stage is this process's: nothing is run).
    """
    if self.local[src] and self.local[dst]:
      if self.placements[src] == self.placements[dst]:  # already there
        return x
      return transport.send(x, self.placements[dst].batch)
    if not (self.local[src] or self.local[dst]):
      return None
    x = transport.transfer(x, self.placements[src], self.placements[dst], spec)
    return x if self.local[dst] else None


class Deferred:
  """A message from another process that arrives at the end of its tick.

  Multi-process ticks dispatch every local computation first and the
  cross-process transfers after (:meth:`petra_jax.engine.messages.Messenger.flush`),
  so a process never waits for a message it does not need yet. Until then
  the receiving box holds this placeholder; :func:`resolve` swaps in the
  payload (``value``) when the tick ends.
  """
  __slots__ = ("args", "value")

  def __init__(self, args: tuple):
    self.args, self.value = args, None


def resolve(boxes) -> None:
  """Replaces every :class:`Deferred` in the per-stage ``boxes`` (lists of
  ``{micro-batch: payload}``) by its transferred payload."""
  for box in boxes:
    for m, v in box.items():
      if isinstance(v, Deferred):
        box[m] = v.value
