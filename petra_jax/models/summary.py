"""Per-stage shapes and parameter counts (paper Table 2); ``python -m petra_jax.models``.

The one module of :mod:`petra_jax.models` that reads the data registry.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Optional, Sequence

import jax
import jax.numpy as jnp

from petra_jax.data import DATASETS
from petra_jax.engine.stages import stage as stage_lib
from petra_jax.engine.stages.stage import Stage
from petra_jax.models.specs import MODEL_SPECS, build_model, is_user_model, unknown_model_message


def stage_summaries(stages: Sequence[Stage], image_shape: Sequence[int]) -> list[dict]:
  """Per stage (traced): ``index``, ``name``, ``kind``, ``output_shape`` (per stream,
  ``[H, W, C]``, or ``[K]``), ``params`` (trainable), ``carried_shapes`` if any."""
  x = jax.ShapeDtypeStruct((1, *image_shape), jnp.float32)
  rows = []
  for i, (s, (variables, y)) in enumerate(zip(stages, stage_lib.trace(stages, x))):
    out = y[0] if isinstance(y, tuple) else y
    rows.append({
        "index": i,
        "name": s.name,
        "kind": "reversible" if s.reversible else "non-reversible",
        "output_shape": list(out.shape[1:]),
        "params": sum(math.prod(p.shape) for p in jax.tree.leaves(variables["params"])),
    })
    if isinstance(y, tuple) and len(y) > 2:
      rows[-1]["carried_shapes"] = [list(c.shape[1:]) for c in y[2:]]
  return rows


def summarize(name: str, dataset: str, width: int = 64, depth: Optional[int] = None,
              tokenizer: str = "patch", patch_size: Optional[int] = None) -> dict:
  """``{"total_params": int, "stages": [...]}`` on ``dataset``'s input size, stem and classes.

  Raises:
    ValueError: unknown ``name`` or ``dataset``.
  """
  if dataset not in DATASETS:
    raise ValueError(f"Unknown dataset {dataset!r}; choose one of {sorted(DATASETS)}.")
  d = DATASETS[dataset]
  stages = build_model(name, width=width, num_classes=d.num_classes,
                       imagenet_stem=d.imagenet_stem, depth=depth, tokenizer=tokenizer,
                       patch_size=patch_size,
                       image_shape=d.image_shape if is_user_model(name) else None)
  rows = stage_summaries(stages, d.image_shape)
  return {"total_params": sum(r["params"] for r in rows), "stages": rows}


def _parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(
      prog="python -m petra_jax.models",
      description="Print a model's PETRA stages, output shapes (per stream, "
                  "[H, W, C]) and parameter counts.")
  parser.add_argument("name", help=f"model: one of {sorted(MODEL_SPECS)}, or MODULE:FUNCTION "
                      "(your own stages, as --config.model.name; MODULE on PYTHONPATH)")
  parser.add_argument("--dataset", choices=sorted(DATASETS), default="cifar10",
                      help="fixes input size, stem and classes (default cifar10)")
  parser.add_argument("--width", type=int, default=64, help="base width (default 64)")
  parser.add_argument("--depth", type=int, default=None,
                      help="reversible blocks of a fixed-size model (revnet_fixed; default 20)")
  parser.add_argument("--tokenizer", default="patch",
                      help="ViTs: the stem, patch (ViT's) or conv (CCT's); default patch")
  parser.add_argument("--patch-size", type=int, default=None,
                      help="ViTs: the stem's patch (default 4 on 32x32 images, 16 on ImageNet)")
  parser.add_argument("--json", action="store_true",
                      help="print {total_params, stages: [...]} as JSON instead of a table")
  return parser


def _print_table(name: str, dataset: str, width: int, summary: dict) -> None:
  rows = summary["stages"]
  family = MODEL_SPECS[name].family if name in MODEL_SPECS else "your model"
  two_streams = (MODEL_SPECS[name].reversible if name in MODEL_SPECS
                 else any(r["kind"] == "reversible" for r in rows))
  print(f"{name} ({family}) on {dataset}, width {width}: {len(rows)} stages")
  shapes = []
  for r in rows:
    shape = "x".join(map(str, r["output_shape"]))
    if two_streams and r["name"] != "head" and r is not rows[-1]:
      shape = f"2 x {shape}"
    if r.get("carried_shapes"):
      shape += " + " + ", ".join("x".join(map(str, c)) for c in r["carried_shapes"])
    shapes.append(shape)
  col = max(22, *map(len, shapes))
  print(f"{'idx':>3}  {'name':<14} {'kind':<15} {'output (HxWxC)':<{col}} {'params':>12}")
  for r, shape in zip(summary["stages"], shapes):
    print(f"{r['index']:>3}  {r['name']:<14} {r['kind']:<15} {shape:<{col}} {r['params']:>12,}")
  if any(r.get("carried_shapes") for r in summary["stages"]):
    print("(after '+': arrays set aside by invertible downsampling, carried to the head)")
  print(f"total: {summary['total_params']:,} parameters")


def main(argv: Sequence[str] | None = None) -> int:
  """The CLI; returns 0, or 2 after one error line (unknown model, bad width or depth)."""
  args = _parser().parse_args(argv)
  if args.name not in MODEL_SPECS and not is_user_model(args.name):
    print(f"error: {unknown_model_message(args.name)}", file=sys.stderr)
    return 2
  if args.width < 1:
    print(f"error: --width must be >= 1, got {args.width}.", file=sys.stderr)
    return 2
  try:
    summary = summarize(args.name, args.dataset, args.width, args.depth, args.tokenizer,
                        args.patch_size)
  except ValueError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  if args.json:
    print(json.dumps(summary))
  else:
    _print_table(args.name, args.dataset, args.width, summary)
  return 0
