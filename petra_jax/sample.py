"""Text from a trained language model: ``python -m petra_jax.sample --workdir=WORKDIR``.

  python -m petra_jax.sample --workdir=runs/shakespeare --prompt="ROMEO:" --length=500 \\
      --temperature=0.8 --seed=0

Prints the prompt and ``length`` characters, each drawn from
``softmax(logits / temperature)`` of the run's newest checkpoint given the last ``T``
characters (``T``: the run's context), or the argmax at temperature 0. The model sees
``T`` positions: a shorter text is padded on the right, which the causal mask hides.

The model is read back by :func:`load`: ``WORKDIR/config.json`` rebuilds the pipeline,
``WORKDIR/vocabulary.json`` gives the characters, the newest checkpoint the weights.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
from typing import Callable

import jax.numpy as jnp
import ml_collections
import numpy as np

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


def next_char_logits(predict: Callable, ids: np.ndarray, context: int) -> np.ndarray:
  """float64 ``[V]``: the logits after ``ids`` (int ``[n]``, ``n >= 1``) from ``predict``
  (int32 ``[1, T]`` -> ``[1, T, V]``) on the last ``T = context`` ids, right-padded."""
  window = ids[-context:]
  padded = np.zeros((1, context), np.int32)
  padded[0, :len(window)] = window
  return np.asarray(predict(padded), np.float64)[0, len(window) - 1]


def generate(predict: Callable, prompt_ids: np.ndarray, length: int, context: int,
             temperature: float = 0.8, seed: int = 0) -> np.ndarray:
  """int32 ``[length]`` ids following ``prompt_ids`` (:func:`next_char_logits` each).

  ``temperature`` 0 takes the argmax; else draws with ``numpy.random.default_rng(seed)``.

  Raises:
    ValueError: an empty prompt, ``length < 0`` or ``temperature < 0``.
  """
  if len(prompt_ids) == 0:
    raise ValueError("the prompt is empty; pass --prompt with at least one character.")
  if length < 0 or temperature < 0:
    raise ValueError(f"--length ({length}) and --temperature ({temperature}) must be >= 0.")
  rng = np.random.default_rng(seed)
  ids = list(int(i) for i in prompt_ids)
  for _ in range(length):
    logits = next_char_logits(predict, np.asarray(ids), context)
    if temperature == 0:
      ids.append(int(np.argmax(logits)))
      continue
    z = logits / temperature
    p = np.exp(z - z.max())
    ids.append(int(rng.choice(len(p), p=p / p.sum())))
  return np.asarray(ids[len(prompt_ids):], np.int32)


def _parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(prog="python -m petra_jax.sample", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--workdir", required=True, help="a text run's --workdir")
  parser.add_argument("--prompt", default="\n", help="the text to continue")
  parser.add_argument("--length", type=int, default=500, help="characters to generate")
  parser.add_argument("--temperature", type=float, default=0.8, help="0: greedy (argmax)")
  parser.add_argument("--seed", type=int, default=0)
  return parser


def main(argv=None) -> int:
  args = _parser().parse_args(argv)
  logging.getLogger("absl").setLevel(logging.ERROR)  # orbax's notes on restoring
  try:
    model = load(args.workdir)
    prompt = model.vocabulary.encode(args.prompt)
    ids = generate(model.predict, prompt, args.length, model.context, args.temperature,
                   args.seed)
  except ValueError as e:  # NoModelError, characters outside the vocabulary, bad flags
    print(f"error: {e}", file=sys.stderr)
    return 1
  print(args.prompt + model.vocabulary.decode(ids))
  return 0


if __name__ == "__main__":
  sys.exit(main())
