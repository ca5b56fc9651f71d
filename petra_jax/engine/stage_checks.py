"""Checks of a user's stages, and their trained variables read back as Flax dicts."""

from __future__ import annotations

from typing import Any, Optional, Sequence

from flax.core import unfreeze
import jax

from petra_jax.engine import objective
from petra_jax.engine import stage as stage_lib
from petra_jax.engine.nnx_modules import as_linen

PyTree = Any


def check_stages(stages: Sequence, sample_input: Optional[PyTree] = None,
                 num_classes: Optional[int] = None,
                 task: objective.Task = objective.CLASSIFICATION) -> None:
  """Checks a model (shapes traced, nothing computed).

  Args:
    stages: the model's ``Stage`` list.
    sample_input: stage 0's input, e.g. ``float32[B, H, W, C]``; None checks only the list.
    num_classes: ``K`` of the last stage's ``[B, K]`` logits; None: any ``K``.
    task: the :class:`~petra_jax.engine.objective.Task`: logits ``[B, K]`` or ``[B, T, V]``.

  Raises:
    ValueError: fewer than 2 stages; a module neither linen nor NNX; a reversible
      ``F`` changing its input's shape; a last stage not giving the task's logits
      (``[B, num_classes]`` for classification).
  """
  if len(stages) < 2:
    raise ValueError(f"a pipeline needs at least 2 stages (the last gives the logits), got "
                     f"{len(stages)}; split the model into more petra_jax.Stage's.")
  for s in stages:
    for b in s.blocks or (s,):
      as_linen(b.module, b.name)
  if sample_input is None:
    return
  x = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), sample_input)
  for s in stages:
    for b in s.blocks or (s,):
      if b.reversible:
        v = jax.eval_shape(lambda x, b=b: b.init(jax.random.key(0), x), x)
        x1 = jax.eval_shape(lambda x, b=b: (b.pre.apply(x) if b.pre is not None else x)[0], x)
        f = jax.eval_shape(lambda v, x1, b=b: stage_lib._apply(b, v["params"], v["batch_stats"],
                                                                x1, True)[0], v, x1)
        if getattr(f, "shape", None) != x1.shape:
          raise ValueError(f"reversible stage {b.name!r}: F maps {x1.shape} to "
                           f"{getattr(f, 'shape', f)}; F must keep its input's shape (or make "
                           "the stage reversible=False).")
      x = stage_lib.trace([b], x)[0][1]
  input_shape = jax.tree.leaves(sample_input)[0].shape
  want = task.logits_shape(input_shape, num_classes or getattr(x, "shape", (0,))[-1])
  if getattr(x, "shape", None) != want:
    raise ValueError(f"the last stage {stages[-1].name!r} gives {getattr(x, 'shape', x)}; it "
                     f"must give logits {task.logits_doc} = {list(want)}.")


def trained_variables(state) -> list[dict]:
  """Per stage the host's ``{"params", "batch_stats"}``: a Flax variables dict (groups:
  ``"block_i"``), for ``module.apply`` or :func:`update_nnx`."""
  return [None if s is None else unfreeze(jax.device_get(
      {"params": s.params, "batch_stats": s.batch_stats})) for s in state.train_states]
