"""Contiguous grouping of blocks into ``J' <= J`` stages minimising the slowest stage.

Costs are measured ms (:mod:`petra_jax.engine.timing`) or forward FLOPs
(:func:`block_flops`); :func:`balanced_partition` is a dynamic program.

FLOPs are counted from each block's jaxpr (:func:`jaxpr_flops`), not from the backend's cost
analysis: XLA's GPU cost analysis counts no FLOPs for matmuls lowered to library calls (cuBLAS),
which grouped ``revgpt_small`` in 4 stages as [1, 1, 1, 11] on a GPU against [4, 3, 3, 4] on the
CPU. Counting from the jaxpr gives the same groups on every backend.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
from jax import extend as jex

from petra_jax.engine.stages import stage as stage_lib
from petra_jax.engine.stages.stage import Stage


def group_cost(costs: Sequence[float], a: int, b: int,
               send_forward: Optional[Sequence[float]] = None,
               send_backward: Optional[Sequence[float]] = None) -> float:
  """Tick time (ms) of one device running stages ``a..b`` (inclusive), outgoing sends included."""
  total = float(sum(costs[a:b + 1]))
  if send_forward is not None and b < len(costs) - 1:
    total += send_forward[b]
  if send_backward is not None and a > 0:
    total += send_backward[a]
  return total


def balanced_partition(costs: Sequence[float], num_groups: int,
                       send_forward: Optional[Sequence[float]] = None,
                       send_backward: Optional[Sequence[float]] = None):
  """``(groups, max_cost ms)``: inclusive ``(first, last)`` groups minimising the slowest.

  Raises:
    ValueError: ``num_groups`` outside ``[1, len(costs)]``.
  """
  n = len(costs)
  if not 1 <= num_groups <= n:
    raise ValueError(f"num_groups must be in [1, {n}], got {num_groups}")
  inf = float("inf")
  cost = lambda a, b: group_cost(costs, a, b, send_forward, send_backward)
  best = [[inf] * (n + 1) for _ in range(num_groups + 1)]
  cut = [[0] * (n + 1) for _ in range(num_groups + 1)]
  best[0][0] = 0.0
  for g in range(1, num_groups + 1):
    for i in range(g, n + 1):
      for k in range(g - 1, i):
        value = max(best[g - 1][k], cost(k, i - 1))
        if value < best[g][i]:
          best[g][i], cut[g][i] = value, k
  groups, i = [], n
  for g in range(num_groups, 0, -1):
    k = cut[g][i]
    groups.append((k, i - 1))
    i = k
  return groups[::-1], best[num_groups][n]


def equal_partition(num_blocks: int, num_groups: int) -> list[tuple[int, int]]:
  """Consecutive groups of near-equal size, e.g. 10 blocks in 4 -> ``[3, 3, 2, 2]``.

  Raises:
    ValueError: ``num_groups`` outside ``[1, num_blocks]``.
  """
  if not 1 <= num_groups <= num_blocks:
    raise ValueError(f"num_groups must be in [1, {num_blocks}], got {num_groups}")
  base, extra = divmod(num_blocks, num_groups)
  groups, first = [], 0
  for g in range(num_groups):
    size = base + (g < extra)
    groups.append((first, first + size - 1))
    first += size
  return groups


def group_sizes(groups: Sequence[tuple[int, int]]) -> list[int]:
  """``[(first, last), ...]`` (inclusive) -> the number of blocks per group."""
  return [b - a + 1 for a, b in groups]


def group_stages(blocks: Sequence[Stage], sizes: Sequence[int]) -> list[Stage]:
  """Groups consecutive blocks into stages: stage ``g`` runs ``sizes[g]`` blocks.

  Args:
    blocks: one ``Stage`` per residual block, in order (:func:`build_model`'s list).
    sizes: blocks per stage, e.g. ``[4, 3, 3, 4]``; their sum is ``len(blocks)``.

  Returns:
    ``len(sizes)`` stages; a stage of one block is that block, a larger one a group
    whose variables are held under ``"block_i"``.

  Raises:
    ValueError: sizes that do not sum to ``len(blocks)``, fewer than 2
      stages, or more stages than blocks.
  """
  sizes = [int(n) for n in sizes]
  if len(sizes) > len(blocks):
    raise ValueError(f"{len(sizes)} stages but the model has only {len(blocks)} blocks; "
                     f"use --config.model.num_stages <= {len(blocks)}.")
  if len(sizes) < 2 or min(sizes) < 1 or sum(sizes) != len(blocks):
    raise ValueError(f"model.stage_sizes={tuple(sizes)} must be >= 2 positive counts summing "
                     f"to the model's {len(blocks)} blocks.")
  out, i = [], 0
  for n in sizes:
    out.append(stage_lib.group(blocks[i:i + n]))
    i += n
  return out


def block_flops(blocks: Sequence[Stage], input_shape: Sequence[int]) -> list[float]:
  """Forward FLOPs of each block on a ``float32[input_shape]`` batch (:func:`jaxpr_flops`).

  The same numbers on every backend: nothing is lowered or compiled.
  """
  x = jax.ShapeDtypeStruct(tuple(input_shape), jnp.float32)
  flops = []
  for s, (variables, y) in zip(blocks, stage_lib.trace(blocks, x)):
    fwd = lambda v, x, s=s: stage_lib.forward(s, v["params"], v["batch_stats"], x)[0]
    flops.append(jaxpr_flops(jax.make_jaxpr(fwd)(variables, x).jaxpr))
    x = y
  return flops


# One FLOP per output element (elementwise arithmetic) or per input element (reductions).
_ELEMENTWISE = frozenset({
    "add", "sub", "mul", "div", "rem", "neg", "max", "min", "abs", "sign", "exp", "exp2", "log",
    "log1p", "expm1", "tanh", "logistic", "sin", "cos", "tan", "sqrt", "rsqrt", "cbrt", "pow",
    "integer_pow", "erf", "erfc", "erf_inv", "square", "atan2", "select_n", "clamp", "round",
    "floor", "ceil", "eq", "ne", "lt", "le", "gt", "ge", "and", "or", "not", "xor"})
_REDUCTIONS = frozenset({"reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "argmax",
                         "argmin", "cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp",
                         "reduce_precision"})


def jaxpr_flops(jaxpr) -> float:
  """FLOPs of one run of ``jaxpr`` (a ``jax.extend.core.Jaxpr``), counted from its shapes.

  ``dot_general``: ``2 * |out| * prod(contracting dims)``; ``conv_general_dilated``: ``2 *
  |out| * |kernel| / out_features``; elementwise arithmetic ``|out|``; reductions ``|in|``;
  data movement (reshape, transpose, slice, gather, convert...) 0. Nested jaxprs count once
  (``pjit``, custom derivatives), ``scan`` ``length`` times, ``cond`` its costliest branch,
  ``while`` one iteration (its trip count is not static).
  """
  total = 0.0
  for eqn in jaxpr.eqns:
    total += _eqn_flops(eqn)
  return total


def _eqn_flops(eqn) -> float:
  name = eqn.primitive.name
  if name == "dot_general":
    (contract, _), _ = eqn.params["dimension_numbers"]
    lhs = eqn.invars[0].aval.shape
    return 2.0 * _size(eqn.outvars[0]) * math.prod(lhs[d] for d in contract)
  if name == "conv_general_dilated":
    kernel = eqn.invars[1].aval.shape
    out_features = kernel[eqn.params["dimension_numbers"].rhs_spec[0]]
    return 2.0 * _size(eqn.outvars[0]) * math.prod(kernel) / out_features
  if name in _ELEMENTWISE:
    return float(sum(_size(v) for v in eqn.outvars))
  if name in _REDUCTIONS:
    return float(sum(_size(v) for v in eqn.invars if hasattr(v.aval, "shape")))
  subs = [_as_jaxpr(p) for p in eqn.params.values() for p in (p if isinstance(p, (list, tuple))
                                                                 else (p,))]
  subs = [j for j in subs if j is not None]
  if not subs:
    return 0.0
  if name == "cond":
    return max(jaxpr_flops(j) for j in subs)
  if name == "scan":
    return eqn.params["length"] * sum(jaxpr_flops(j) for j in subs)
  if name == "while":  # body once, its condition not counted
    return jaxpr_flops(_as_jaxpr(eqn.params["body_jaxpr"]))
  return sum(jaxpr_flops(j) for j in subs)


def _as_jaxpr(param):
  """The ``Jaxpr`` of a ``Jaxpr`` or ``ClosedJaxpr`` parameter; None for anything else."""
  if isinstance(param, jex.core.ClosedJaxpr):
    return param.jaxpr
  if isinstance(param, jex.core.Jaxpr):
    return param
  return None


def _size(var) -> int:
  return math.prod(getattr(var.aval, "shape", ()))


def balanced_stage_sizes(blocks: Sequence[Stage], num_stages: int,
                         input_shape: Sequence[int],
                         costs: Optional[Sequence[float]] = None) -> list[int]:
  """Blocks per stage minimising the slowest (``input_shape`` ``[B, H, W, C]``; default FLOPs).

  Raises:
    ValueError: ``num_stages`` outside ``[2, len(blocks)]``, or wrong ``costs`` length.
  """
  if not 2 <= num_stages <= len(blocks):
    raise ValueError(f"num_stages={num_stages} must be in [2, {len(blocks)}] (the model has "
                     f"{len(blocks)} blocks); use --config.model.num_stages <= {len(blocks)}.")
  if costs is None:
    costs = block_flops(blocks, input_shape)
  if len(costs) != len(blocks):
    raise ValueError(f"{len(costs)} costs for {len(blocks)} blocks.")
  groups, _ = balanced_partition(costs, num_stages)
  return group_sizes(groups)
