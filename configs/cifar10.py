"""The paper's CIFAR-10 recipe (Sec. 4) with delay compensation; results: docs/recipes.md.

  python -m petra_jax.train --config=configs/cifar10.py --workdir=runs/cifar10
"""

from petra_jax import config as default


def get_config():
  c = default.get_config()
  c.compensation.name = "nesterov_lookahead+weight_prediction"
  return c
