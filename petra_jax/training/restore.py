"""A finished or running text run's model, read back from its workdir for inference.

``WORKDIR/config.json`` rebuilds the pipeline, ``WORKDIR/vocabulary.json`` gives the
characters, the newest checkpoint the weights.
"""

from __future__ import annotations

import dataclasses
import json
import os

import jax.numpy as jnp
import ml_collections

from petra_jax import data as data_lib
from petra_jax.training import assembly
from petra_jax.training import run_record


class NoModelError(ValueError):
  """The workdir holds no trained text model (one line naming the fix)."""


@dataclasses.dataclass
class TrainedModel:
  """``predict(ids int32 [B, T]) -> logits float32 [B, T, V]``; ``step``: its update."""
  pipe: object
  state: object
  vocabulary: data_lib.Vocabulary
  context: int
  step: int

  def predict(self, ids):
    return self.pipe.predict(self.state, jnp.asarray(ids, jnp.int32))


def load(workdir: str) -> TrainedModel:
  """The newest checkpoint of ``workdir``'s text run.

  Raises:
    NoModelError: no config.json, vocabulary.json or checkpoint there.
  """
  fix = (f"train one first: python -m petra_jax.train --config=configs/shakespeare_cpu.py "
         f"--workdir={workdir}")
  config_path = os.path.join(workdir, run_record.CONFIG_FILE)
  vocab_path = os.path.join(workdir, data_lib.text.VOCABULARY_FILE)
  ckpt_dir = os.path.join(workdir, "checkpoints")
  for path in (config_path, vocab_path, ckpt_dir):
    if not os.path.exists(path):
      raise NoModelError(f"{workdir!r} holds no trained language model ({path} is missing); "
                         f"{fix}.")
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
    raise NoModelError(f"{ckpt_dir} holds no checkpoint; {fix}.")
  step, state, _, _ = restored
  return TrainedModel(pipe, state, vocabulary, context, step)
