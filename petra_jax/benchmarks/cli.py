"""What the benchmark commands share: their parser, model flags, model and image shape.

Every ``python -m petra_jax.benchmarks.*`` command names a model, a data set,
a base width and a micro-batch size the same way; :func:`parser` adds those
flags (each command keeps its own defaults and help texts), :func:`build`
builds the model for the data set and :func:`image_shape` gives one image's
shape, optionally at a smaller side for tiny smoke runs.
"""

from __future__ import annotations

import argparse
import json
from typing import Callable, Optional

from petra_jax import data as data_lib
from petra_jax import models


def parser(module: str, doc: str, *, model: str, dataset: str, width: int,
           batch_size: int, width_help: Optional[str] = None,
           batch_help: Optional[str] = None) -> argparse.ArgumentParser:
  """The command's parser with ``--model``, ``--dataset``, ``--batch-size``, ``--width``.

  Args:
    module: the command's module, e.g. ``"petra_jax.benchmarks.memory"``
      (the parser's ``prog`` is ``python -m <module>``).
    doc: the module docstring (its first line is the description).
    model, dataset, width, batch_size: the flags' defaults.
    width_help, batch_help: the flags' help texts (none by default).

  Returns:
    An :class:`argparse.ArgumentParser`; the command adds its own flags.
  """
  p = argparse.ArgumentParser(prog=f"python -m {module}", description=doc.splitlines()[0])
  p.add_argument("--model", default=model, choices=sorted(models.MODEL_SPECS))
  p.add_argument("--dataset", default=dataset, choices=sorted(data_lib.DATASETS))
  p.add_argument("--batch-size", type=int, default=batch_size, help=batch_help)
  p.add_argument("--width", type=int, default=width, help=width_help)
  return p


def build(model: str, dataset: str, width: int, depth: Optional[int] = None) -> list:
  """``model``'s stages at ``width`` with ``dataset``'s classes and stem.

  Raises:
    ValueError: as :func:`petra_jax.models.build_model` (e.g. a ``depth`` for
      a model whose block counts are fixed).
  """
  d = data_lib.DATASETS[dataset]
  return models.build_model(model, width=width, num_classes=d.num_classes,
                            imagenet_stem=d.imagenet_stem, depth=depth)


def image_shape(dataset: str, image_size: Optional[int] = None) -> tuple[int, ...]:
  """``(H, W, C)`` of one ``dataset`` image, or ``(image_size, image_size, 3)``."""
  if image_size is None:
    return tuple(data_lib.DATASETS[dataset].image_shape)
  return (image_size, image_size, 3)


def emit(report: dict, as_json: bool, print_table: Callable[[dict], None]) -> int:
  """Prints a benchmark's report: one JSON line with ``--json``, else its
  table. Returns the exit status 0."""
  if as_json:
    print(json.dumps(report))
  else:
    print_table(report)
  return 0
