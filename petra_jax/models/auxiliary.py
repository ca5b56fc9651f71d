"""Auxiliary heads: a small classifier on a stage's output (local learning).

Decoupled greedy learning (DGL, Belilovsky et al., ICML 2020) trains each
stage on the loss of a small auxiliary network fed with its output; forward
gradients with local guesses (Fournier et al., ICML 2023) use that loss's
gradient as the guess of the true one. Here such a network is an
:class:`AuxHead`, and a stage that carries one is an :class:`AuxStage`: its
head's parameters live in the stage's own parameter dict under
:data:`AUX_KEY`, so they share the stage's :class:`StageState`, its optax
optimizer and its checkpoint. The stage's forward ignores that key
(:func:`petra_jax.engine.stage.forward` reads only the block's own
variables), so an ``AuxStage`` computes exactly what its plain stage does.

Heads (``config.auxiliary.head``), on the stage's output ``y`` (the streams
``(x1, x2)`` concatenated along channels: ``[B, H, W, 2C]``; arrays set aside
by an invertible downsampling at another resolution are not read):

* ``linear``: global average pool, ``Dense(K)``;
* ``mlp`` (DGL's "MLP-SR"-like): average pool to ``2 x 2``, flatten,
  ``Dense(hidden)``, ReLU, ``Dense(K)``;
* ``cnn``: ``1 x 1`` convolution to ``hidden`` channels, ReLU, average pool
  to ``2 x 2``, flatten, ``Dense(K)``.

No head holds BatchNorm (its state is parameters only). On a RevNet18 block
of ``C`` channels per stream at ``H x W`` the residual function costs about
``18 C^2 H W`` multiply-adds per image; ``mlp`` costs ``8 C hidden + hidden
K``, ``cnn`` ``2 C hidden H W + 4 hidden K``: under 10 % of the stage for
``hidden <= 0.9 C`` (the paper's budget).
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

from petra_jax.engine.stage import Stage, cross_entropy, forward

AUX_KEY = "aux_head"
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


@dataclasses.dataclass(frozen=True, eq=False)
class AuxStage(Stage):
  """A stage that carries an auxiliary head (its parameters under
  :data:`AUX_KEY` of the stage's ``params``)."""
  head: Optional[AuxHead] = None

  def init(self, key: jax.Array, x) -> dict:
    """The plain stage's variables, plus the head's parameters."""
    variables = super().init(key, x)
    y = jax.eval_shape(lambda v, x: forward(self, v["params"], v["batch_stats"], x)[0],
                       variables, x)
    zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), y)
    head = self.head.init(jax.random.fold_in(key, 7919), zeros)["params"]
    return {"params": {**variables["params"], AUX_KEY: head},
            "batch_stats": variables["batch_stats"]}


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
  head = AuxHead(kind, num_classes, hidden)
  out = [AuxStage(**{f.name: getattr(s, f.name) for f in dataclasses.fields(Stage)},
                  head=head) for s in stages[:-1]]
  return out + [stages[-1]]


def has_head(stage: Stage) -> bool:
  """Whether ``stage`` carries an auxiliary head."""
  return getattr(stage, "head", None) is not None


def aux_loss(stage: AuxStage, params, y, labels) -> jax.Array:
  """Mean cross-entropy of the stage's head on its output ``y``:
  ``float32`` scalar (``labels int32[B]``)."""
  return cross_entropy(stage.head.apply({"params": params[AUX_KEY]}, y), labels)


def split_params(params) -> tuple:
  """``(block params, head params)`` of a stage that carries a head."""
  return {k: v for k, v in params.items() if k != AUX_KEY}, params[AUX_KEY]
