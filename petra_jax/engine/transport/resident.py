"""A pipeline state a compiled call leaves in its program's own layout, converted when read.

A compiled call (:mod:`petra_jax.engine.compiled`, :mod:`petra_jax.engine.stage_mesh`) carries
the messages in flight in the layout its program scans over (ring buffers; a device's packed
buffers). Converting them back into :class:`PipelineState`'s dicts costs jitted calls at the end
of one call and the conversion back at the start of the next; between two calls of the steady
state nothing reads them. So a call returns a :class:`Resident`: the program's carry as it is,
converted only when a field is first read, and taken unread by the next call of the same owner.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

import jax

from petra_jax.engine.transport.pipeline_state import PipelineState

_FIELDS = tuple(f.name for f in dataclasses.fields(PipelineState) if f.name != "tick")
_DONATED = "donated"


class Resident(PipelineState):
  """The :class:`PipelineState` a compiled call returns, left in its program's layout.

  Args:
    owner: what made it (an executor); only that owner may :meth:`claim` it.
    program: the program whose carry it holds (the owner's record).
    carry: the program's carry (device arrays).
    s: the micro-batch its carry's key 0 stands for (the next period's shift).
    tick: the next tick.
    convert: ``() -> PipelineState``: the same state as plain fields (jitted calls), run on
      the first read of a field.

  Raises (reading a field):
    RuntimeError: a later call took (donated) its arrays.
  """

  def __init__(self, owner: Any, program: Any, carry: Any, s: int, tick: int,
               convert: Callable[[], PipelineState]):
    self.tick = tick
    self._packed = (owner, program, carry, s, convert)

  def __getattr__(self, name):
    packed = self.__dict__.get("_packed")
    if packed is None or name not in _FIELDS:
      raise AttributeError(name)
    full = _unread(packed)[4]()
    self.__dict__.update({f: getattr(full, f) for f in _FIELDS}, _packed=None)
    return self.__dict__[name]

  def block_until_ready(self) -> "Resident":
    """Waits until the carry (or, once converted, every field) is computed; converts nothing."""
    packed = self.__dict__.get("_packed")
    if packed is None:
      return super().block_until_ready()
    jax.block_until_ready(_unread(packed)[2])
    return self

  def claim(self, owner: Any, s: int) -> Optional[tuple]:
    """``(program, carry)`` if unread, made by ``owner`` and keyed ``m - s``; else None."""
    packed = self.__dict__.get("_packed")
    if packed is None or packed is _DONATED or packed[0] is not owner or packed[3] != s:
      return None
    return packed[1], packed[2]

  def donate(self) -> None:
    """Marks the carry taken by a call (its fields can no longer be read)."""
    self.__dict__["_packed"] = _DONATED


def _unread(packed: tuple) -> tuple:
  """``packed`` if a later call has not taken it. Raises RuntimeError if one has."""
  if packed is _DONATED:
    raise RuntimeError("this pipeline state's arrays were donated to a later compiled call "
                       "(advance donates the state it takes): use the state it returned.")
  return packed
