"""Character-level text (``tiny_shakespeare``) through ``tfds.data_source``.

* :class:`Vocabulary`: the sorted characters of the train split; ids ``0 .. V - 1``;
  saved with a run as ``WORKDIR/vocabulary.json`` (:func:`save_vocabulary`).
* :class:`TextSplit`: a split's int32 ids ``[N]`` cut into windows of ``context + 1``
  characters: inputs ``[T]`` and targets ``[T]`` (the inputs shifted by one).
  Training reads every start ``0 .. N - T - 1`` (a seeded permutation per epoch,
  like the images' epochs); evaluation the non-overlapping windows
  ``[i T, (i + 1) T]``, ``i < (N - 1) // T``: window ``i`` feeds ids ``i T .. i T + T - 1``
  and scores ids ``i T + 1 .. i T + T``; the last ``(N - 1) mod T`` ids are never scored.
* :func:`eval_text`: a named evaluation text, a tfds split or :data:`JOINED_SPLITS`'s
  splits joined in order (``nanogpt_val``: nanoGPT's ``shakespeare_char`` validation text).
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Iterator, Sequence

import jax
import numpy as np

from petra_jax.data import errors
from petra_jax.data import prepare
from petra_jax.data import shards
from petra_jax.data import sources

VOCABULARY_FILE = "vocabulary.json"

# Evaluation texts made of several tfds splits, joined in this order. nanoGPT's
# data/shakespeare_char/prepare.py keeps the last 10 % of the whole text as val.bin: the
# characters from 1,003,854 on, which are tfds's validation split followed by its test split.
JOINED_SPLITS = {"nanogpt_val": ("validation", "test")}


@dataclasses.dataclass(frozen=True)
class Vocabulary:
  """Characters ``chars`` (sorted, distinct); id ``i`` is ``chars[i]``."""
  chars: str

  @classmethod
  def from_text(cls, text: str) -> "Vocabulary":
    return cls("".join(sorted(set(text))))

  @property
  def size(self) -> int:
    return len(self.chars)

  def encode(self, text: str) -> np.ndarray:
    """int32 ids ``[len(text)]``; ValueError naming the characters outside the vocabulary."""
    index = {c: i for i, c in enumerate(self.chars)}
    unknown = sorted({c for c in text if c not in index})
    if unknown:
      raise ValueError(f"characters {''.join(unknown)!r} are not in the vocabulary of "
                       f"{self.size} characters; use only {self.chars!r}.")
    return np.fromiter((index[c] for c in text), np.int32, len(text))

  def decode(self, ids: Sequence[int]) -> str:
    return "".join(self.chars[int(i)] for i in ids)


def save_vocabulary(workdir: str, vocabulary: Vocabulary) -> None:
  """Writes ``WORKDIR/vocabulary.json``; ValueError if one there differs (another data set)."""
  path = os.path.join(workdir, VOCABULARY_FILE)
  if os.path.exists(path):
    saved = load_vocabulary(workdir)
    if saved != vocabulary:
      raise ValueError(f"{path} holds another vocabulary ({saved.size} characters) than this "
                       f"run's data ({vocabulary.size}); use another --workdir or --restart.")
    return
  os.makedirs(workdir, exist_ok=True)
  tmp = f"{path}.{os.getpid()}.tmp"
  with open(tmp, "w") as f:
    json.dump({"chars": vocabulary.chars}, f)
  os.replace(tmp, path)


def load_vocabulary(workdir: str) -> Vocabulary:
  """``WORKDIR/vocabulary.json``; FileNotFoundError if absent."""
  with open(os.path.join(workdir, VOCABULARY_FILE)) as f:
    return Vocabulary(json.load(f)["chars"])


@dataclasses.dataclass(frozen=True, eq=False)
class TextSplit:
  """A split's ids cut into windows (module docstring).

  Attributes:
    ids: int32 ``[N]``, read-only.
    context: ``T``, the characters a window feeds the model.
    fixed: non-overlapping evaluation windows; else every start (training).
    vocabulary: the train split's.
  """
  ids: np.ndarray
  context: int
  fixed: bool
  vocabulary: Vocabulary

  def __len__(self) -> int:
    return (len(self.ids) - 1) // self.context if self.fixed else len(self.ids) - self.context

  def windows(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(inputs, targets)`` int32 ``[len(indices), T]`` of windows ``indices``."""
    starts = np.asarray(indices, np.int64) * (self.context if self.fixed else 1)
    rows = self.ids[starts[:, None] + np.arange(self.context + 1)]
    return rows[:, :-1], rows[:, 1:]

  @property
  def labels(self) -> "_Targets":
    """``labels[indices]``: the targets ``[len(indices), T]`` (as a ``Split``'s labels)."""
    return _Targets(self)


@dataclasses.dataclass(frozen=True)
class _Targets:
  split: TextSplit

  def __getitem__(self, indices) -> np.ndarray:
    return self.split.windows(np.atleast_1d(np.asarray(indices)))[1]


def read_text(name: str, split: str, data_dir: str | None = None,
              download: bool | None = None) -> str:
  """The split's text (one UTF-8 record).

  Raises:
    DataError: the data set is missing (one line naming the fix) or damaged.
  """
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top

  info = sources.get_dataset_info(name)
  data_dir = prepare.ensure_prepared(name, data_dir, download)
  try:
    source = tfds.data_source(info.tfds_name, split=split, data_dir=data_dir, download=False)
  except Exception as e:  # pylint: disable=broad-except
    raise errors.missing_data_error(name, data_dir, f"tfds failed ({errors.one_line(e)})") from None
  shards.check_shards(name, info, split, data_dir, source)
  records = sources.read_records(source, range(len(source)), name, data_dir)
  return "".join(r["text"].decode("utf-8") for r in records)


def open_text(name: str, context: int, data_dir: str | None = None,
              download: bool | None = None) -> tuple:
  """``(info, train, test)``: ``info`` with ``image_shape = (T,)`` and ``num_classes = V``;
  ``train`` random windows of the train split, ``test`` fixed windows of ``info.test_split``.

  Raises:
    DataError: missing data; ValueError: ``context < 1`` or a split shorter than a window.
  """
  if context < 1:
    raise ValueError(f"model.context must be >= 1 for {name}, got {context}; set "
                     "--config.model.context.")
  info = sources.get_dataset_info(name)
  train_text = read_text(name, info.train_split, data_dir, download)
  vocabulary = Vocabulary.from_text(train_text)
  splits = []
  for split, text, fixed in ((info.train_split, train_text, False),
                             (info.test_split, None, True)):
    text = read_text(name, split, data_dir, download) if text is None else text
    ids = vocabulary.encode(text)
    ids.flags.writeable = False
    if len(ids) < context + 2:
      raise ValueError(f"{name}/{split} has {len(ids)} characters, fewer than a window of "
                       f"{context + 1}; lower --config.model.context.")
    splits.append(TextSplit(ids, context, fixed, vocabulary))
  info = dataclasses.replace(info, image_shape=(context,), num_classes=vocabulary.size)
  return info, splits[0], splits[1]


def eval_text(name: str, split: str, data_dir: str | None = None) -> str:
  """The text of ``split``: a tfds split, or a key of :data:`JOINED_SPLITS` (its splits'
  texts joined in order).

  Raises:
    DataError: missing data; ValueError: a split the data set does not have.
  """
  info = sources.get_dataset_info(name)
  known = [*dict.fromkeys(s for s in (info.train_split, info.test_split, info.final_split) if s),
           *JOINED_SPLITS]
  if split not in known:
    raise ValueError(f"{name} has no text {split!r}; choose from {', '.join(known)}.")
  return "".join(read_text(name, s, data_dir, False) for s in JOINED_SPLITS.get(split, (split,)))


def open_eval_split(name: str, split: str, context: int, vocabulary: Vocabulary,
                    data_dir: str | None = None) -> TextSplit:
  """Fixed windows of :func:`eval_text` ``(name, split)`` (e.g. the test split's final
  figure, or ``nanogpt_val``: windows cut over the joined text, so one straddles the seam)."""
  ids = vocabulary.encode(eval_text(name, split, data_dir))
  ids.flags.writeable = False
  return TextSplit(ids, context, True, vocabulary)


def eval_batches(split: TextSplit, batch_size: int, device=None
                 ) -> Iterator[tuple[jax.Array, np.ndarray, int]]:
  """``(inputs int32 [B, T] on device, targets int32 [valid, T], valid)`` in order,
  the last batch padded with window 0 (its rows are not scored)."""
  n = len(split)
  for start in range(0, n, batch_size):
    indices = np.arange(start, min(start + batch_size, n))
    valid = len(indices)
    inputs, targets = split.windows(np.pad(indices, (0, batch_size - valid)))
    yield jax.device_put(inputs, device), targets[:valid], valid
