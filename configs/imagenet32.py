"""The paper's ImageNet32 recipe: RevNet18 trained with PETRA.

Reference: Rivaud et al., ICLR 2025, Sec. 4 and Table 2: PETRA on RevNet18
reaches 54.6 % top-1 on ImageNet32 (backprop: RevNet18 54.6 %, ResNet18
54.0 %). Recipe: 90 epochs, micro-batch 64, k = 4 (the authors' ImageNet
setting; Table 2 picks the best k in {1, ..., 32}), SGD-Nesterov 0.9,
lr 0.1 * 64k / 256 = 0.1, 5 warm-up epochs, lr x0.1 at epochs 30, 60 and 80,
weight decay 1e-4 on kernels. CIFAR stem (3x3 conv, no max-pool), 1000
classes, tfds ``imagenet_resized/32x32`` decoded into memory (about 3.9 GB).

Command::

  python -m petra_jax.train --config=configs/imagenet32.py --workdir=runs/imagenet32

Not run here: ImageNet32 is not on our machines (point to a tfds data dir
with ``--config.data_dir`` or ``TFDS_DATA_DIR``).
"""

from petra_jax import config as default


def get_config():
  c = default.imagenet_recipe("imagenet32")
  return c
