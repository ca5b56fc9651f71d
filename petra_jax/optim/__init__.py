"""Optimizers, learning-rate schedules and delay compensations (all from optax).

The paper's recipe (Sec. 4, "Experimental setup"): SGD with Nesterov momentum
0.9, weight decay on conv and dense kernels only, a linear warm-up from 0 over
5 epochs, then the learning rate multiplied by 0.1 at given epochs; base
learning rate ``0.1 * batch_size / 256`` with ``batch_size`` the images per
update (``64 k`` in the paper). Gradients are averaged over the ``k``
micro-batches of an update by ``optax.MultiSteps`` (Alg. 1, l. 18-22).

Modules, one concept each:

* :mod:`~petra_jax.optim.schedules`: ``optim.schedule`` (``step``,
  ``cosine``, ``polynomial``, ``constant``, each after the same warm-up).
* :mod:`~petra_jax.optim.optimizers`: ``optim.name`` (``sgd``, ``lars``,
  ``adam``) and gradient accumulation.
* :mod:`~petra_jax.optim.compensation`: per-stage delay compensations
  (``compensation.name``) and the per-stage optimizers and weight predictors
  of a pipeline; their parts in :mod:`~petra_jax.optim.delays`,
  :mod:`~petra_jax.optim.lr_scaling`, :mod:`~petra_jax.optim.momentum` and
  :mod:`~petra_jax.optim.prediction`.
"""

from petra_jax.optim.optimizers import (OPTIMIZERS, LarcState, accumulate, base_optimizer,
                                        kernel_mask, make_optimizer, momentum_chain,
                                        scale_by_larc)
from petra_jax.optim.schedules import SCHEDULES, base_learning_rate, learning_rate_schedule

__all__ = [
    "OPTIMIZERS", "LarcState", "SCHEDULES", "accumulate", "base_learning_rate",
    "base_optimizer", "kernel_mask", "learning_rate_schedule", "make_optimizer",
    "momentum_chain", "scale_by_larc",
]
