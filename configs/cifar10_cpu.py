"""A ten-minute PETRA recipe for a 2-core CPU: a narrow RevNet18 on CIFAR-10.

Command::

  python -m petra_jax.train --config=configs/cifar10_cpu.py --workdir=runs/cifar10_cpu

All 10 stages stay on one CPU device (virtual CPU devices would add no compute
on 2 cores); the schedule, delays tau_j and reconstructions are PETRA's.
"""

from petra_jax import config as default


def get_config():
  c = default.get_config()
  c.method = "petra"
  c.model.name = "revnet18"
  c.model.width = 8
  c.batch_size = 128
  c.accumulation_steps = 1
  c.num_epochs = 4
  c.num_devices = 1
  c.eval_every = 1
  c.log_every = 50
  c.optim.learning_rate = 0.05
  c.optim.schedule = "cosine"
  c.optim.warmup_epochs = 0.5
  return c
