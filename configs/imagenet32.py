"""The paper's ImageNet32 recipe (Sec. 4): RevNet18, PETRA, 90 epochs, k = 4; docs/recipes.md.

  python -m petra_jax.train --config=configs/imagenet32.py --workdir=runs/imagenet32
"""

from petra_jax import config as default


def get_config():
  c = default.get_config()
  c.dataset = "imagenet32"
  c.batch_size = 256
  c.accumulation_steps = 4
  c.num_epochs = 90
  c.optim.decay_epochs = (30, 60, 80)
  c.optim.weight_decay = 1e-4
  return c
