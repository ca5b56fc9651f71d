"""Optimizers, learning-rate schedules and per-stage delay compensations (optax)."""

from petra_jax.optim.optimizers import (OPTIMIZERS, LarcState, accumulate, base_optimizer,
                                        kernel_mask, make_optimizer, momentum_chain,
                                        scale_by_larc)
from petra_jax.optim.schedules import LR_SCHEDULES, base_learning_rate, learning_rate_schedule

__all__ = [
    "OPTIMIZERS", "LarcState", "LR_SCHEDULES", "accumulate", "base_learning_rate",
    "base_optimizer", "kernel_mask", "learning_rate_schedule", "make_optimizer",
    "momentum_chain", "scale_by_larc",
]
