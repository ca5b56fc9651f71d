"""Learning-rate schedules by update count: a linear warm-up from 0, then step, cosine,
polynomial or constant."""

from __future__ import annotations

import ml_collections
import optax

LR_SCHEDULES = ("step", "cosine", "polynomial", "constant")


def base_learning_rate(config: ml_collections.ConfigDict) -> float:
  """``config.optim.learning_rate``, or ``0.1 * batch_size / 256`` when 0."""
  lr = config.optim.learning_rate
  return lr if lr > 0 else 0.1 * config.batch_size / 256


def learning_rate_schedule(config: ml_collections.ConfigDict,
                           steps_per_epoch: int) -> optax.Schedule:
  """Linear warm-up from 0 over ``W`` updates, then ``optim.schedule`` over ``T - W``:
  ``step`` (times ``decay_factor`` at each absolute ``decay_epochs``),
  ``cosine`` (to ``end_learning_rate``), ``polynomial``, ``constant``.

  Raises:
    ValueError: unknown schedule name.
  """
  o = config.optim
  lr = base_learning_rate(config)
  warmup = int(round(o.warmup_epochs * steps_per_epoch))
  decay_steps = max(config.num_epochs * steps_per_epoch - warmup, 1)
  end = o.end_learning_rate
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
    raise ValueError(f"Unknown optim.schedule {o.schedule!r}; choose one of {LR_SCHEDULES}.")
  if warmup == 0:
    return main
  return optax.join_schedules([optax.linear_schedule(0.0, lr, warmup), main], [warmup])
