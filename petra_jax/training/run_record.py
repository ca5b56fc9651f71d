"""What a workdir keeps of its run: ``config.json``, and how a re-run reads it.

``WORKDIR/config.json`` is the run's whole config, written at the start of
every run; ``--config=WORKDIR/config.json`` runs it again (``train.py``
loads it with :func:`get_config`, this file being a config file).
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Any, Optional

import ml_collections

CONFIG_FILE = "config.json"
# Fields a resumed run may change without a note: its length and intervals.
RUN_LENGTH = ("num_epochs", "max_steps", "eval_every", "evals_per_epoch", "eval_examples",
              "log_every", "checkpoint_every", "checkpoint_minutes")
# What decides where a run ends, saved in its checkpoints (``extra["run"]``).
_END = ("num_epochs", "max_steps", "steps_per_epoch")


def as_dict(config: ml_collections.ConfigDict) -> dict:
  """The config as plain JSON types (tuples become lists)."""
  return json.loads(config.to_json())


def write_config(workdir: str, config: ml_collections.ConfigDict) -> str:
  """Writes ``WORKDIR/config.json`` (atomically); returns its path."""
  os.makedirs(workdir, exist_ok=True)
  path = os.path.join(workdir, CONFIG_FILE)
  with open(path + ".tmp", "w", encoding="utf-8") as f:
    f.write(config.to_json(indent=2, sort_keys=True) + "\n")
  os.replace(path + ".tmp", path)
  return path


def get_config(path: str) -> ml_collections.ConfigDict:
  """The config saved in ``path`` (a ``config.json``) over the defaults.

  Raises:
    ValueError: the file is not a config.json, or names a field that
      :mod:`petra_jax.config` does not have.
  """
  from petra_jax import config as config_lib  # pylint: disable=g-import-not-at-top
  try:
    with open(path, encoding="utf-8") as f:
      saved = json.load(f)
  except (OSError, ValueError) as e:
    raise ValueError(f"cannot read {path} as a config.json ({e}).") from None
  config = config_lib.get_config()
  _merge(config, saved, path, "")
  return config


def _merge(config, saved: dict, path: str, prefix: str) -> None:
  for key, value in saved.items():
    if key not in config:
      raise ValueError(f"{path} sets {prefix}{key}, which this petra_jax does not have; "
                       "delete that field from the file.")
    if isinstance(config[key], ml_collections.ConfigDict):
      _merge(config[key], value, path, f"{prefix}{key}.")
    elif isinstance(config[key], tuple) and isinstance(value, list):
      config[key] = tuple(value)
    else:
      config[key] = value


def _flat(d: dict, prefix: str = "") -> dict:
  out = {}
  for k, v in d.items():
    if isinstance(v, dict):
      out.update(_flat(v, f"{prefix}{k}."))
    else:
      out[f"{prefix}{k}"] = v
  return out


def differences(saved: dict, config: ml_collections.ConfigDict) -> list[str]:
  """``["optim.learning_rate 0.05 -> 0.1", ...]``: the fields that differ
  between a checkpoint's config (:func:`as_dict`) and ``config``, except
  :data:`RUN_LENGTH`'s."""
  old, new = _flat(saved), _flat(as_dict(config))
  return [f"{k} {old.get(k, '(unset)')!r} -> {new.get(k, '(unset)')!r}"
          for k in sorted(set(old) | set(new))
          if k not in RUN_LENGTH and old.get(k) != new.get(k)]


def run_end(config: ml_collections.ConfigDict, total_steps: int) -> dict:
  """What a checkpoint records of where its run ends."""
  return dict({k: config[k] for k in _END}, total_steps=total_steps)


def finished(step: int, extra: dict, config: ml_collections.ConfigDict) -> bool:
  """Whether a checkpoint at ``step`` with ``extra`` is its run's last one,
  and ``config`` asks for the same run length."""
  end = extra.get("run")
  return bool(end) and step == end["total_steps"] and all(config[k] == end[k] for k in _END)


def start_over(workdir: str) -> None:
  """Deletes a workdir's checkpoints, metrics and TensorBoard events."""
  for name in ("checkpoints", "tensorboard"):
    shutil.rmtree(os.path.join(workdir, name), ignore_errors=True)
  for name in ("metrics.jsonl", CONFIG_FILE):
    if os.path.exists(os.path.join(workdir, name)):
      os.remove(os.path.join(workdir, name))


def last_result(workdir: str) -> dict[str, Any]:
  """The last evaluation line of ``WORKDIR/metrics.jsonl`` ({} if none)."""
  result: Optional[dict] = None
  try:
    with open(os.path.join(workdir, "metrics.jsonl"), encoding="utf-8") as f:
      for line in f:
        record = json.loads(line) if line.strip() else {}
        if "test_accuracy" in record:
          result = record
  except (OSError, ValueError):
    pass
  return result or {}
