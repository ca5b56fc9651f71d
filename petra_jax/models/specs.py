"""The model registry (:data:`MODEL_SPECS`), user models ``MODULE:FUNCTION``, ``build_model``."""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import inspect
from typing import Callable, Optional, Sequence

import jax
import jax.numpy as jnp

from petra_jax.engine.stages import stage_checks
from petra_jax.engine.stages.stage import Stage, has_reversible
from petra_jax.models.layers import Head, Stem
from petra_jax.models.model_spec import LANGUAGE_FAMILIES, REVERSIBLE_FAMILIES, ModelSpec  # noqa: F401 (public here)
from petra_jax.models.resnet import resnet_blocks
from petra_jax.models.revnet import revnet_blocks
from petra_jax.models.gpt import gpt_stages
from petra_jax.models.vit import vit_stages


# Stages: stem + sum(blocks_per_group) + head.
MODEL_SPECS = {
    "resnet18": ModelSpec("resnet", (2, 2, 2, 2)),
    "resnet34": ModelSpec("resnet", (3, 4, 6, 3)),
    "resnet50": ModelSpec("resnet", (3, 4, 6, 3), bottleneck=True),
    "resnet101": ModelSpec("resnet", (3, 4, 23, 3), bottleneck=True),
    "revnet18": ModelSpec("revnet", (2, 2, 2, 2)),
    "revnet34": ModelSpec("revnet", (3, 4, 6, 3)),
    "revnet50": ModelSpec("revnet", (3, 4, 6, 3), bottleneck=True),
    "revnet101": ModelSpec("revnet", (3, 4, 23, 3), bottleneck=True),
    "revnet18_inv": ModelSpec("revnet", (2, 2, 2, 2), invertible_downsampling=True),
    "revnet34_inv": ModelSpec("revnet", (3, 4, 6, 3), invertible_downsampling=True),
    "revnet50_inv": ModelSpec("revnet", (3, 4, 6, 3), bottleneck=True,
                              invertible_downsampling=True),
    "revnet_fixed": ModelSpec("revnet", (20,), fixed_size=True),  # authors' --n-layers 20
    "revvit_tiny": ModelSpec("revvit", (12,), fixed_size=True, heads=3),
    "revvit_small": ModelSpec("revvit", (12,), fixed_size=True, heads=6),
    "vit_tiny": ModelSpec("vit", (12,), fixed_size=True, heads=3),
    "vit_small": ModelSpec("vit", (12,), fixed_size=True, heads=6),
    # Decoders over characters (models/gpt.py); width per head: nanoGPT's CPU model is
    # gpt_nano at width 32 (4 layers, 4 heads, 128 wide), its GPU one gpt_small at 64.
    "revgpt_nano": ModelSpec("revgpt", (4,), fixed_size=True, heads=4),
    "revgpt_small": ModelSpec("revgpt", (6,), fixed_size=True, heads=6),
    "gpt_nano": ModelSpec("gpt", (4,), fixed_size=True, heads=4),
    "gpt_small": ModelSpec("gpt", (6,), fixed_size=True, heads=6),
}



def unknown_model_message(name: str) -> str:
  return f"Unknown model {name!r}; choose one of {sorted(MODEL_SPECS)}."


def default_patch_size(imagenet_stem: bool) -> int:
  return 16 if imagenet_stem else 4


def is_user_model(name: str) -> bool:
  return ":" in name


def user_model_function(name: str) -> Callable:
  """``FUNCTION`` of ``"MODULE:FUNCTION"``; ValueError if it does not import or exist."""
  module_name, _, fn_name = name.partition(":")
  fix = "fix --config.model.name=MODULE:FUNCTION"
  try:
    module = importlib.import_module(module_name)
  except Exception as e:  # pylint: disable=broad-except  (the user's module: any error)
    why = (str(e).splitlines() or [""])[0]
    raise ValueError(f"model {name!r}: cannot import {module_name!r} ({type(e).__name__}: "
                     f"{why}); put its directory on PYTHONPATH or {fix}.") from None
  fn = getattr(module, fn_name, None)
  if not callable(fn):
    raise ValueError(f"model {name!r}: module {module_name!r} has no function {fn_name!r}; "
                     f"define it or {fix}.")
  return fn


def source_fingerprint(name: str) -> dict:
  """``{"model_source": sha256 of the module}`` for a user model; ``{}`` for the zoo."""
  if not is_user_model(name):
    return {}
  module = inspect.getmodule(user_model_function(name))
  return {"model_source": hashlib.sha256(inspect.getsource(module).encode()).hexdigest()}


def _build_user_model(name: str, width: int, num_classes: int, depth: Optional[int],
                      image_shape: Optional[Sequence[int]]) -> list[Stage]:
  fn = user_model_function(name)
  kwargs = {"num_classes": num_classes, "width": width, "depth": depth}
  kwargs = {k: v for k, v in kwargs.items() if v is not None}
  params = inspect.signature(fn).parameters
  if not any(p.kind == p.VAR_KEYWORD for p in params.values()):
    kwargs = {k: v for k, v in kwargs.items() if k in params}
  try:
    stages = fn(**kwargs)
  except TypeError as e:  # e.g. a required argument the CLI does not pass
    raise ValueError(f"model {name!r}: {fn.__name__}({', '.join(kwargs)}=...) raised TypeError: "
                     f"{e}; let it take num_classes, width (and depth) as keywords.") from None
  if not isinstance(stages, (list, tuple)) or not all(isinstance(s, Stage) for s in stages):
    raise ValueError(f"model {name!r} returned {type(stages).__name__}; return a list of "
                     "petra_jax.Stage.")
  sample = None if image_shape is None else jax.ShapeDtypeStruct((2, *image_shape), jnp.float32)
  stage_checks.check_stages(stages, sample, num_classes if image_shape else None)
  return list(stages)


def is_reversible(name: str, width: int = 8, depth: Optional[int] = None) -> bool:
  """Whether the model has reversible stages (PETRA and RevProp need them)."""
  if not is_user_model(name):
    return MODEL_SPECS[name].reversible
  return has_reversible(_build_user_model(name, width, 10, depth, None))


def _resolve_spec(name: str, depth: Optional[int]) -> ModelSpec:
  """``MODEL_SPECS[name]``, with ``depth`` blocks for a fixed-size model (else ValueError)."""
  spec = MODEL_SPECS[name]
  if depth is None:
    return spec
  fixed = sorted(n for n, s in MODEL_SPECS.items() if s.fixed_size)
  if not spec.fixed_size:
    raise ValueError(f"model.depth applies to {fixed} only; {name} has fixed block counts.")
  if depth < 1:
    raise ValueError(f"model.depth must be >= 1, got {depth}.")
  return dataclasses.replace(spec, blocks_per_group=(depth,))


def build_model(name: str, *, width: int = 64, num_classes: int = 10,
                imagenet_stem: bool = False, depth: Optional[int] = None,
                patch_size: Optional[int] = None, tokenizer: str = "patch",
                image_shape: Optional[Sequence[int]] = None) -> list[Stage]:
  """The stages of a model, one residual block per stage (paper Sec. 4).

  Args:
    name: a key of :data:`MODEL_SPECS`, or ``"MODULE:FUNCTION"``: called as
      ``FUNCTION(num_classes=, width=, depth=)`` (the keywords it accepts;
      ``depth`` when not None), returning a list of ``Stage``.
    width: base channels (paper: 64); group ``g`` has ``width 2**g``. ViTs, GPTs: per head.
    num_classes: classes, or a language model's vocabulary size.
    depth: blocks of a fixed-size model (ViT: layers); None for its default.
    image_shape: ``[H, W, C]``: a user model's stages are traced and checked.

  Returns:
    One :class:`Stage` per residual block (stem and head included), in order; group
    them with :func:`group_stages`.

  Raises:
    ValueError: an unknown ``name``, ``width < 1``, a bad ``depth`` or
      ``tokenizer``, a user model that does not import or whose stages are wrong.
  """
  if is_user_model(name):
    return _build_user_model(name, width, num_classes, depth, image_shape)
  if name not in MODEL_SPECS:
    raise ValueError(f"{unknown_model_message(name)[:-1]} or MODULE:FUNCTION "
                     "(--config.model.name=...).")
  if width < 1:
    raise ValueError(f"model.width must be >= 1, got {width}.")
  spec = _resolve_spec(name, depth)
  if spec.family in LANGUAGE_FAMILIES:  # num_classes: the vocabulary's size
    return gpt_stages(spec, width, num_classes)
  if spec.transformer:
    return vit_stages(spec, width, num_classes, patch_size or default_patch_size(imagenet_stem),
                      tokenizer)
  build = revnet_blocks if spec.reversible else resnet_blocks
  stem = Stem(width, imagenet=imagenet_stem, two_streams=spec.reversible)
  return ([Stage("stem", stem, reversible=False)] + build(spec, width) +
          [Stage("head", Head(num_classes), reversible=False)])
