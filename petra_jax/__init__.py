"""petra_jax: PETRA (Rivaud et al., ICLR 2025) in JAX/Flax; public API in docs/api.md.

Importing the package applies the XLA-CPU work-around (``_xla_flags``) before
JAX starts: import ``petra_jax`` before any JAX computation. The public names
below are imported on first use.
"""

import importlib

from petra_jax import _xla_flags

_xla_flags.apply_cpu_workaround()

__version__ = "0.1.0"

_PUBLIC = {
    "Stage": "petra_jax.engine.stage",
    "Pipeline": "petra_jax.engine.pipeline",
    "PipelineState": "petra_jax.engine.pipeline_state",
    "StageState": "petra_jax.engine.stage_state",
    "Schedule": "petra_jax.engine.schedule",
    "Task": "petra_jax.engine.objective",
    "CLASSIFICATION": "petra_jax.engine.objective",
    "NEXT_TOKEN": "petra_jax.engine.objective",
    "composed_loss": "petra_jax.engine.stage",
    "group_stages": "petra_jax.engine.partition",
    "build_model": "petra_jax.models",
    "check_stages": "petra_jax.engine.stage_checks",
    "trained_variables": "petra_jax.engine.stage_checks",
    "update_nnx": "petra_jax.engine.nnx_modules",
    "get_config": "petra_jax.config",
    "train_and_evaluate": "petra_jax.training.loop",
}
__all__ = [  # the keys of _PUBLIC
    "CLASSIFICATION", "NEXT_TOKEN", "Task", "Pipeline", "PipelineState", "Schedule", "Stage", "StageState", "build_model", "check_stages",
    "composed_loss", "get_config", "group_stages", "train_and_evaluate", "trained_variables",
    "update_nnx",
]


def __getattr__(name):
  if name not in _PUBLIC:
    raise AttributeError(f"module 'petra_jax' has no attribute {name!r}")
  value = getattr(importlib.import_module(_PUBLIC[name]), name)
  globals()[name] = value
  return value


def __dir__():
  return sorted(list(globals()) + __all__)
