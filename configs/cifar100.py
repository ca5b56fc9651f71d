"""CIFAR-100 with the paper's CIFAR-10 recipe (Sec. 4): RevNet18, PETRA, 300 epochs, k = 2.

  python -m petra_jax.train --config=configs/cifar100.py --workdir=runs/cifar100

Table 4's setting (k = 1): ``--config.accumulation_steps=1 --config.batch_size=64``.
"""

from petra_jax import config as default


def get_config():
  c = default.get_config()
  c.dataset = "cifar100"
  return c
