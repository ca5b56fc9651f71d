"""One stage's carried state: parameters, BatchNorm statistics, optax state."""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import optax

PyTree = Any


class StageState(flax.struct.PyTreeNode):
  """A Flax ``TrainState`` with BatchNorm statistics.

  ``micro_batches``: int32 scalar, backwards run (updates: ``// k``).
  """
  micro_batches: jax.Array
  params: PyTree
  batch_stats: PyTree
  opt_state: optax.OptState
  tx: optax.GradientTransformation = flax.struct.field(pytree_node=False)

  @classmethod
  def create(cls, params, batch_stats, tx: optax.GradientTransformation) -> "StageState":
    return cls(micro_batches=jnp.zeros((), jnp.int32), params=params,
               batch_stats=batch_stats, opt_state=tx.init(params), tx=tx)

  def apply_gradients(self, grads, batch_stats) -> "StageState":
    """One optax step on ``grads``; ``batch_stats`` replaces the statistics."""
    updates, opt_state = self.tx.update(grads, self.opt_state, self.params)
    return self.replace(micro_batches=self.micro_batches + 1,
                        params=optax.apply_updates(self.params, updates),
                        opt_state=opt_state, batch_stats=batch_stats)
