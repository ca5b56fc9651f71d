"""Consecutive blocks grouped into pipeline stages (stage balancing), and each block's cost."""

from __future__ import annotations

from typing import Optional, Sequence

import jax
import jax.numpy as jnp

from petra_jax.engine import partition
from petra_jax.engine import stage as stage_lib
from petra_jax.engine.stage import Stage


def group_stages(blocks: Sequence[Stage], sizes: Sequence[int]) -> list[Stage]:
  """Stage ``g`` runs ``sizes[g]`` consecutive blocks (each >= 1, summing to ``len(blocks)``).

  Raises:
    ValueError: sizes that do not cover the blocks, fewer than 2 stages, or
      more stages than blocks.
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
  """Forward FLOPs of each block on ``float32[input_shape]`` (XLA's cost analysis, nothing run)."""
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
  """Blocks per stage minimising the slowest stage's cost (``costs``, default :func:`block_flops`).

  Raises:
    ValueError: ``num_stages`` outside ``[2, len(blocks)]``, or ``costs`` of the wrong length.
  """
  if not 2 <= num_stages <= len(blocks):
    raise ValueError(f"num_stages={num_stages} must be in [2, {len(blocks)}] (the model has "
                     f"{len(blocks)} blocks); use --config.model.num_stages <= {len(blocks)}.")
  if costs is None:
    costs = block_flops(blocks, input_shape)
  if len(costs) != len(blocks):
    raise ValueError(f"{len(costs)} costs for {len(blocks)} blocks.")
  groups, _ = partition.balanced_partition(costs, num_stages)
  return partition.group_sizes(groups)
