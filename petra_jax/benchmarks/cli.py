"""What the benchmark commands share: flags (model, data set, width, micro-batch), model, shape."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Callable, Optional, Sequence

from petra_jax import data as data_lib
from petra_jax import models
from petra_jax.engine import periods


def model_name(text: str) -> str:
  """An argparse type: a zoo name (``models.MODEL_SPECS``) or a user's ``MODULE:FUNCTION``."""
  if text in models.MODEL_SPECS or models.is_user_model(text):
    return text
  raise argparse.ArgumentTypeError(f"unknown model {text!r}: choose one of "
                                   f"{sorted(models.MODEL_SPECS)} or pass MODULE:FUNCTION")


def csv_list(kind, choices: Optional[Sequence[str]] = None):
  """An argparse type: a comma-separated list of ``kind`` (in ``choices``)."""
  def parse(text: str) -> list:
    try:
      values = [kind(v) for v in text.split(",") if v.strip()]
    except ValueError:
      raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list") from None
    bad = [v for v in values if (v not in choices if choices else v < 1)]
    if not values or bad:
      need = f"choose from {', '.join(choices)}" if choices else "each at least 1"
      raise argparse.ArgumentTypeError(f"bad value(s) {bad or text!r}: {need}")
    return values
  return parse


def zero_or_one(text: str) -> bool:
  """An argparse type: ``0`` or ``1`` as a bool."""
  if text.strip() not in ("0", "1"):
    raise argparse.ArgumentTypeError(f"{text!r}: 0 or 1")
  return text.strip() == "1"


def zero_or_one_list(text: str) -> list:
  """An argparse type: a comma-separated list of ``0`` and ``1`` as bools."""
  values = [zero_or_one(v) for v in text.split(",") if v.strip()]
  if not values:
    raise argparse.ArgumentTypeError(f"{text!r}: a comma-separated list of 0 and 1")
  return values


def parser(module: str, doc: str, *, model: str, dataset: str, width: int,
           batch_size: int, width_help: Optional[str] = None,
           batch_help: Optional[str] = None) -> argparse.ArgumentParser:
  """``python -m <module>``'s parser with ``--model``, ``--dataset``, ``--batch-size``, ``--width``.

  ``doc``'s first line is the description; the other arguments are the flags' defaults and help.
  """
  p = argparse.ArgumentParser(prog=f"python -m {module}", description=doc.splitlines()[0])
  p.add_argument("--model", default=model, type=model_name,
                 help="a zoo name or MODULE:FUNCTION (docs/api.md)")
  p.add_argument("--dataset", default=dataset, choices=sorted(data_lib.DATASETS),
                 help=f"fixes the image size, stem and classes (default {dataset})")
  p.add_argument("--batch-size", type=int, default=batch_size,
                 help=batch_help or f"images per micro-batch (default {batch_size})")
  p.add_argument("--width", type=int, default=width,
                 help=width_help or f"the model's base width (default {width})")
  return p


def add_compiled_flags(p: argparse.ArgumentParser, lists: tuple = ()) -> None:
  """``--periods-per-dispatch``, ``--unroll-ticks`` and ``--order-writes``, the compiled
  executor's ``N``, ``U`` and whether it orders its carried writes (0 or 1), defaulting to the
  engine's (:mod:`petra_jax.engine.periods`); a flag named in ``lists``
  (``"periods_per_dispatch"``, ``"unroll_ticks"``, ``"order_writes"``) takes a
  comma-separated list, each value timed side by side."""
  flags = (("periods_per_dispatch", periods.PERIODS_PER_DISPATCH,
            "steady-state ticks (or rounds) per call", int, csv_list(int)),
           ("unroll_ticks", periods.UNROLL_TICKS, "ticks per iteration of its scan loop", int,
            csv_list(int)),
           ("order_writes", periods.ORDER_WRITES,
            "1: each carried slot written after the reads of its old value, 0: not",
            zero_or_one, zero_or_one_list))
  for name, default, what, one, many in flags:
    listed = name in lists
    p.add_argument("--" + name.replace("_", "-"), type=many if listed else one,
                   default=[default] if listed else default,
                   help=f"compiled executor: {what}"
                        + ("; a comma-separated list is timed side by side" if listed else "")
                        + f" (default {int(default) if isinstance(default, bool) else default})")


def build(model: str, dataset: str, width: int, depth: Optional[int] = None) -> list:
  """``model``'s stages at ``width`` with ``dataset``'s classes and stem; ValueError as
  ``models.build_model``."""
  d = data_lib.DATASETS[dataset]
  return models.build_model(model, width=width, num_classes=d.num_classes,
                            imagenet_stem=d.imagenet_stem, depth=depth)


def image_shape(dataset: str, image_size: Optional[int] = None) -> tuple[int, ...]:
  """``(H, W, C)`` of one ``dataset`` image, or ``(image_size, image_size, 3)``."""
  if image_size is None:
    return tuple(data_lib.DATASETS[dataset].image_shape)
  return (image_size, image_size, 3)


def emit(report: dict, as_json: bool, print_table: Callable[[dict], None]) -> int:
  """Prints the report as one JSON line or as its table; returns exit status 0."""
  if as_json:
    print(json.dumps(report))
  else:
    print_table(report)
  return 0


def library_main(module: str, runner: str) -> int:
  """``python -m petra_jax.benchmarks.<module>`` of a module without a command line:
  one line naming the command that runs it; 0 with ``--help``, else 2."""
  print(f"python -m petra_jax.benchmarks.{module} has no command line of its own: it is part "
        f"of python -m petra_jax.benchmarks.{runner} (whose --help lists its options; "
        "docs/benchmarks.md).", file=sys.stdout if _asks_help() else sys.stderr)
  return 0 if _asks_help() else 2


def _asks_help() -> bool:
  return any(a in ("-h", "--help") for a in sys.argv[1:])
