"""The small-scale studies, one module each; ``python -m petra_jax.studies NAME`` runs one.

See :mod:`petra_jax.studies.cli` for the commands. Pages go to ``runs/studies/<study>`` unless
``--out`` says otherwise.
"""

from petra_jax import train
from petra_jax.studies.cli import STUDIES, main
from petra_jax.studies.common import (STAGE_SPLITS, at_wall_time, mean_reconstruction_error,
                                      output_dir)

__all__ = ["STAGE_SPLITS", "STUDIES", "at_wall_time", "main", "mean_reconstruction_error",
           "output_dir", "train"]
