"""Auxiliary heads: a small classifier on a stage's output (local learning).

Heads (``config.auxiliary.head``) read the stage's output leaves at the first
leaf's resolution, concatenated on channels (``[B, H, W, C_total]``):

* ``linear``: global average pool, ``Dense(K)``;
* ``mlp`` (DGL's "MLP-SR"-like): average pool to ``2 x 2``, flatten,
  ``Dense(hidden)``, ReLU, ``Dense(K)``;
* ``cnn``: ``1 x 1`` convolution to ``hidden``, ReLU, pool to ``2 x 2``, ``Dense(K)``.

On a RevNet block of ``C`` channels per stream, ``mlp`` and ``cnn`` cost under
10 % of the stage for ``hidden <= 0.9 C`` (Belilovsky et al., 2020).
"""

from __future__ import annotations

from typing import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

from petra_jax.engine.methods import auxiliary
from petra_jax.engine.stages.stage import Stage

HEADS = ("linear", "mlp", "cnn")


def head_features(y) -> jax.Array:
  """The head's input: the leaves of ``y`` at the first leaf's resolution,
  concatenated on channels: ``float32[B, H, W, C_total]`` (a ``[B, C]``
  feature vector is read as ``[B, 1, 1, C]``)."""
  leaves = [a if a.ndim == 4 else a.reshape(a.shape[0], 1, 1, -1) for a in jax.tree.leaves(y)]
  same = [a for a in leaves if a.shape[1:3] == leaves[0].shape[1:3]]
  return jnp.concatenate(same, axis=-1).astype(jnp.float32)


def _pool2(x: jax.Array) -> jax.Array:
  """Average pool ``[B, H, W, C]`` to ``[B, 2, 2, C]`` (``H``, ``W`` even),
  flattened to ``[B, 4C]``; a ``1 x 1`` map is tiled."""
  b, h, w, c = x.shape
  if h % 2 or w % 2:
    return jnp.tile(x.mean(axis=(1, 2)), (1, 4))
  return x.reshape(b, 2, h // 2, 2, w // 2, c).mean(axis=(2, 4)).reshape(b, 4 * c)


class AuxHead(nn.Module):
  """A small classifier on a stage's output: ``y -> float32[B, K]`` logits.

  Attributes:
    kind: one of :data:`HEADS`.
    num_classes: ``K``.
    hidden: width of the ``mlp``/``cnn`` hidden layer.
  """
  kind: str
  num_classes: int
  hidden: int = 128

  @nn.compact
  def __call__(self, y):
    x = head_features(y)
    if self.kind == "linear":
      return nn.Dense(self.num_classes)(x.mean(axis=(1, 2)))
    if self.kind == "cnn":
      x = nn.relu(nn.Conv(self.hidden, (1, 1))(x))
      return nn.Dense(self.num_classes)(_pool2(x))
    x = nn.relu(nn.Dense(self.hidden)(_pool2(x)))
    return nn.Dense(self.num_classes)(x)


def with_heads(stages: Sequence[Stage], kind: str, num_classes: int,
               hidden: int = 128) -> list[Stage]:
  """``stages`` with an :class:`AuxHead` on every stage but the last.

  Raises:
    ValueError: unknown ``kind``, or ``hidden < 1``.
  """
  if kind not in HEADS:
    raise ValueError(f"Unknown auxiliary head {kind!r}; choose one of {HEADS} "
                     "(--config.auxiliary.head=...).")
  if hidden < 1:
    raise ValueError(f"auxiliary.hidden must be >= 1, got {hidden}.")
  return auxiliary.attach(stages, AuxHead(kind, num_classes, hidden))
