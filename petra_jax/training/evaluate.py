"""A pipeline's evaluation metrics (its task's) over a whole split, on the device."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from petra_jax import data as data_lib
from petra_jax.engine.stages import objective
from petra_jax.engine.transport import transfers as transport
from petra_jax.engine.pipeline import Pipeline
from petra_jax.training import console


def evaluate(pipe: Pipeline, state, split, info, batch_size: int, prefix: str = "test") -> dict:
  """The pipeline task's metrics over the whole split (last batch padded).

  Each batch's sums (:func:`objective.eval_sums`) are computed on the last
  stage's device, added up in float64. Returns ``pipe.objective.metrics``:
  ``{"test_loss", "test_accuracy"}`` for classification, with bits per
  character and perplexity for next-token prediction, keys starting with
  ``prefix`` (``{}`` off process 0).
  """
  n, count = len(split), 0
  sums = []
  bar = console.progress(n, "eval", "img", leave=False)
  for images, labels, valid in _batches(pipe, split, info, batch_size):
    logits = pipe.predict(state, images)
    bar.update(valid)
    count += valid * int(np.prod(np.shape(labels)[1:], dtype=np.int64))
    if logits is None:
      continue
    padded = np.zeros((logits.shape[0],) + np.shape(labels)[1:], np.int32)
    padded[:valid] = labels
    sums.append(objective.eval_sums(logits, padded, np.int32(valid)))
  bar.close()
  loss_sum = sum(float(s) for s, _ in jax.device_get(sums))
  correct = sum(int(c) for _, c in jax.device_get(sums))
  if pipe.multiprocess:
    totals = _to_process_0(pipe, np.array([loss_sum, correct], np.float64))
    if totals is None:
      return {}
    loss_sum, correct = totals
  return pipe.objective.metrics(loss_sum, correct, count, prefix)


def _batches(pipe: Pipeline, split, info, batch_size: int):
  """``(images, labels, valid)`` per batch (images: a shape off stage 0's process)."""
  n = len(split)
  if isinstance(split, data_lib.TextSplit):
    return data_lib.text.eval_batches(split, batch_size, pipe.placements[0].batch)
  if pipe.owns_input:
    return data_lib.eval_batches(split, info, batch_size, pipe.placements[0].batch)
  like = jax.ShapeDtypeStruct((batch_size,) + info.image_shape, jnp.float32)
  return ((like, data_lib.read_labels(split, np.arange(s, min(s + batch_size, n))),
           min(batch_size, n - s)) for s in range(0, n, batch_size))


def _to_process_0(pipe: Pipeline, values: np.ndarray):
  """The last stage's float64 ``values`` on process 0, bit-exact; else None."""
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
