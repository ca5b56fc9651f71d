"""The main job: PETRA on CIFAR-10, RevNet18 width 8 in 4 stages, 12 epochs on a 2-core CPU.

  python -m petra_jax.train --config=configs/cifar10_cpu.py --workdir=runs/cifar10_cpu

Results: docs/recipes.md. ``:runlocal``: a one-minute smoke test.
"""

from petra_jax import config as default


def get_config(variant: str = ""):
  if variant not in ("", "runlocal"):
    raise ValueError(f"Unknown variant {variant!r} of configs/cifar10_cpu.py; use "
                     "--config=configs/cifar10_cpu.py or --config=configs/cifar10_cpu.py:runlocal.")
  c = default.get_config()
  c.model.width = 8
  c.model.stage_sizes = (1, 2, 2, 5)
  c.num_epochs = 12
  c.num_devices = 1
  c.optim.learning_rate = 0.05
  c.optim.schedule = "cosine"
  c.optim.warmup_epochs = 1.0
  c.compensation.name = "nesterov_lookahead+weight_prediction"
  if variant == "runlocal":
    c.model.width = 4
    c.batch_size = 32
    c.num_epochs = 1
    c.steps_per_epoch = 10
    c.log_every = 1
    c.eval_batch_size = 1000
  return c
