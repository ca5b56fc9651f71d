"""Stages with an auxiliary head (logits ``float32[B, K]``), parameters under :data:`AUX_KEY`."""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

from petra_jax.engine.stages.stage import Stage, cross_entropy, forward

AUX_KEY = "aux_head"


@dataclasses.dataclass(frozen=True, eq=False)
class AuxStage(Stage):
  """A stage with an auxiliary ``head`` (parameters under :data:`AUX_KEY`)."""
  head: Optional[nn.Module] = None

  def init(self, key: jax.Array, x) -> dict:
    """The plain stage's variables, plus the head's parameters."""
    variables = super().init(key, x)
    y = jax.eval_shape(lambda v, x: forward(self, v["params"], v["batch_stats"], x)[0],
                       variables, x)
    zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), y)
    head = self.head.init(jax.random.fold_in(key, 7919), zeros)["params"]
    return {"params": {**variables["params"], AUX_KEY: head},
            "batch_stats": variables["batch_stats"]}


def attach(stages: Sequence[Stage], head: nn.Module) -> list[Stage]:
  """``stages`` with ``head`` on every stage but the last."""
  out = [AuxStage(**{f.name: getattr(s, f.name) for f in dataclasses.fields(Stage)}, head=head)
         for s in stages[:-1]]
  return out + [stages[-1]]


def has_head(stage: Stage) -> bool:
  """Whether ``stage`` carries an auxiliary head."""
  return getattr(stage, "head", None) is not None


def block_params(params) -> dict:
  """A stage's parameters without its head's."""
  return {k: v for k, v in params.items() if k != AUX_KEY}


def aux_loss(stage: AuxStage, params, y, labels) -> jax.Array:
  """Mean cross-entropy (float32) of the head on ``y``; ``labels int32[B]``."""
  return cross_entropy(stage.head.apply({"params": params[AUX_KEY]}, y), labels)
