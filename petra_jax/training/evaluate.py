"""A pipeline's evaluation metrics (its task's) over a whole split, on the device; a
finished text run read back (:func:`load`) and scored on a named text (:func:`text_losses`)."""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Sequence

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from petra_jax import data as data_lib
from petra_jax.engine.stages import objective
from petra_jax.engine.transport import transfers as transport
from petra_jax.engine.pipeline import Pipeline
from petra_jax.training import assembly
from petra_jax.training import checkpoint as checkpoint_lib
from petra_jax.training import console
from petra_jax.training import run_record

TEXT_LOSSES_FILE = "text_losses.json"


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


class NoModelError(ValueError):
  """The workdir holds no trained text model (one line naming the fix)."""


@dataclasses.dataclass
class TrainedModel:
  """``predict(ids int32 [B, T]) -> logits float32 [B, T, V]``; ``step``: its update;
  ``config``: the run's (``WORKDIR/config.json``)."""
  pipe: object
  state: object
  vocabulary: data_lib.Vocabulary
  context: int
  step: int
  config: ml_collections.ConfigDict | None = None

  def predict(self, ids):
    return self.pipe.predict(self.state, jnp.asarray(ids, jnp.int32))


def _no_model(workdir: str, missing: str) -> NoModelError:
  return NoModelError(
      f"{workdir!r} holds no trained language model ({missing} is missing); train one first: "
      f"python -m petra_jax.train --config=configs/shakespeare_cpu.py --workdir={workdir}.")


def load(workdir: str) -> TrainedModel:
  """The newest checkpoint of ``workdir``'s text run: ``WORKDIR/config.json`` rebuilds the
  pipeline, ``WORKDIR/vocabulary.json`` gives the characters, the checkpoint the weights.

  Raises:
    NoModelError: no config.json, vocabulary.json or checkpoint there.
  """
  config_path = os.path.join(workdir, run_record.CONFIG_FILE)
  ckpt_dir = os.path.join(workdir, "checkpoints")
  for path in (config_path, os.path.join(workdir, data_lib.text.VOCABULARY_FILE), ckpt_dir):
    if not os.path.exists(path):
      raise _no_model(workdir, path)
  with open(config_path, encoding="utf-8") as f:
    config = ml_collections.ConfigDict(json.load(f))
  vocabulary = data_lib.load_vocabulary(workdir)
  info = data_lib.get_dataset_info(config.dataset)
  context = config.model.context or info.image_shape[0]
  info = dataclasses.replace(info, image_shape=(context,), num_classes=vocabulary.size)
  micro = config.batch_size // config.accumulation_steps
  pipe, sizes, _ = assembly.build_pipeline(config, workdir, info, micro, config.steps_per_epoch or 1)
  state = pipe.init(config.seed, jnp.zeros((micro, context), jnp.int32))
  restored = assembly.checkpointer(config, workdir, pipe, sizes).restore(
      state, [p.state_sharding for p in pipe.placements])
  if restored is None:
    raise _no_model(workdir, f"a checkpoint in {ckpt_dir}")
  step, state, _, _ = restored
  return TrainedModel(pipe, state, vocabulary, context, step, config)


def text_losses(workdir: str, texts: Sequence[str], data_dir: str | None = None
                ) -> dict[str, float]:
  """Nats per character of ``workdir``'s newest checkpoint on each named text.

  A text is a tfds split or a key of ``data.text.JOINED_SPLITS`` (``nanogpt_val``:
  validation then test, joined), cut as the run's own evaluation cuts its splits: the
  non-overlapping windows of ``data.TextSplit`` (``fixed``) at the run's context, every
  position scored, in batches of the run's ``eval_batch_size``; ``validation`` is then the
  run's last ``val_loss`` and ``test`` its ``test_loss``. Cached in
  ``WORKDIR/text_losses.json`` (``{"step", "losses"}``): a text already scored at the newest
  checkpoint's step is read back, not recomputed.

  Args:
    workdir: a finished (or checkpointed) text run's ``--workdir``.
    texts: the names, e.g. ``("validation", "test", "nanogpt_val")``.
    data_dir: the tfds directory; None: the run's ``config.data_dir``.

  Raises:
    NoModelError: no checkpoint there; DataError: the text is missing.
  """
  newest = checkpoint_lib.newest_meta(os.path.join(workdir, "checkpoints"))
  if newest is None:
    raise _no_model(workdir, f"a checkpoint in {os.path.join(workdir, 'checkpoints')}")
  path = os.path.join(workdir, TEXT_LOSSES_FILE)
  cached = {}
  if os.path.exists(path):
    with open(path, encoding="utf-8") as f:
      saved = json.load(f)
    cached = saved["losses"] if saved.get("step") == newest[0] else {}
  missing = [t for t in texts if t not in cached]
  if missing:
    model = load(workdir)
    for name in missing:
      split = data_lib.open_eval_split(model.config.dataset, name, model.context,
                                       model.vocabulary, data_dir or model.config.data_dir or None)
      cached[name] = evaluate(model.pipe, model.state, split, None,
                              model.config.eval_batch_size, prefix="text")["text_loss"]
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
      json.dump({"step": model.step, "losses": cached}, f, indent=1)
    os.replace(tmp, path)
  return {t: cached[t] for t in texts}
