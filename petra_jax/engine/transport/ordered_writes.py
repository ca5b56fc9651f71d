"""Carried slots updated in place: each new value ordered after the reads of the old one.

The compiled executor's loop (:mod:`petra_jax.engine.compiled`) reads a carried slot (a message
in flight, a stage's state) early in an iteration and writes the slot's next value late, in a
later tick. XLA updates a loop-carried buffer in place only where a data dependency orders every
read of the old value before the write of the new one; between two stages none does, so XLA
copies the old value out of its slot at the iteration's start and the new one in at its end
(docs/performance.md, "Ordered writes"). :func:`ordered_writes` adds that dependency and changes
no value: each new value minus a zero computed from one element of each output of the operations
that read the old value.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.extend.core as jcore
import jax.numpy as jnp

# Primitives whose read of an operand is over once one element of their output exists: XLA
# cannot compute an element of a convolution, a contraction, a reduction or an opaque call from
# a slice of its operand. Any other primitive (elementwise, views, slices, in-place updates)
# passes the slot on, and its users are followed instead: one element of an elementwise result
# may be computed from one element of the slot, which orders nothing.
READERS = frozenset({
    "conv_general_dilated", "dot_general", "ragged_dot_general",
    "reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_and", "reduce_or",
    "reduce_xor", "argmax", "argmin",
    "cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp",
    "reduce_window_sum", "reduce_window_max", "reduce_window_min", "reduce_window",
    "select_and_scatter_add", "select_and_gather_add",
    "gather", "scatter", "scatter-add", "scatter_add", "scatter_mul", "scatter_min",
    "scatter_max", "sort", "fft", "custom_vjp_call", "custom_vjp_call_jaxpr", "custom_jvp_call",
    "scan", "while", "cond", "pure_callback", "io_callback",
})
_CALLS = ("jit", "pjit")


def _reads(eqn) -> bool:
  """Whether ``eqn`` finishes reading its operands before any element of its output exists
  (a call: whether anything inside it does)."""
  if eqn.primitive.name in _CALLS and "jaxpr" in eqn.params:
    return any(_reads(e) for e in eqn.params["jaxpr"].jaxpr.eqns)
  return eqn.primitive.name in READERS


def _is_var(v) -> bool:
  return isinstance(v, jcore.Var) and not isinstance(v, jcore.Literal)


def _dependencies(jaxpr, var) -> list:
  """The variables to wait for before ``var``'s slot may be overwritten: the outputs of the
  reading operations ``var`` reaches through passing ones (:data:`READERS`), and the body's
  outputs it reaches through passing ones only."""
  users: dict = {}
  for eqn in jaxpr.eqns:
    for v in eqn.invars:
      if _is_var(v):
        users.setdefault(v, []).append(eqn)
  outputs = {v for v in jaxpr.outvars if _is_var(v)}
  found, stack, seen = [], [var], set()
  while stack:
    v = stack.pop()
    if v is not var and v in outputs:
      found.append(v)
    for eqn in users.get(v, ()):
      if id(eqn) in seen:
        continue
      seen.add(id(eqn))
      if _reads(eqn):
        found += [o for o in eqn.outvars if _is_var(o)]
      else:
        stack += [o for o in eqn.outvars if _is_var(o)]
  return list(dict.fromkeys(found))


def _zero(values: list) -> jax.Array:
  """``float32`` +0.0 that depends on one element of each of ``values``: ``min(|d|, 0)`` is
  +0.0 for every finite or infinite ``d`` and NaN for a NaN, which the select maps to +0.0."""
  d = sum((jnp.ravel(v)[0].astype(jnp.float32) for v in values), jnp.float32(0))
  z = jnp.minimum(jnp.abs(d), 0.0)
  return jnp.where(z == z, z, 0.0)


def _numeric(v) -> bool:
  """Whether ``v`` has an element to depend on (not empty, not a key)."""
  return 0 not in v.aval.shape and (
      jnp.issubdtype(v.aval.dtype, jnp.number) or v.aval.dtype == jnp.bool_)


def _with_outputs(jaxpr, extra: list):
  """``jaxpr`` returning ``extra`` (some of its variables) after its own outputs."""
  info = jaxpr.debug_info
  paths = getattr(info, "result_paths", None)
  if isinstance(paths, tuple):
    info = info._replace(result_paths=paths + ("ordered_writes",) * len(extra))
  return jaxpr.replace(outvars=[*jaxpr.outvars, *extra], debug_info=info)


def ordered_writes(body: Callable, in_place: Callable[[Any], bool]) -> Callable:
  """``body(carry, x) -> (carry, y)`` (a ``lax.scan`` body) computing the same values, each
  numeric carried leaf's new value made to depend on every read of its old value.

  ``x - 0.0`` is ``x`` for every float, -0.0, infinities and NaN included (``x - 0`` for an
  integer), so the values are bitwise those of ``body``. Left as they are: leaves under a carry
  node for which ``in_place`` is true (a ring buffer written with ``dynamic_update_slice``,
  which XLA updates in place already and a whole-array subtraction would rewrite), booleans,
  keys, scalars, and leaves whose new value is their old one. The body is traced once here (``jax.make_jaxpr``, its
  jitted calls inline where they were jitted with ``inline=True``) and evaluated once.
  """

  def wrapped(carry, x):
    closed, out_shape = jax.make_jaxpr(body, return_shape=True)(carry, x)
    jaxpr, leaves = closed.jaxpr, jax.tree.leaves((carry, x))
    nodes = jax.tree.leaves(carry, is_leaf=in_place)
    kept = [in_place(node) for node in nodes for _ in jax.tree.leaves(node)]
    plan, extra = [], []
    for p, keep in enumerate(kept):
      old, new = jaxpr.invars[p], jaxpr.outvars[p]
      if keep or not _is_var(new) or new is old or not jnp.issubdtype(new.aval.dtype,
                                                                     jnp.number):
        continue
      deps = [v for v in _dependencies(jaxpr, old) if v is not new and _numeric(v)]
      if new.aval.shape and deps:
        plan.append((p, len(extra), len(deps)))
        extra += deps
    values = jcore.jaxpr_as_fun(jcore.ClosedJaxpr(_with_outputs(jaxpr, extra),
                                                  closed.consts))(*leaves)
    outs, got = list(values[:len(jaxpr.outvars)]), values[len(jaxpr.outvars):]
    for p, start, count in plan:
      outs[p] = outs[p] - _zero(got[start:start + count]).astype(outs[p].dtype)
    return jax.tree.unflatten(jax.tree.structure(out_shape), outs)
  return wrapped
