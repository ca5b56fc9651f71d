"""CIFAR-100 with the paper's CIFAR-10 recipe (Sec. 4); docs/recipes.md.

  python -m petra_jax.train --config=configs/cifar100.py --workdir=runs/cifar100
"""

from petra_jax import config as default


def get_config():
  c = default.get_config()
  c.dataset = "cifar100"
  return c
