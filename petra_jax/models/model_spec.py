"""A zoo model's description (:class:`ModelSpec`), apart from the builders that read it."""

from __future__ import annotations

import dataclasses
from typing import Sequence

REVERSIBLE_FAMILIES = ("revnet", "revvit", "revgpt")
LANGUAGE_FAMILIES = ("gpt", "revgpt")


@dataclasses.dataclass(frozen=True)
class ModelSpec:
  """A zoo model: family, blocks per group, bottleneck (x4), reversible (``psi``) downsampling,
  ``fixed_size`` (one group of ``depth`` blocks; ViT: layers), ViT heads and MLP ratio."""
  family: str
  blocks_per_group: Sequence[int]
  bottleneck: bool = False
  invertible_downsampling: bool = False
  fixed_size: bool = False
  heads: int = 0
  mlp_ratio: int = 4

  @property
  def reversible(self) -> bool:
    return self.family in REVERSIBLE_FAMILIES

  @property
  def objective(self) -> str:
    """The objective it is built for (``petra_jax.engine.stages.objective``)."""
    return "next_token" if self.family in LANGUAGE_FAMILIES else "classification"

  @property
  def transformer(self) -> bool:
    return self.family in ("revvit", "vit")

  @property
  def expansion(self) -> int:
    return 4 if self.bottleneck else 1
