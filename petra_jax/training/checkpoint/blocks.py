"""The per-block part of a checkpoint, which makes resharding possible.

State is stored per block (global index ``"007"``): :func:`split_stage` cuts
a stage's state into blocks, :func:`merge_blocks` regroups them, so a
checkpoint resumes with another grouping, device or process count.
"""

from __future__ import annotations

from typing import Sequence

import jax
import numpy as np

from petra_jax.engine.transport.pipeline_state import PipelineState
from petra_jax.training import console


class CheckpointError(RuntimeError):
  """A checkpoint that cannot be used; the message says why and the fix."""


def stage_block_count(train_state) -> int:
  """Blocks in a stage: ``n`` if its params are ``block_0..n-1``, else 1."""
  params = train_state.params
  n = len(params) if isinstance(params, dict) else 0
  names = [f"block_{i}" for i in range(n)]
  return n if n > 1 and sorted(params) == sorted(names) else 1


def _group_test(n: int):
  """Whether a subtree is a group of ``n`` blocks (keys ``block_0..n-1``)."""
  names = {f"block_{i}" for i in range(n)}
  return lambda x: isinstance(x, dict) and len(x) == n and set(x) == names


def _as_tree(train_state) -> dict:
  return {"micro_batches": train_state.micro_batches, "params": train_state.params,
          "batch_stats": train_state.batch_stats, "opt_state": train_state.opt_state}


def split_stage(train_state, num_blocks: int) -> list[dict]:
  """``num_blocks`` trees ``{"micro_batches", "params", "batch_stats", "opt_state"}``
  of a :class:`StageState`: subtrees keyed ``block_0..n-1`` are cut, shared
  counters (``micro_batches``, optax ``count``) copied into every block.
  """
  tree = _as_tree(train_state)
  if num_blocks == 1:
    return [tree]
  is_group = _group_test(num_blocks)
  leaves, treedef = jax.tree.flatten(tree, is_leaf=is_group)
  return [treedef.unflatten([x[f"block_{i}"] if is_group(x) else x for x in leaves])
          for i in range(num_blocks)]


def merge_blocks(blocks: Sequence[dict], template):
  """The inverse of :func:`split_stage`; raises CheckpointError on a misfit
  or on shared counters that differ (the checkpoint was not drained).
  """
  if len(blocks) == 1:
    return template.replace(**blocks[0])
  is_group = _group_test(len(blocks))
  leaves, treedef = jax.tree.flatten(_as_tree(template), is_leaf=is_group)
  try:
    pieces = [treedef.flatten_up_to(b) for b in blocks]
  except (ValueError, TypeError) as e:
    raise CheckpointError(f"saved block states do not fit this stage's optimizer state: "
                          f"{str(e).splitlines()[0]}") from None
  merged = []
  for pos, leaf in enumerate(leaves):
    if is_group(leaf):
      merged.append({f"block_{i}": p[pos] for i, p in enumerate(pieces)})
      continue
    values = [np.asarray(p[pos]) for p in pieces]
    if any(not np.array_equal(values[0], v) for v in values[1:]):
      raise CheckpointError(
          f"the blocks regrouped into one stage disagree on a shared counter ({values}): "
          "the checkpoint was not taken on a drained pipeline.")
    merged.append(pieces[0][pos])
  return template.replace(**treedef.unflatten(merged))


def stage_blocks(state: PipelineState, counts: Sequence[int]) -> dict:
  """``{"007": block tree}`` of this process's stages (:func:`split_stage`)."""
  out = {}
  for j, st in enumerate(state.train_states):
    if st is not None:
      first = sum(counts[:j])
      for i, block in enumerate(split_stage(st, counts[j])):
        out[f"{first + i:03d}"] = block
  return out


def opt_paths(opt_state) -> list[str]:
  """Optimizer-state leaf paths without tuple positions (equal for chains
  that differ only by stateless transformations).
  """
  return ["/".join(str(getattr(k, "name", getattr(k, "key", k))) for k in path
                   if not isinstance(k, jax.tree_util.SequenceKey))
          for path, _ in jax.tree_util.tree_flatten_with_path(opt_state)[0]]


def flat_opt(block: dict) -> dict:
  """A block tree with its optimizer state flat, ``{"00000": leaf}``."""
  leaves = jax.tree.leaves(block["opt_state"])
  return dict(block, opt_state={f"{i:05d}": x for i, x in enumerate(leaves)})


def unflat_opt(block: dict, like: dict) -> dict:
  """The inverse of :func:`flat_opt`, into ``like``'s optimizer structure."""
  leaves = [block["opt_state"][k] for k in sorted(block["opt_state"])]
  return dict(block, opt_state=jax.tree.structure(like["opt_state"]).unflatten(leaves))


def check_layout(meta: dict, counts: list[int], directory: str, step: int) -> None:
  """Another grouping needs a drained checkpoint over the same blocks.

  Raises:
    CheckpointError: another block count, or regrouping with micro-batches
      in flight.
  """
  saved, where = meta["block_counts"], f"{directory}/{step}"
  if saved == counts:
    return
  if sum(saved) != sum(counts):
    raise CheckpointError(f"checkpoint {where} has {sum(saved)} blocks, this "
                          f"model {sum(counts)}; use another --workdir.")
  if not meta["drained"]:
    raise CheckpointError(
        f"checkpoint {where} holds micro-batches in flight in its "
        f"{len(saved)} stages of {saved} blocks; resume it with "
        f"--config.model.stage_sizes=\"{tuple(saved)}\", or reshard a drained checkpoint "
        "(the last one of a run, or one taken with --config.checkpoint_drain=True).")
  console.say(f"resharding checkpoint {step}: stages of {saved} blocks -> {counts}")


def check_optimizer_fit(metas: list[dict], blocks_now: dict, where: str) -> None:
  """Each block's saved optimizer state must have its stage's leaf paths.

  Raises:
    CheckpointError: a block's optimizer leaf paths differ.
  """
  saved = {b: paths for m in metas for b, paths in m["opt_paths"].items()}
  for b, block in blocks_now.items():
    now = opt_paths(block["opt_state"])
    if saved[b] != now:
      missing = sorted(set(saved[b]) ^ set(now))[:3]
      raise CheckpointError(
          f"checkpoint {where}: block {int(b)}'s optimizer state "
          f"({len(saved[b])} arrays) does not fit its stage's optimizer now ({len(now)}; "
          f"differ: {missing}); resume with the checkpoint's stage grouping "
          f"(model.stage_sizes={tuple(metas[0]['block_counts'])}).")
