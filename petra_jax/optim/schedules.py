"""Learning-rate schedules: a linear warm-up, then step, cosine, polynomial or constant.

The paper's recipe (Sec. 4, "Experimental setup"): a linear warm-up from 0
over 5 epochs, then the learning rate multiplied by 0.1 at given epochs, from
a base rate ``0.1 * batch_size / 256`` with ``batch_size`` the images per
update. Schedules count optimizer updates (one per ``batch_size`` images).
Build a run's schedule once and hand it to the optimizers
(:func:`petra_jax.optim.make_optimizer`,
:func:`petra_jax.optim.compensation.stage_optimizers`) and the loss log.
"""

from __future__ import annotations

import ml_collections
import optax

SCHEDULES = ("step", "cosine", "polynomial", "constant")


def base_learning_rate(config: ml_collections.ConfigDict) -> float:
  """``config.optim.learning_rate``, or ``0.1 * batch_size / 256`` when 0."""
  lr = config.optim.learning_rate
  return lr if lr > 0 else 0.1 * config.batch_size / 256


def learning_rate_schedule(config: ml_collections.ConfigDict,
                           steps_per_epoch: int) -> optax.Schedule:
  """Linear warm-up from 0, then ``optim.schedule``, by update count.

  With ``lr`` the base rate, ``W`` the warm-up updates and ``T`` the total
  (``num_epochs * steps_per_epoch``), after the warm-up:

  * ``step``: ``lr * decay_factor ** (number of decay_epochs passed)``; the
    boundaries are absolute epochs (paper: 150/225 or 30/60/80).
  * ``cosine``: from ``lr`` to ``end_learning_rate`` over ``T - W`` updates.
  * ``polynomial``: ``end + (lr - end) (1 - (n - W) / (T - W)) ** power``.
  * ``constant``: ``lr``.

  Args:
    config: the run config (``optim.schedule`` in ``SCHEDULES``,
      ``optim.warmup_epochs``, ``optim.decay_epochs``, ``optim.decay_factor``,
      ``optim.end_learning_rate``, ``optim.polynomial_power``, ``num_epochs``).
    steps_per_epoch: optimizer updates per epoch.

  Returns:
    ``schedule(update_count) -> learning rate`` (float32 scalar).

  Raises:
    ValueError: unknown schedule name.
  """
  o = config.optim
  lr = base_learning_rate(config)
  warmup = int(round(o.warmup_epochs * steps_per_epoch))
  decay_steps = max(config.num_epochs * steps_per_epoch - warmup, 1)
  end = o.end_learning_rate
  # ``main`` counts updates since the end of the warm-up.
  if o.schedule == "step":
    boundaries = {int(round(e * steps_per_epoch)) - warmup: o.decay_factor
                  for e in o.decay_epochs}
    main = optax.piecewise_constant_schedule(lr, boundaries)
  elif o.schedule == "cosine":
    main = optax.cosine_decay_schedule(lr, decay_steps, alpha=end / lr if lr else 0.0)
  elif o.schedule == "polynomial":
    main = optax.polynomial_schedule(lr, end, o.polynomial_power, decay_steps)
  elif o.schedule == "constant":
    main = optax.constant_schedule(lr)
  else:
    raise ValueError(f"Unknown optim.schedule {o.schedule!r}; choose one of {SCHEDULES}.")
  if warmup == 0:
    return main
  return optax.join_schedules([optax.linear_schedule(0.0, lr, warmup), main], [warmup])
