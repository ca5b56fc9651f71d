"""What a pipeline is trained for: an :class:`Objective` (its loss, targets' shape and metrics).

Both objectives share one loss, the mean softmax cross-entropy over every target
position (:func:`petra_jax.engine.stages.stage.cross_entropy`), so every method,
schedule and compensation trains either unchanged. ``Task`` is the deprecated
old name of :class:`Objective`:

* ``classification``: logits ``[B, K]``, int32 labels ``[B]``; metrics loss
  (nats per example) and accuracy.
* ``next_token``: logits ``[B, T, V]``, int32 targets ``[B, T]`` (the input
  shifted by one); the loss is the mean over the ``B T`` tokens (nats per
  character for a character vocabulary); metrics add bits per character
  ``loss / ln 2`` and perplexity ``exp(loss)``.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import optax


def cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
  """Mean softmax cross-entropy in float32: ``logits [..., K]``, int ``targets [...]``."""
  return optax.softmax_cross_entropy_with_integer_labels(
      logits.astype(jnp.float32), targets).mean()


@jax.jit
def eval_sums(logits: jax.Array, targets: jax.Array, valid: jax.Array):
  """Summed cross-entropy and argmax hits over the first ``valid`` rows.

  Args:
    logits: float ``[B, ..., K]``; targets: int32 ``[B, ...]``; valid: int32 scalar.

  Returns:
    float32 ``sum -log softmax(logits)[target]`` and int32 ``sum [argmax == target]``
    over every position of the rows ``i < valid``.
  """
  keep = jnp.arange(logits.shape[0]) < valid
  keep = keep.reshape((-1,) + (1,) * (targets.ndim - 1))
  loss = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets)
  hits = jnp.argmax(logits, axis=-1) == targets
  return jnp.sum(jnp.where(keep, loss, 0.0)), jnp.sum(hits & keep, dtype=jnp.int32)


def _classification_metrics(loss_sum: float, hits: int, count: int) -> dict:
  return {"loss": loss_sum / count, "accuracy": hits / count}


def _next_token_metrics(loss_sum: float, hits: int, count: int) -> dict:
  nats = loss_sum / count
  return {"loss": nats, "bits_per_char": nats / math.log(2), "perplexity": math.exp(nats),
          "accuracy": hits / count}


@dataclasses.dataclass(frozen=True)
class Objective:
  """A training objective.

  Attributes:
    name: ``"classification"`` or ``"next_token"``.
    target_rank: rank of the int32 targets: 1 (``[B]``) or 2 (``[B, T]``).
    loss: ``(logits, targets) -> float32`` scalar, the mean over every target.
    summarize: ``(loss_sum, hits, count) -> {metric: value}`` of an evaluation;
      ``count`` targets scored.
    logits_doc: the logits' shape in words, for error messages.
    integer_inputs: stage 0 takes int token ids ``[B, T]`` (else floating images).
    examples: what one example is, plural, for the console (``"images"``).
  """
  name: str
  target_rank: int
  integer_inputs: bool = False
  logits_doc: str = "[B, num_classes]"
  examples: str = "images"
  loss: Callable = cross_entropy
  summarize: Callable = _classification_metrics

  def targets_shape(self, input_shape) -> tuple:
    """The targets' shape for a model input of ``input_shape`` (``[B, H, W, C]`` or ``[B, T]``)."""
    return tuple(input_shape[:self.target_rank])

  def logits_shape(self, input_shape, num_outputs: int) -> tuple:
    """``[B, K]`` (classification) or ``[B, T, V]`` (next token)."""
    return self.targets_shape(input_shape) + (num_outputs,)

  def metrics(self, loss_sum: float, hits: int, count: int, prefix: str = "test") -> dict:
    """``{prefix}_{metric}`` of an evaluation's sums over ``count`` targets."""
    return {f"{prefix}_{k}": v for k, v in self.summarize(loss_sum, hits, count).items()}


CLASSIFICATION = Objective("classification", 1)
NEXT_TOKEN = Objective("next_token", 2, integer_inputs=True, logits_doc="[B, T, vocab_size]",
                  examples="sequences", summarize=_next_token_metrics)
OBJECTIVES = {o.name: o for o in (CLASSIFICATION, NEXT_TOKEN)}


def get(name: str) -> Objective:
  """``OBJECTIVES[name]``.

  Raises:
    ValueError: an unknown name (the message names the known objectives).
  """
  try:
    return OBJECTIVES[name]
  except KeyError:
    raise ValueError(f"Unknown objective {name!r}; choose one of {sorted(OBJECTIVES)}.") from None


def deprecated_task() -> type:
  """:class:`Objective`, with a ``DeprecationWarning``: ``Task`` was its name until 0.1."""
  warnings.warn("petra_jax.Task is renamed petra_jax.Objective; Task will be removed in the "
                "next release.", DeprecationWarning, stacklevel=3)
  return Objective


def deprecated_keyword(objective: Objective, task: Optional[Objective]) -> Objective:
  """``task`` (with a ``DeprecationWarning``: the old keyword) if given, else ``objective``."""
  if task is None:
    return objective
  warnings.warn("the keyword task= is renamed objective=; task= will be removed in the next "
                "release.", DeprecationWarning, stacklevel=3)
  return task


def __getattr__(name: str):
  if name == "Task":
    return deprecated_task()
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
