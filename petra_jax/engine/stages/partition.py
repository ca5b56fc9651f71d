"""Contiguous grouping of blocks into ``J' <= J`` stages minimising the slowest stage.

Costs are measured ms (:mod:`petra_jax.engine.timing`) or forward FLOPs
(:func:`block_flops`); :func:`balanced_partition` is a dynamic program.
"""

from __future__ import annotations

from typing import Optional, Sequence

import jax
import jax.numpy as jnp

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
  """Forward FLOPs of each block on a ``float32[input_shape]`` batch (XLA cost analysis)."""
  x = jax.ShapeDtypeStruct(tuple(input_shape), jnp.float32)
  flops = []
  for s, (variables, y) in zip(blocks, stage_lib.trace(blocks, x)):
    fwd = lambda v, x, s=s: stage_lib.forward(s, v["params"], v["batch_stats"], x)[0]
    cost = jax.jit(fwd).lower(variables, x).cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    flops.append(float((cost or {}).get("flops", 0.0)))
    x = y
  return flops


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
