"""The per-block part of a checkpoint: what makes resharding possible.

A checkpoint stores the train state **per block** (global block index over
the model, ``"007"``), not per stage: :func:`split_stage` cuts a grouped
stage's parameters, statistics and optimizer state into its blocks,
:func:`merge_blocks` regroups them, so a checkpoint resumes with another
stage grouping, device count or process count. A block's optimizer state is
stored flat (:func:`flat_opt`) and checked against the optimizer of the
stage it lands in by its leaf paths (:func:`opt_paths`,
:func:`check_optimizer_fit`); another grouping needs a drained checkpoint
(:func:`check_layout`).
"""

from __future__ import annotations

from typing import Sequence

import jax
import numpy as np

from petra_jax.engine.pipeline_state import PipelineState
from petra_jax.training import console


class CheckpointError(RuntimeError):
  """A checkpoint that cannot be used; the message says why and the fix."""


def stage_block_count(train_state) -> int:
  """Blocks in a stage, read from its parameters: a group
  (:func:`petra_jax.engine.stage.group`) keeps them under ``"block_0"``, ... ."""
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
  """One tree per block of a stage's state.

  Every subtree keyed ``{"block_0", ..., "block_<n-1>"}`` (the parameters,
  the statistics and every optax state that mirrors the parameters: momentum,
  ``MultiSteps`` accumulators, masked states...) is cut into its blocks; the
  other leaves (counters such as ``micro_batches``, optax ``count``,
  ``mini_step``) are shared by the stage and copied into every block.

  Args:
    train_state: a :class:`StageState` (arrays or ``jax.ShapeDtypeStruct``).
    num_blocks: the stage's block count.

  Returns:
    ``num_blocks`` dicts ``{"micro_batches", "params", "batch_stats",
    "opt_state"}``.
  """
  tree = _as_tree(train_state)
  if num_blocks == 1:
    return [tree]
  is_group = _group_test(num_blocks)
  leaves, treedef = jax.tree.flatten(tree, is_leaf=is_group)
  return [treedef.unflatten([x[f"block_{i}"] if is_group(x) else x for x in leaves])
          for i in range(num_blocks)]


def merge_blocks(blocks: Sequence[dict], template):
  """The inverse of :func:`split_stage`: a stage's state from its blocks'.

  Args:
    blocks: per block, a tree from :func:`split_stage` (possibly taken with
      another grouping).
    template: a freshly initialised :class:`StageState` of the stage (gives
      its structure and its static optimizer).

  Returns:
    The :class:`StageState`.

  Raises:
    CheckpointError: a shared counter differs between the blocks (they come
      from stages that had not run the same number of backward passes: the
      checkpoint was not drained), or the trees do not fit the template.
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
  """``{"007": block tree}`` of the stages this process holds (the others'
  train states are ``None``), ``counts[j]`` blocks in stage ``j``
  (:func:`split_stage`)."""
  out = {}
  for j, st in enumerate(state.train_states):
    if st is not None:
      first = sum(counts[:j])
      for i, block in enumerate(split_stage(st, counts[j])):
        out[f"{first + i:03d}"] = block
  return out


def opt_paths(opt_state) -> list[str]:
  """Each optimizer-state leaf's path without tuple positions (``["mini_step",
  "inner_opt_state/trace/conv/kernel", ...]``): the same for two chains that
  differ only by stateless transformations, such as a delay compensation's
  at delay 0 and at delay 6."""
  return ["/".join(str(getattr(k, "name", getattr(k, "key", k))) for k in path
                   if not isinstance(k, jax.tree_util.SequenceKey))
          for path, _ in jax.tree_util.tree_flatten_with_path(opt_state)[0]]


def flat_opt(block: dict) -> dict:
  """A block tree with its optimizer state as its leaves, ``{"00000": leaf}``
  (how a checkpoint stores it: it then fits any chain with the same
  :func:`opt_paths`)."""
  leaves = jax.tree.leaves(block["opt_state"])
  return dict(block, opt_state={f"{i:05d}": x for i, x in enumerate(leaves)})


def unflat_opt(block: dict, like: dict) -> dict:
  """The inverse of :func:`flat_opt`, into ``like``'s optimizer structure."""
  leaves = [block["opt_state"][k] for k in sorted(block["opt_state"])]
  return dict(block, opt_state=jax.tree.structure(like["opt_state"]).unflatten(leaves))


def check_layout(meta: dict, counts: list[int], directory: str, step: int) -> None:
  """Another grouping needs a drained checkpoint over the same blocks.

  Args:
    meta: process 0's ``meta`` item (``block_counts``, ``drained``).
    counts: blocks per stage of the pipeline resuming.
    directory: the checkpoint directory, for the messages.
    step: the checkpoint's step.

  Raises:
    CheckpointError: another block count, or another grouping with
      micro-batches in flight.
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
  """Each block's saved optimizer state must fit its stage's optimizer now
  (the same leaf paths; a compensation's hyper-parameters may change with
  the stage's delay, its state may not).

  Args:
    metas: every writer process's ``meta`` item (``opt_paths``,
      ``block_counts``).
    blocks_now: :func:`stage_blocks` of the template state resuming.
    where: ``"<directory>/<step>"``, for the message.

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
