"""Checks of a user's stages, and their trained variables read back as Flax dicts."""

from __future__ import annotations

from typing import Any, Optional, Sequence

from flax.core import unfreeze
import jax

from petra_jax.engine.stages import objective as objective_lib
from petra_jax.engine.stages import stage as stage_lib
from petra_jax.engine.stages.nnx_modules import as_linen

PyTree = Any


def check_stages(stages: Sequence, sample_input: Optional[PyTree] = None,
                 num_classes: Optional[int] = None,
                 objective: objective_lib.Objective = objective_lib.CLASSIFICATION,
                 task: Optional[objective_lib.Objective] = None) -> None:
  """Checks a model (shapes traced, nothing computed).

  Args:
    stages: the model's ``Stage`` list.
    sample_input: stage 0's input, e.g. ``float32[B, H, W, C]``; None checks only the list.
    num_classes: ``K`` of the last stage's ``[B, K]`` logits; None: any ``K``.
    objective: the :class:`~petra_jax.engine.stages.objective.Objective`: logits ``[B, K]`` or
      ``[B, T, V]``.
    task: the deprecated old name of ``objective`` (a ``DeprecationWarning``).

  Raises:
    ValueError: fewer than 2 stages; a module neither linen nor NNX; a stage whose init
      or forward (train and eval mode, called as training calls it: ``train=``) fails,
      naming the stage; a reversible ``F`` changing its input's shape; a last stage not
      giving the objective's logits (``[B, num_classes]`` for classification).
  """
  objective = objective_lib.deprecated_keyword(objective, task)
  if sample_input is None:
    _check_list(stages)
  else:
    checked_outputs(stages, sample_input, num_classes, objective)


def checked_outputs(stages: Sequence, sample_input: PyTree, num_classes: Optional[int] = None,
                    objective: objective_lib.Objective = objective_lib.CLASSIFICATION) -> list:
  """:func:`check_stages`'s checks, which trace every stage; each stage's output from them.

  Returns:
    Per stage its training-mode output for ``sample_input`` as a ``jax.ShapeDtypeStruct``
    pytree (the last: the logits), what :func:`~petra_jax.engine.stages.stage.trace` gives,
    so that a caller that checks need not trace the stages again.

  Raises:
    ValueError: as :func:`check_stages`.
  """
  _check_list(stages)
  x = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), sample_input)
  outputs = []
  for s in stages:
    for b in s.blocks or (s,):
      x = _check_block(b, x)
    outputs.append(x)
  input_shape = jax.tree.leaves(sample_input)[0].shape
  want = objective.logits_shape(input_shape, num_classes or getattr(x, "shape", (0,))[-1])
  if getattr(x, "shape", None) != want:
    raise ValueError(f"the last stage {stages[-1].name!r} gives {getattr(x, 'shape', x)}; it "
                     f"must give logits {objective.logits_doc} = {list(want)}.")
  return outputs


def _check_list(stages: Sequence) -> None:
  """At least 2 stages, each block's module linen or NNX; else one ValueError."""
  if len(stages) < 2:
    raise ValueError(f"a pipeline needs at least 2 stages (the last gives the logits), got "
                     f"{len(stages)}; split the model into more petra_jax.Stage's.")
  for s in stages:
    for b in s.blocks or (s,):
      as_linen(b.module, b.name)


def _check_block(b, x):
  """Block ``b`` traced as training calls it: init, then the forward in train and
  eval mode (and a reversible ``F``'s shape); its training-mode output. Any failure is
  one ValueError naming the stage."""
  try:
    v = jax.eval_shape(lambda x: b.init(jax.random.key(0), x), x)
    if b.reversible:
      x1 = jax.eval_shape(lambda x: (b.pre.apply(x) if b.pre is not None else x)[0], x)
      f = jax.eval_shape(lambda v, x1: stage_lib._apply(b, v["params"], v["batch_stats"],
                                                         x1, True)[0], v, x1)
      if getattr(f, "shape", None) != x1.shape:
        raise _StageError(f"reversible stage {b.name!r}: F maps {x1.shape} to "
                          f"{getattr(f, 'shape', f)}; F must keep its input's shape (or make "
                          "the stage reversible=False).")
    out = [jax.eval_shape(lambda v, x, train=train: stage_lib.forward(
        b, v["params"], v["batch_stats"], x, train=train)[0], v, x) for train in (True, False)]
  except _StageError:
    raise
  except Exception as e:  # pylint: disable=broad-except
    raise ValueError(_failure(b, x, e)) from e
  return out[0]


class _StageError(ValueError):
  """A check's own finding (not wrapped again)."""


def _failure(b, x, e: Exception) -> str:
  """One line: which stage failed how, and the likely fix."""
  shapes = jax.tree.map(lambda a: list(a.shape), x)
  what = (str(e).strip().splitlines() or [""])[0]
  fix = ""
  if isinstance(e, TypeError) and "train" in what:
    fix = ("; training calls module.apply(variables, x, train=True) and evaluation "
           "train=False: give its __call__ a `train: bool = True` argument")
  return (f"stage {b.name!r} fails on its input {shapes} ({type(e).__name__}: {what}){fix}.")


def trained_variables(state) -> list[dict]:
  """Per stage the host's ``{"params", "batch_stats"}``: a Flax variables dict (groups:
  ``"block_i"``), for ``module.apply`` or :func:`update_nnx`.

  Args:
    state: a :class:`PipelineState` (``pipe.init``'s or a trained one).

  Returns:
    One dict per stage, its arrays copied to the host (NumPy); None for a stage that
    another process owns."""
  return [None if s is None else unfreeze(jax.device_get(
      {"params": s.params, "batch_stats": s.batch_stats})) for s in state.train_states]
