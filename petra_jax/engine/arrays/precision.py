"""Mixed precision of a stage: the compute dtype inside a block and the dtype
of the streams between blocks and stages (:class:`Precision`)."""

from __future__ import annotations

import dataclasses

import jax

DTYPES = ("float32", "bfloat16")


@dataclasses.dataclass(frozen=True)
class Precision:
  """Mixed-precision policy of a stage (bfloat16, no loss scaling).

  ``compute``: dtype inside a block (parameters cast on use, gradients and
  optimizer state float32, BatchNorm reductions float32); ``streams``: dtype
  between blocks and stages. Logits go to float32 before the loss.

  Raises:
    ValueError: a dtype outside :data:`DTYPES`.
  """
  compute: str = "float32"
  streams: str = "float32"

  def __post_init__(self):
    for d in (self.compute, self.streams):
      if d not in DTYPES:
        raise ValueError(f"unknown dtype {d!r}; choose one of {DTYPES}")

  @property
  def is_float32(self) -> bool:
    return self.compute == self.streams == "float32"


FLOAT32 = Precision()


def cast(tree, dtype: str):
  """Floating leaves of ``tree`` cast to ``dtype`` (others unchanged)."""
  def one(a):
    return a.astype(dtype) if jax.numpy.issubdtype(a.dtype, jax.numpy.floating) else a
  return jax.tree.map(one, tree)
