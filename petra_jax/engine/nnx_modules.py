"""NNX modules as stage modules (``nnx.split``/``nnx.merge``), the stage checks, trained variables.

A converted module's variables are its ``nnx.Param``/``nnx.BatchStat`` values as pure dicts
(integer keys as strings); its call takes ``train``, or ``train()``/``eval()`` set the mode.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any, Optional, Sequence

from flax.core import unfreeze
import flax.linen as nn
import jax

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
  """A linen view of an NNX module: ``graphdef``, ``initial = (params, batch_stats, rest)``."""
  graphdef: Any
  initial: Any
  takes_train: bool

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
      _assign(stats, nnx.state(model, nnx.BatchStat).to_pure_dict())
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
  return FromNNX(graphdef, (params.to_pure_dict(), stats.to_pure_dict(), rest), takes_train)


def check_stages(stages: Sequence, sample_input: Optional[PyTree] = None,
                 num_classes: Optional[int] = None) -> None:
  """Checks a model (shapes traced, nothing computed).

  Args:
    stages: the model's ``Stage`` list.
    sample_input: stage 0's input, e.g. ``float32[B, H, W, C]``; None checks only the list.
    num_classes: ``K`` of the last stage's ``[B, K]`` logits; None: any ``K``.

  Raises:
    ValueError: fewer than 2 stages; a module neither linen nor NNX; a reversible
      ``F`` changing its input's shape; a last stage not giving ``[B, num_classes]``.
  """
  from petra_jax.engine import stage as stage_lib  # pylint: disable=g-import-not-at-top
  if len(stages) < 2:
    raise ValueError(f"a pipeline needs at least 2 stages (the last gives the logits), got "
                     f"{len(stages)}; split the model into more petra_jax.Stage's.")
  for s in stages:
    for b in s.blocks or (s,):
      as_linen(b.module, b.name)
  if sample_input is None:
    return
  x = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), sample_input)
  for s in stages:
    for b in s.blocks or (s,):
      if b.reversible:
        v = jax.eval_shape(lambda x, b=b: b.init(jax.random.key(0), x), x)
        x1 = (b.pre.apply(x) if b.pre is not None else x)[0]
        f = jax.eval_shape(lambda v, x1, b=b: stage_lib._apply(b, v["params"], v["batch_stats"],
                                                                x1, True)[0], v, x1)
        if getattr(f, "shape", None) != x1.shape:
          raise ValueError(f"reversible stage {b.name!r}: F maps {x1.shape} to "
                           f"{getattr(f, 'shape', f)}; F must keep its input's shape (or make "
                           "the stage reversible=False).")
      x = stage_lib.trace([b], x)[0][1]
  batch = jax.tree.leaves(sample_input)[0].shape[0]
  want = (batch, num_classes if num_classes else getattr(x, "shape", (0, 0))[-1])
  if getattr(x, "shape", None) != want or len(want) != 2:
    raise ValueError(f"the last stage {stages[-1].name!r} gives {getattr(x, 'shape', x)}; it "
                     f"must give logits [B, num_classes] = {list(want)}.")


def trained_variables(state) -> list[dict]:
  """Per stage the host's ``{"params", "batch_stats"}``: a Flax variables dict (groups:
  ``"block_i"``), for ``module.apply`` or :func:`update_nnx`."""
  return [None if s is None else unfreeze(jax.device_get(
      {"params": s.params, "batch_stats": s.batch_stats})) for s in state.train_states]


def update_nnx(module, variables: dict) -> None:
  """Writes a stage's trained ``variables`` into its NNX ``module`` in place."""
  from flax import nnx  # pylint: disable=g-import-not-at-top
  for kind, collection in ((nnx.Param, "params"), (nnx.BatchStat, "batch_stats")):
    state = nnx.state(module, kind)
    if variables.get(collection):
      state.replace_by_pure_dict(_like(variables[collection], state.to_pure_dict()))
      nnx.update(module, state)
