"""NNX modules as stage modules (``nnx.split``/``nnx.merge``), the stage checks, trained variables.

A converted module's variables are its ``nnx.Param``/``nnx.BatchStat`` values as pure dicts
(integer keys as strings); its call takes ``train``, or ``train()``/``eval()`` set the mode.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

PyTree = Any


def _like(tree, template):
  """``tree`` (string keys) with ``template``'s keys."""
  if not isinstance(template, dict):
    return tree
  return {k: _like(tree[str(k)], v) for k, v in template.items()}


def _declare(scope, params0: Mapping, stats0: Mapping):
  """Nested linen variables (string names) from initial values: ``(params, stat handles)``."""
  params, stats = {}, {}
  for k in {**params0, **stats0}:
    p, s = params0.get(k), stats0.get(k)
    if isinstance(p, Mapping) or isinstance(s, Mapping):  # (linen freezes dict fields)
      sub_params, sub_stats = _declare(scope.push(str(k)), p or {}, s or {})
      params.update({k: sub_params} if sub_params else {})
      stats.update({k: sub_stats} if sub_stats else {})
      continue
    if k in params0:
      params[k] = scope.param(str(k), lambda _, v=p: v)
    if k in stats0:
      stats[k] = scope.variable("batch_stats", str(k), lambda v=s: v)
  return params, stats


def _values(handles):
  return {k: _values(h) if isinstance(h, dict) else h.value for k, h in handles.items()}


def _assign(handles, values):
  for k, h in handles.items():
    if isinstance(h, dict):
      _assign(h, values[k])
    else:
      h.value = values[k]


class FromNNX(nn.Module):
  """A linen view of an NNX module: ``graphdef``, ``initial = (params, batch_stats, rest)``;
  ``source``: the user's module itself (what :func:`update_nnx` writes into)."""
  graphdef: Any
  initial: Any
  takes_train: bool
  source: Any = None

  __hash__ = object.__hash__  # arrays in a field

  @nn.compact
  def __call__(self, x, train: bool = True):
    from flax import nnx  # pylint: disable=g-import-not-at-top
    params0, stats0, rest = self.initial
    params, stats = _declare(self.scope, params0, stats0)
    model = nnx.merge(self.graphdef, params, _values(stats), rest)
    if self.takes_train:
      out = model(x, train=train)
    else:
      (model.train if train else model.eval)()
      out = model(x)
    if stats and self.is_mutable_collection("batch_stats") and not self.is_initializing():
      _assign(stats, nnx.to_pure_dict(nnx.state(model, nnx.BatchStat)))
    return out


def is_nnx(module) -> bool:
  """Whether ``module`` is a ``flax.nnx.Module`` (NNX not imported)."""
  return any(c.__module__.startswith("flax.nnx") and c.__name__ == "Module"
             for c in type(module).__mro__)


def as_linen(module, name: str = "?"):
  """``module`` as linen: an NNX one converted once; ValueError if neither linen nor NNX."""
  if module is None or isinstance(module, nn.Module):
    return module
  if not is_nnx(module):
    raise ValueError(f"stage {name!r}: module is a {type(module).__name__}, neither a "
                     "flax.linen nor a flax.nnx Module; pass a Flax module.")
  from flax import nnx  # pylint: disable=g-import-not-at-top
  graphdef, params, stats, rest = nnx.split(module, nnx.Param, nnx.BatchStat, ...)
  takes_train = "train" in inspect.signature(type(module).__call__).parameters
  return FromNNX(graphdef, (nnx.to_pure_dict(params), nnx.to_pure_dict(stats), rest), takes_train,
                 source=module)


def update_nnx(module, variables: dict) -> None:
  """Writes a stage's trained ``variables`` into its NNX module in place.

  Args:
    module: the user's NNX module, or what holds it: a ``Stage`` built from it (a
      group of NNX blocks: each block's module) or ``stage.module``.
    variables: the stage's ``{"params", "batch_stats"}``
      (:func:`petra_jax.trained_variables`; a group's blocks under ``"block_i"``).

  Raises:
    ValueError: ``module`` holds no NNX module (a linen stage: use ``module.apply``).
  """
  blocks = getattr(module, "blocks", None)
  if blocks:
    for i, block in enumerate(blocks):
      update_nnx(block, {k: v[f"block_{i}"] for k, v in variables.items() if v})
    return
  module = getattr(module, "module", module)  # a Stage
  if isinstance(module, FromNNX):
    module = module.source
  if module is None or not is_nnx(module):
    raise ValueError(f"update_nnx writes into an NNX module; got a {type(module).__name__} "
                     "(a linen stage's trained variables go to stage.module.apply(variables, x)).")
  from flax import nnx  # pylint: disable=g-import-not-at-top
  for kind, collection in ((nnx.Param, "params"), (nnx.BatchStat, "batch_stats")):
    state = nnx.state(module, kind)
    if variables.get(collection):  # (as jax arrays: the host's NumPy ones are read-only)
      values = jax.tree.map(jnp.asarray, variables[collection])
      nnx.replace_by_pure_dict(state, _like(values, nnx.to_pure_dict(state)))
      nnx.update(module, state)
