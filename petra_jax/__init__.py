"""petra_jax: PETRA (Rivaud et al., ICLR 2025) in JAX/Flax; public API in docs/api.md.

Importing the package applies the XLA-CPU work-around (``_xla_flags``) before
JAX starts: import ``petra_jax`` before any JAX computation. The public names
below are imported on first use (``import petra_jax`` does not import JAX);
``Task`` is the deprecated old name of ``Objective`` (a ``DeprecationWarning``).
"""

from petra_jax import _xla_flags

_xla_flags.apply_cpu_workaround()

__version__ = "0.1.0"

__all__ = [
    "CLASSIFICATION", "NEXT_TOKEN", "Objective", "Pipeline", "PipelineState", "Schedule", "Stage",
    "StageState", "build_model", "check_stages", "composed_loss", "get_config", "group_stages",
    "train_and_evaluate", "trained_variables", "update_nnx",
]


def _engine() -> dict:
  """The engine's public names (imports JAX and Flax)."""
  from petra_jax.engine.stages.nnx_modules import update_nnx
  from petra_jax.engine.stages.objective import CLASSIFICATION, NEXT_TOKEN, Objective
  from petra_jax.engine.stages.partition import group_stages
  from petra_jax.engine.pipeline import Pipeline
  from petra_jax.engine.transport.pipeline_state import PipelineState
  from petra_jax.engine.schedules import Schedule
  from petra_jax.engine.stages.stage import Stage, composed_loss
  from petra_jax.engine.stages.stage_checks import check_stages, trained_variables
  from petra_jax.engine.stages.stage_state import StageState
  return {"update_nnx": update_nnx, "CLASSIFICATION": CLASSIFICATION, "NEXT_TOKEN": NEXT_TOKEN,
          "Objective": Objective, "group_stages": group_stages, "Pipeline": Pipeline,
          "PipelineState": PipelineState, "Schedule": Schedule, "Stage": Stage,
          "composed_loss": composed_loss, "check_stages": check_stages,
          "trained_variables": trained_variables, "StageState": StageState}


def _models() -> dict:
  from petra_jax.models import build_model
  return {"build_model": build_model}


def _config() -> dict:
  from petra_jax.config import get_config
  return {"get_config": get_config}


def _training() -> dict:
  from petra_jax.training.loop import train_and_evaluate
  return {"train_and_evaluate": train_and_evaluate}


_LOADERS = {"build_model": _models, "get_config": _config, "train_and_evaluate": _training}


def __getattr__(name):
  if name == "Task":
    from petra_jax.engine.stages import objective
    return objective.deprecated_task()
  if name not in __all__:
    raise AttributeError(f"module 'petra_jax' has no attribute {name!r}")
  globals().update(_LOADERS.get(name, _engine)())
  return globals()[name]


def __dir__():
  return sorted(list(globals()) + __all__)
