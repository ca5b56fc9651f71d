"""Text from a trained language model: ``python -m petra_jax.sample --workdir=WORKDIR``.

  python -m petra_jax.sample --workdir=runs/shakespeare --prompt="ROMEO:" --length=500 \\
      --temperature=0.8 --seed=0

Prints the prompt and ``length`` characters, each drawn from
``softmax(logits / temperature)`` of the run's newest checkpoint given the last ``T``
characters (``T``: the run's context), or the argmax at temperature 0. The model sees
``T`` positions: a shorter text is padded on the right, which the causal mask hides.

The model is read back by :func:`load`: ``WORKDIR/config.json`` rebuilds the pipeline,
``WORKDIR/vocabulary.json`` gives the characters, the newest checkpoint the weights.

  python -m petra_jax.sample --workdir=runs/shakespeare --evaluate=validation,test,nanogpt_val

prints instead the newest checkpoint's nats per character on each named text
(``training.evaluate.text_losses``: the run's own fixed windows; ``nanogpt_val`` is tfds's
validation then test, nanoGPT's ``shakespeare_char`` validation text), cached in
``WORKDIR/text_losses.json``.
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Callable

import numpy as np

from petra_jax import data as data_lib
from petra_jax.training import evaluate


# The model read back (``load``) lives with the evaluation that also reads it (the studies
# score finished runs); named here for ``python -m petra_jax.sample`` and its callers.
NoModelError = evaluate.NoModelError
TrainedModel = evaluate.TrainedModel
load = evaluate.load


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
  parser.add_argument("--evaluate", default="",
                      help="comma-separated texts (validation, test, nanogpt_val): print the "
                           "nats per character on each instead of sampling")
  return parser


def main(argv=None) -> int:
  args = _parser().parse_args(argv)
  logging.getLogger("absl").setLevel(logging.ERROR)  # orbax's notes on restoring
  if args.evaluate:
    try:
      losses = evaluate.text_losses(args.workdir, args.evaluate.split(","))
    except (ValueError, data_lib.DataError) as e:  # NoModelError, an unknown or missing text
      print(f"error: {e}", file=sys.stderr)
      return 1
    for name, nats in losses.items():
      print(f"{name}: {nats:.4f} nats/char ({nats / np.log(2):.4f} bits)")
    return 0
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
