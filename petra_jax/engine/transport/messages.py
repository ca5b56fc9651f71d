"""Messages between stages: their format, their shapes and their move.

A payload (``forward``: output to stage ``j+1``; ``backward``:
``(y_{j-1} or None, delta_j)`` to stage ``j-1``; ``buffer``: a kept input) is
encoded in its kind's format, then moved by :mod:`petra_jax.engine.transport.transfers`.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp

from petra_jax.engine.arrays import quantize as quantize_lib
from petra_jax.engine.transport import transfers as transport
from petra_jax.engine.stages.stage import Stage, trace

PyTree = Any


def _payload_code(kind: str, j: int) -> int:
  """``3 j + kind index``: one number per (stage, payload kind)."""
  return len(quantize_lib.PAYLOADS) * j + quantize_lib.PAYLOADS.index(kind)


def _payload_key(base: jax.Array, m, code) -> jax.Array:
  """``fold_in(fold_in(base, m), code)``: one payload's stochastic-rounding key (jittable)."""
  return jax.random.fold_in(jax.random.fold_in(base, m), code)


class Messenger:
  """Encodes, shapes and moves the payloads of one pipeline's stages (all ``[B, ...]``).

  Args:
    placements: each stage's :class:`petra_jax.engine.transport.placement.Placement`.
    owned: per stage, whether this process runs it.
  """

  def __init__(self, stages: Sequence[Stage], placements: Sequence, owned: Sequence[bool],
               formats: Optional[quantize_lib.MessageFormats] = None):
    self.stages, self.placements, self.owned = list(stages), list(placements), list(owned)
    self.devices = [p.device for p in self.placements]
    self.formats = formats or quantize_lib.MessageFormats()
    self._encoders = {kind: jax.jit(functools.partial(self.formats.encode, kind))
                      for kind in quantize_lib.PAYLOADS}
    self._stochastic_encoders = {
        kind: jax.jit(lambda x, base, m, code, kind=kind: self.formats.encode(
            kind, x, _payload_key(base, m, code))) for kind in quantize_lib.PAYLOADS}
    self._base_key = jax.random.key(2)
    self._sample = None
    self._spec_cache: dict = {}  # (shape, dtype) -> message_specs
    self._encoded_cache: dict = {}  # (kind, j) -> encoded_spec
    self.defer = False
    self._deferred: list = []

  def start(self, seed: int, sample_input, multiprocess: bool) -> None:
    """Sets the rounding key from ``seed``; multi-process, the input spec ``[B, H, W, C]``."""
    self._base_key = jax.random.key(seed + 2)
    self._sample = (jax.ShapeDtypeStruct(sample_input.shape, sample_input.dtype)
                    if multiprocess else None)
    self._encoded_cache = {}

  def message_specs(self, sample_input) -> list:
    """``J + 1`` ``jax.ShapeDtypeStruct`` pytrees: each stage's input, then the logits."""
    key = (tuple(sample_input.shape), jnp.dtype(sample_input.dtype))
    if key not in self._spec_cache:
      spec = jax.ShapeDtypeStruct(sample_input.shape, sample_input.dtype)
      self._spec_cache[key] = [spec] + [out for _, out in trace(self.stages, spec)]
    return self._spec_cache[key]

  def encoded_spec(self, kind: str, j: int) -> Optional[PyTree]:
    """Stage ``j``'s input spec in ``kind``'s format; None single-process."""
    if self._sample is None:
      return None
    if (kind, j) not in self._encoded_cache:
      spec = self.message_specs(self._sample)[j]
      if self.formats.active:
        spec = self.formats.spec(kind, spec)
      self._encoded_cache[(kind, j)] = spec
    return self._encoded_cache[(kind, j)]

  def encode(self, kind: str, x, j: int, m: int):
    """Payload ``x`` of stage ``j``, micro-batch ``m``, in ``kind``'s format (``x`` if unquantised).

    Stochastic int8 key: ``fold_in(fold_in(key(seed + 2), m), 3 j + kind index)``.
    """
    if (x is None or not self.formats.active or not self.owned[j]
        or (kind == "buffer" and self.formats.buffer == "none")):
      return x
    if self.formats.stochastic_for(kind):
      return self._stochastic_encoders[kind](x, self._base_key, m, _payload_code(kind, j))
    return self._encoders[kind](x, None)

  def route(self, kind: str, src: int, dst: int, first: bool = True) -> Callable:
    """``(payload, m) -> payload on dst's device``: ``kind`` payloads ``src -> dst``.

    ``first``: for ``backward``, whether the sender's input travels (else None).
    """
    same = self.placements[src] == self.placements[dst]
    if not self.formats.active and self.owned[src] and self.owned[dst]:
      if same:
        return lambda x, m: x
      if self.defer:
        return lambda x, m: self._later(x, src, dst, None)
      where = self.placements[dst].batch
      return lambda x, m: transport.send(x, where)
    moves = not same and (self.owned[src] or self.owned[dst])

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
    """Runs the tick's deferred moves: local ones in one ``device_put``, then transfers."""
    within = [d for d in self._deferred if self.owned[d.args[1]] and self.owned[d.args[2]]]
    if within:
      values = transport.send([d.args[0] for d in within],
                              [self.placements[d.args[2]].batch for d in within])
      for d, v in zip(within, values):
        d.value = v
    for d in self._deferred:
      if not (self.owned[d.args[1]] and self.owned[d.args[2]]):
        d.value = self.move(*d.args)
    self._deferred = []

  def move(self, x, src: int, dst: int, spec):
    """Payload ``x`` from stage ``src``'s device to ``dst``'s; None if ``dst`` is not local."""
    if self.owned[src] and self.owned[dst]:
      if self.placements[src] == self.placements[dst]:
        return x
      return transport.send(x, self.placements[dst].batch)
    if not (self.owned[src] or self.owned[dst]):
      return None
    x = transport.transfer(x, self.placements[src], self.placements[dst], spec)
    return x if self.owned[dst] else None


class Deferred:
  """A cross-process message that arrives at the end of its tick (:meth:`Messenger.flush`)."""
  __slots__ = ("args", "value")

  def __init__(self, args: tuple):
    self.args, self.value = args, None


def resolve(boxes) -> None:
  """Replaces every :class:`Deferred` in ``boxes`` (``{micro-batch: payload}``) by its payload."""
  for box in boxes:
    for m, v in box.items():
      if isinstance(v, Deferred):
        box[m] = v.value
