"""Test loss and accuracy of a pipeline over a whole split, on the device."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax

from petra_jax import data as data_lib
from petra_jax.engine import transport
from petra_jax.engine.pipeline import Pipeline
from petra_jax.training import console


@jax.jit
def batch_sums(logits: jax.Array, labels: jax.Array, valid: jax.Array):
  """Summed cross-entropy and correct predictions of a batch's first ``valid`` rows.

  Args:
    logits: float32 ``[B, K]``; rows past ``valid`` are padding.
    labels: int32 ``[B]`` in ``0 .. K-1`` (padded rows: any class).
    valid: int32 scalar in ``1 .. B``.

  Returns:
    ``(loss_sum, correct)``: float32 ``sum_i -log softmax(logits_i)[labels_i]``
    and int32 ``sum_i [argmax logits_i == labels_i]`` over ``i < valid``
    (argmax: the first of tied maxima).
  """
  keep = jnp.arange(logits.shape[0]) < valid
  loss = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), labels)
  hits = jnp.argmax(logits, axis=-1) == labels
  return jnp.sum(jnp.where(keep, loss, 0.0)), jnp.sum(hits & keep, dtype=jnp.int32)


def evaluate(pipe: Pipeline, state, split, info, batch_size: int) -> dict:
  """Test loss and accuracy over the whole split (the last batch is padded).

  The loss and the hits of each batch are summed on the last stage's device
  (:func:`batch_sums`); only two numbers per batch come back to the host,
  where they are added up in float64.

  Args:
    pipe, state: the pipeline and its state (current weights and running
      BatchNorm statistics).
    split: from ``data.open_split`` (in memory, or lazy for ImageNet).
    info: the dataset's ``data.DatasetInfo``.
    batch_size: images per evaluation batch.

  Multi-process: every process calls it; stage 0's process reads the images,
  the last stage's process the labels and sums the loss and the hits, which
  it sends to process 0 (as float64 bits: the same numbers as one process).

  Returns:
    ``{"test_loss": float, "test_accuracy": float}`` (accuracy in [0, 1]);
    ``{}`` on processes other than 0 in a multi-process run.
  """
  n = len(split)
  sums = []
  bar = console.progress(n, "eval", "img", leave=False)
  for images, labels, valid in _batches(pipe, split, info, batch_size):
    logits = pipe.predict(state, images)
    bar.update(valid)
    if logits is None:  # the last stage is another process's
      continue
    padded = np.zeros(logits.shape[0], np.int32)
    padded[:valid] = labels
    sums.append(batch_sums(logits, padded, np.int32(valid)))
  bar.close()
  loss_sum = sum(float(s) for s, _ in jax.device_get(sums))
  correct = sum(int(c) for _, c in jax.device_get(sums))
  if pipe.multiprocess:
    totals = _to_process_0(pipe, np.array([loss_sum, correct], np.float64))
    if totals is None:
      return {}
    loss_sum, correct = totals
  return {"test_loss": loss_sum / n, "test_accuracy": correct / n}


def _batches(pipe: Pipeline, split, info, batch_size: int):
  """``(images, labels, valid)`` of each batch; on a process that does not
  feed stage 0, images are only their shape (``predict`` needs no more)."""
  n = len(split)
  if pipe.owns_input:
    return data_lib.eval_batches(split, info, batch_size, pipe.placements[0].batch)
  like = jax.ShapeDtypeStruct((batch_size,) + info.image_shape, jnp.float32)
  return ((like, data_lib.read_labels(split, np.arange(s, min(s + batch_size, n))),
           min(batch_size, n - s)) for s in range(0, n, batch_size))


def _to_process_0(pipe: Pipeline, values: np.ndarray):
  """float64 ``values`` computed by the last stage's process, on process 0
  (sent as their uint32 bits, exactly); None on other processes."""
  first, last = pipe.input_device, pipe.output_device
  bits = values.view(np.uint32)
  if pipe.owns_input and pipe.owns_output:
    return values
  if pipe.owns_output:
    transport.transfer(jax.device_put(bits, last), last, first,
                       jax.ShapeDtypeStruct(bits.shape, bits.dtype))
  elif pipe.owns_input:
    received = transport.transfer(None, last, first, jax.ShapeDtypeStruct(bits.shape, bits.dtype))
    return np.asarray(received).view(np.float64)
  return None
