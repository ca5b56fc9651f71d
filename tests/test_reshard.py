"""Resharding: per-block checkpoints resume with another stage grouping.

A checkpoint stores every block's parameters, statistics and optimizer
state; a drained one (no micro-batch in flight) restores into any grouping
of the same blocks. The checks compare with the arrays saved on disk, read
with orbax directly (not through the restore under test).
"""

import os
import shutil

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from petra_jax.training.checkpoint import blocks as checkpoint_blocks
from petra_jax.training import validation
from petra_jax.training import assembly
from petra_jax.engine.stages import partition
from petra_jax import models, train

from petra_jax.training import checkpoint
from petra_jax.training import metrics as metrics_lib
from petra_jax.engine import schedules as schedule_lib

from petra_jax.optim import compensation

from petra_jax.engine import pipeline
from helpers import random_batch, tiny_config, tiny_revnet


FP = {"model": "revnet18", "width": 4, "method": "petra", "dataset": "cifar10"}


def _grouped_pipeline(sizes, ticks=0, c=None):
  """revnet18 (width 4) in stages of ``sizes`` blocks (None: one block per
  stage), Nesterov look-ahead + k=2, after ``ticks`` ticks of a stream."""
  c = c or tiny_config("unused", **{"accumulation_steps": 2, "batch_size": 16,
                                    "compensation.name": "nesterov_lookahead",
                                    "optim.nesterov": True})
  stages = models.build_model("revnet18", width=4)
  if sizes:
    stages = partition.group_stages(stages, sizes)
  J = len(stages)
  pipe = pipeline.Pipeline(stages, compensation.stage_optimizers(c, 10, J), jax.devices()[:1],
                           accumulation_steps=2)
  state = pipe.init(0, random_batch()[0])
  if ticks:
    table = pipe.schedule(40)
    state, _ = pipe.run(state, (table[t] for t in range(ticks)), lambda m: random_batch(seed=m))
  return pipe, state


def test_split_then_merge_gives_the_stage_state_back():
  _, state = _grouped_pipeline([1, 2, 2, 5], ticks=9)
  for st in state.train_states:
    n = checkpoint_blocks.stage_block_count(st)
    blocks = checkpoint_blocks.split_stage(st, n)
    assert len(blocks) == n
    merged = checkpoint_blocks.merge_blocks(blocks, st)
    assert jax.tree.structure(merged) == jax.tree.structure(st)
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(merged),
                                                     jax.tree.leaves(st)))
  # (every block of a group gets the group's parameters under block_i)
  assert checkpoint_blocks.stage_block_count(state.train_states[3]) == 5


def test_undrained_checkpoint_is_not_resharded(tmp_path):
  pipe, state = _grouped_pipeline(None, ticks=13)
  assert state.in_flight() > 0
  ckpt = checkpoint.Checkpointer(str(tmp_path), keep=1, fingerprint=FP)
  ckpt.save(6, state, extra={})
  ckpt.wait()
  pipe4, template = _grouped_pipeline([1, 2, 2, 5])
  with pytest.raises(checkpoint_blocks.CheckpointError,
                     match=r"micro-batches in flight .* 10 stages .*stage_sizes"):
    checkpoint.Checkpointer(str(tmp_path), keep=1, fingerprint=FP).restore(template,
                                                                            pipe4.devices)


@pytest.mark.parametrize("field,value", [("method", "dsp"), ("dataset", "cifar100"),
                                         ("model", "revnet34")])
def test_checkpoint_of_another_run_is_refused_with_what_differs(tmp_path, field, value):
  pipe, state = _grouped_pipeline(None)
  ckpt = checkpoint.Checkpointer(str(tmp_path), keep=1, fingerprint=FP)
  ckpt.save(1, state, extra={})
  ckpt.wait()
  other = checkpoint.Checkpointer(str(tmp_path), keep=1, fingerprint=dict(FP, **{field: value}))
  with pytest.raises(checkpoint_blocks.CheckpointError,
                     match=f"{field}: checkpoint {FP[field]!r} vs config {value!r}"):
    other.restore(state, pipe.devices)


def test_reshard_to_more_stages_than_blocks_says_so():
  c = tiny_config("unused", **{"model.num_stages": 11, "model.stage_sizes": ()})
  with pytest.raises(validation.ConfigError, match="num_stages=11 but revnet18 has only 10 blocks"):
    validation.validate_config(c, 1)


def _per_block(grouped_tree, n):
  """``[{path: [leaves]}] * n``: each block's leaves of a group's tree, keyed
  by their names without the ``block_i`` key nor sequence indices (a group's
  optax chain differs from a block's in position, not in names); the group's
  shared leaves (counters) go to each block."""
  out = [{} for _ in range(n)]
  for path, leaf in jax.tree_util.tree_flatten_with_path(grouped_tree)[0]:
    names, block = [], None
    for key in path:
      name = getattr(key, "key", getattr(key, "name", None))
      if isinstance(name, str) and name.startswith("block_") and n > 1:
        block = int(name[len("block_"):])
      elif name is not None:
        names.append(name)
    for b in range(n) if block is None else [block]:
      out[b].setdefault(tuple(names), []).append(np.asarray(leaf))
  return out


def _tiny_pipeline(sizes):
  c = tiny_config("unused", **{"accumulation_steps": 2, "batch_size": 16,
                               "compensation.name": "nesterov_lookahead",
                               "optim.nesterov": True})
  stages = tiny_revnet()
  if sizes:
    stages = partition.group_stages(stages, sizes)
  pipe = pipeline.Pipeline(stages, compensation.stage_optimizers(c, 10, len(stages)),
                           jax.devices()[:1], accumulation_steps=2)
  return pipe, pipe.init(0, random_batch()[0])


def test_drained_checkpoint_restores_regrouped_with_every_blocks_arrays(tmp_path):
  # 5 one-block stages, drained after 3 updates (k = 2, Nesterov look-ahead:
  # a momentum trace in the optimizer state), saved; restored into stages of
  # [1, 2, 2] blocks: every block's parameters, statistics and optimizer
  # state equal those saved, leaf by leaf.
  pipe, state = _tiny_pipeline(None)
  table = pipe.schedule(6)
  state, _ = pipe.run(state, (table[t] for t in range(len(table))),
                      lambda m: random_batch(seed=m))
  assert state.in_flight() == 0
  fields = ("params", "batch_stats", "opt_state")
  saved = [{f: _per_block(getattr(s, f), 1)[0] for f in fields} for s in state.train_states]
  assert any(np.any(v[0] != 0) for k, v in saved[3]["opt_state"].items() if "trace" in k)
  ckpt = checkpoint.Checkpointer(str(tmp_path), keep=1, fingerprint=FP)
  ckpt.save(3, state, extra={})
  ckpt.wait()
  ckpt.close()

  pipe3, template = _tiny_pipeline([1, 2, 2])
  step, restored, _, _ = checkpoint.Checkpointer(str(tmp_path), keep=1,
                                                 fingerprint=FP).restore(template, pipe3.devices)
  assert step == 3 and len(restored.train_states) == 3
  b = 0
  for st, n in zip(restored.train_states, (1, 2, 2)):
    got = {f: _per_block(getattr(st, f), n) for f in fields}
    for i in range(n):
      for f in fields:
        assert got[f][i].keys() == saved[b][f].keys(), (b, f)
        for path, want in saved[b][f].items():
          assert len(got[f][i][path]) == len(want), (b, f, path)
          assert all(np.array_equal(u, v) for u, v in zip(got[f][i][path], want)), (b, f, path)
      assert int(st.micro_batches) == 6
      b += 1
  assert b == 5


def _saved_blocks(workdir, step):
  """The per-block arrays of checkpoint ``step`` as saved (numpy)."""
  path = os.path.join(workdir, "checkpoints", str(step), "arrays")
  return ocp.PyTreeCheckpointer().restore(path)["blocks"]


@pytest.mark.long  # about a minute; logic covered by faster tests (CI time)
def test_drained_checkpoint_resumes_with_four_stages(cifar10_dir, tmp_path):
  # 10 stages, a drained checkpoint every 2 updates; the one at 2 resumes
  # with 4 stages: every block's arrays equal those saved, training goes on.
  wd = str(tmp_path)
  base = {"model.stage_sizes": (), "model.num_stages": 0, "batch_size": 16,
          "accumulation_steps": 2, "steps_per_epoch": 4, "checkpoint_every": 2,
          "checkpoint_drain": True, "eval_every": 0,
          "compensation.name": "nesterov_lookahead+weight_prediction",
          "optim.nesterov": True}
  train.train_and_evaluate(tiny_config(cifar10_dir, **base), wd)
  shutil.rmtree(os.path.join(wd, "checkpoints", "4"))  # resume from the mid-run one
  saved = _saved_blocks(wd, 2)
  assert sorted(saved) == [f"{b:03d}" for b in range(10)]

  c4 = tiny_config(cifar10_dir, **dict(base, **{"model.num_stages": 4, "checkpoint_drain": False}))
  run, progress = assembly.setup(c4, wd)
  assert run.restored_step == 2 and run.pipe.num_stages == 4
  assert schedule_lib.fed(run.schedule[0]) == 4  # the stream restarts at update 2
  b = 0
  assert progress.step == 2 and progress.state.tick == 0
  for st in progress.state.train_states:
    n = checkpoint_blocks.stage_block_count(st)
    for i in range(n):
      got_p = st.params[f"block_{i}"] if n > 1 else st.params
      got_s = st.batch_stats[f"block_{i}"] if n > 1 else st.batch_stats
      for got, want in ((got_p, saved[f"{b:03d}"]["params"]),
                        (got_s, saved[f"{b:03d}"]["batch_stats"])):
        assert jax.tree.structure(got) == jax.tree.structure(want)
        assert all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(got),
                                                         jax.tree.leaves(want)))
      assert int(st.micro_batches) == int(saved[f"{b:03d}"]["micro_batches"]) == 4
      b += 1
  assert b == 10
  run.checkpointer.close()
  train.train_and_evaluate(c4, wd)
  losses = {r["step"]: r["train_loss"] for r in metrics_lib.read_metrics(wd)
            if "train_loss" in r}
  assert sorted(losses) == [1, 2, 3, 4] and all(np.isfinite(list(losses.values())))
