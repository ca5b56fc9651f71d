"""The paper's CIFAR-10 recipe (Sec. 4, Table 2: 94.9 %): RevNet18, PETRA, 300 epochs, k = 2.

  python -m petra_jax.train --config=configs/cifar10.py --workdir=runs/cifar10

Adds delay compensation (docs/compensation.md); ``--config.compensation.name=none`` is the paper's.
"""

from petra_jax import config as default


def get_config():
  c = default.get_config()
  c.compensation.name = "nesterov_lookahead+weight_prediction"
  return c
