"""Task builders read a stage's context only, and little of it."""

import ast
import dataclasses
import inspect

import pytest

from petra_jax.engine.methods import context
from petra_jax.engine.methods import forward_gradient_tasks
from petra_jax.engine.methods import local_learning
from petra_jax.engine.methods import tasks
from petra_jax.engine.methods import zero_bubble

BUILDER_MODULES = (tasks, local_learning, forward_gradient_tasks, zero_bubble)


def _builders():
  """Every function of the task modules that takes a ``ctx``: ``(name, {fields read})``."""
  for module in BUILDER_MODULES:
    tree = ast.parse(inspect.getsource(module))
    for fn in tree.body:
      if isinstance(fn, ast.FunctionDef) and "ctx" in [a.arg for a in fn.args.args]:
        fields = {n.attr for n in ast.walk(fn) if isinstance(n, ast.Attribute)
                  and isinstance(n.value, ast.Name) and n.value.id == "ctx"}
        yield f"{module.__name__}.{fn.name}", fields


@pytest.mark.parametrize("name, fields", list(_builders()))
def test_builder_reads_at_most_six_context_fields(name, fields):
  known = {f.name for f in dataclasses.fields(context.StageContext)}
  assert fields <= known, (name, fields - known)
  assert len(fields) <= 6, (name, sorted(fields))


def test_no_builder_takes_the_pipeline():
  for module in BUILDER_MODULES:
    assert "pipe" not in {p for _, fn in inspect.getmembers(module, inspect.isfunction)
                          if fn.__module__ == module.__name__
                          for p in inspect.signature(fn).parameters}, module.__name__
