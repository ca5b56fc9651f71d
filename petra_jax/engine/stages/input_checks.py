"""What a user's loop feeds :class:`~petra_jax.engine.pipeline.Pipeline`, checked against
the input the model declared (``Pipeline.init``'s ``sample_input``).

Images must be floating ``[B, H, W, C]`` (NHWC) as that sample; labels int ``[B]``
class indices (a :class:`~petra_jax.engine.stages.objective.Objective` with ``integer_inputs``, e.g.
next-token prediction, takes int token ids ``[B, T]`` and int targets ``[B, T]``). A mismatch is one ``ValueError`` line saying what was expected and
the fix (channels-first images, raw uint8 pixels, one-hot labels), instead of NaN
losses or a traceback deep in a stage. Only shapes and dtypes are read: nothing
waits for a device.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import numpy as np

from petra_jax.engine.stages import objective as objective_lib


@dataclasses.dataclass(frozen=True)
class Spec:
  """Stage 0's declared input: ``shape`` ``[B, ...]``, and the objective it is trained for."""
  shape: tuple
  objective: objective_lib.Objective


def declared(sample_input, objective: objective_lib.Objective = objective_lib.CLASSIFICATION) -> Optional[Spec]:
  """The model's input spec from ``init``'s ``sample_input`` (None for a pytree input,
  which is not checked); ValueError for integer pixels."""
  if not hasattr(sample_input, "shape") or not hasattr(sample_input, "dtype"):
    return None
  spec = Spec(tuple(sample_input.shape), objective)
  check_dtype(sample_input, spec, "init's sample_input")
  return spec


def _shape(a) -> str:
  return "[" + ", ".join(str(n) for n in a.shape) + "]"


def _expected(spec: Spec) -> str:
  kind = "int" if spec.objective.integer_inputs else "float"
  return f"{kind} [B, {', '.join(str(n) for n in spec.shape[1:])}] (as init's sample_input)"


def check_dtype(images, spec: Spec, where: str) -> None:
  """Raw integer pixels (e.g. uint8 0..255) are refused; token ids may be integers."""
  if spec.objective.integer_inputs:
    return
  if not np.issubdtype(np.dtype(images.dtype), np.floating):
    raise ValueError(
        f"{where}: images are {np.dtype(images.dtype).name}; the model takes floating, "
        "normalised images: pass petra_jax.data.normalize(images, info.mean, info.std) "
        "(or data.make_train_batch_fn / data.eval_batches, which do it).")


def check_images(images, spec: Optional[Spec], where: str) -> None:
  """``images`` against ``spec``: rank, NHWC layout, floating dtype.

  Raises:
    ValueError: one line naming what was expected and the fix.
  """
  if spec is None or images is None or not hasattr(images, "shape"):
    return
  got, want = tuple(images.shape), tuple(spec.shape)
  if got[1:] != want[1:]:
    hint = ""
    if len(got) == 4 == len(want) and got[1] == want[3] and got[2:] == want[1:3]:
      hint = " They look channels-first (NCHW): pass images.transpose(0, 2, 3, 1)."
    raise ValueError(f"{where}: images of shape {_shape(images)}, but the model takes "
                     f"{_expected(spec)}.{hint}")
  check_dtype(images, spec, where)


def check_labels(labels, images, where: str, objective: objective_lib.Objective = objective_lib.CLASSIFICATION
                 ) -> None:
  """``labels`` as int class indices ``[B]`` for ``B`` images.

  Raises:
    ValueError: one-hot or float labels, or a batch size that differs.
  """
  if labels is None or not hasattr(labels, "shape"):
    return
  if objective.target_rank != 1:
    _check_targets(labels, images, where, objective)
    return
  batch = None if images is None or not hasattr(images, "shape") else images.shape[0]
  if len(labels.shape) == 2 and labels.shape[0] == (batch or labels.shape[0]):
    raise ValueError(f"{where}: labels of shape {_shape(labels)} look one-hot; pass int32 "
                     "class indices [B]: labels.argmax(-1).")
  if len(labels.shape) != 1 or (batch is not None and labels.shape[0] != batch):
    raise ValueError(f"{where}: labels of shape {_shape(labels)}, but the model takes int32 "
                     f"class indices [B] = [{batch if batch is not None else 'B'}].")
  if not np.issubdtype(np.dtype(labels.dtype), np.integer):
    raise ValueError(f"{where}: labels are {np.dtype(labels.dtype).name}; pass int32 class "
                     "indices [B]: labels.astype('int32').")


def _check_targets(targets, inputs, where: str, objective: objective_lib.Objective) -> None:
  """Targets of ``objective`` (e.g. next token's int ``[B, T]``) shaped as its inputs say."""
  want = objective.targets_shape(inputs.shape) if hasattr(inputs, "shape") else None
  if (want is not None and tuple(targets.shape) != want) or len(targets.shape) != objective.target_rank:
    raise ValueError(f"{where}: targets of shape {_shape(targets)}, but the {objective.name} objective "
                     f"takes int32 targets {list(want) if want else objective.target_rank}.")
  if not np.issubdtype(np.dtype(targets.dtype), np.integer):
    raise ValueError(f"{where}: targets are {np.dtype(targets.dtype).name}; pass int32 "
                     "targets: targets.astype('int32').")


def _signature(x) -> tuple:
  """What the checks read of ``x``: its shape and dtype (None for what has none)."""
  return getattr(x, "shape", None), getattr(x, "dtype", None)


def checked(batches: Callable, spec: Optional[Spec]) -> Callable:
  """``batches`` (``m -> (images, labels)``) whose every micro-batch is checked; the checks
  read only shapes and dtypes, so a pair of signatures accepted once is not checked again."""
  if spec is None:
    return batches
  accepted: set = set()

  def checked_batches(m):
    images, labels = batches(m)
    key = (_signature(images), _signature(labels))
    if key not in accepted:
      where = f"batches({m})"
      check_images(images, spec, where)
      check_labels(labels, images, where, spec.objective)
      accepted.add(key)
    return images, labels
  return checked_batches
