"""The main job with the paper's split (10 stages), k = 8, 4 epochs; results: docs/recipes.md.

  python -m petra_jax.train --config=configs/cifar10_cpu_10stages.py --workdir=runs/cifar10_cpu_10
"""

from petra_jax import config as default


def get_config():
  c = default.get_config()
  c.model.width = 8
  c.accumulation_steps = 8
  c.num_epochs = 4
  c.num_devices = 1
  c.optim.learning_rate = 0.05
  c.optim.schedule = "cosine"
  c.optim.warmup_epochs = 1.0
  c.compensation.name = "nesterov_lookahead+weight_prediction"
  return c
