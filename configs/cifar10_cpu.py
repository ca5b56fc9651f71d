"""A ten-minute PETRA recipe for a 2-core CPU: a narrow RevNet18 on CIFAR-10.

Command::

  python -m petra_jax.train --config=configs/cifar10_cpu.py --workdir=runs/cifar10_cpu

RevNet18 at width 8, its 10 residual blocks grouped into J = 4 pipeline stages
(stem | rev rev | down rev | down rev down rev head): the second stage is
reversible and reconstructs its input, the others buffer theirs, and the
delays are tau_j = 6, 4, 2, 0 ticks. Batches of 128 images are split into
k = 2 micro-batches of 64 (the paper's micro-batch and k), so a stage's
gradient is at most 3 updates stale. All stages stay on one CPU device
(virtual CPU devices add no compute on 2 cores); the schedule, delays and
reconstructions are PETRA's.

Why 4 stages and not 10: at this width and length, with k = 2, the 10-stage
split (delays up to 18 ticks) learns too slowly. Measured here on the real
CIFAR-10, same recipe over 4 epochs, no compensation: 10 stages reached
57.2 % test accuracy, 5 stages (``stage_sizes=(1, 2, 2, 2, 3)``) 69.1 %; with
this file's compensation, 10 stages at k = 2 reach 63.7 %. For the paper's
one-block-per-stage split use configs/cifar10_cpu_10stages.py (k = 8 and this
compensation: 71.8 % after 4 epochs, level with backprop).

Measured here (2026-11-24, 2-core CPU, nothing else running, the command above
under ``time``, seed 0): **80.80 % test accuracy after 12 epochs, 572.9 s wall
for the whole command**. Test accuracy per epoch: 54.2, 61.0, 66.6, 70.8, 73.4,
74.1, 76.6, 77.9, 78.9, 79.8, 80.8, 80.8 %. An epoch with its evaluation takes
44-51 s (about 1000 images/s), so a slower or busier machine will need more
than 600 s. A second seed (``--config.seed=1``): 80.26 % in 577.5 s. With
``--config.num_epochs=10``: 79.67 % in 461.6 s; with 4 epochs
(this recipe before 2026-11-24): 72.82 %. Those timings predate the fast
BatchNorm (petra_jax.models.batchnorm, issue 23: per-step losses equal to
float32 round-off).

Re-measured after it (2026-11-25, the same 2-core CPU, quiet, one sitting,
seed 0, ``--config.num_epochs=4`` to fit the session, under ``time``): PETRA
**71.92 %** after 4 epochs, 301 s of training (5 min 1 s for the command);
``--config.method=backprop`` with the same model and epochs **71.40 %**, 251 s
(4 min 12 s). Steady epochs: PETRA 66-69 s, backprop 54-56 s (1.24x). In the
same sitting, the code before the fast BatchNorm took 75 s for PETRA's
second epoch (this code: 66 s). On this machine today an epoch takes longer
than on 2026-11-24 (44-51 s then), so the 12-epoch recipe would need about
800 s here.

The full recipe re-measured (2026-11-25 16:00-16:30, the same 2-core CPU, quiet, one sitting,
seed 0, 12 epochs, under ``time``; code with the fast BatchNorm and its one-GEMV sums): PETRA
**79.93 %** after 12 epochs, 865 s of training (866.6 s for the command); epochs: 54.4, 61.9,
66.1, 70.4, 73.2, 73.8, 75.8, 76.9, 78.8, 79.4, 80.0, 79.9 %. ``--config.method=backprop`` with
the same model and epochs: **80.13 %**, 743 s (745.1 s); epochs: 53.2, 60.6, 64.4, 66.7, 71.1,
73.7, 75.5, 76.6, 78.7, 78.8, 79.8, 80.1 %. Steady epochs about 70 s against 60 s (1.16x for the
whole run). At equal wall time, PETRA had 79.4 % at 718 s (epoch 10). This machine was slower
today than on 2026-11-24 (44-51 s epochs then): the 600 s target of the recipe holds only on the
faster machine. One seed each: the 0.2-point gap is within seed noise (80.80 / 80.26 % for two
seeds above).

Delay compensation (``compensation.name``, petra_jax.optim.compensation; default
here since 2026-11-24): Nesterov look-ahead momentum with weight prediction.
Measured on the real CIFAR-10, seed 0, one run each (one seed: a 2-point
difference is suggestive, not proven): at 4 epochs this recipe reached 72.82 %
against 70.66 % without. The full grid (1 epoch, docs/compensation.md): at
this file's 4 stages and k = 2, 57.5 % against 54.8 % without and 53.5-55.1 %
with each single compensation, backprop 58.8 %. At 10 stages
(``stage_sizes="()"``), 2 epochs, k = 2: 53.7 % against 48.0 % without,
backprop 66.7 % (docs/compensation.md). Use
``--config.compensation.name=none`` for plain PETRA.

Variant ``runlocal`` (``--config=configs/cifar10_cpu.py:runlocal``): the same
recipe at width 4, batches of 32 (k = 2 micro-batches of 16), one epoch of 10
updates with a loss line after each and an evaluation at the end: a smoke
test of the whole command in about a minute, not a result.
"""

from petra_jax import config as default


def get_config(variant: str = ""):
  """The recipe; ``variant="runlocal"`` shrinks it to a smoke test.

  Raises:
    ValueError: an unknown variant.
  """
  if variant not in ("", "runlocal"):
    raise ValueError(f"Unknown variant {variant!r} of configs/cifar10_cpu.py; use "
                     "--config=configs/cifar10_cpu.py or --config=configs/cifar10_cpu.py:runlocal.")
  c = default.get_config()
  c.method = "petra"
  c.model.name = "revnet18"
  c.model.width = 8
  c.model.stage_sizes = (1, 2, 2, 5)
  c.batch_size = 128
  c.accumulation_steps = 2
  c.num_epochs = 12
  c.num_devices = 1
  c.eval_every = 1
  c.log_every = 50
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
