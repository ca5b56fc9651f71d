"""The paper's ImageNet recipe: RevNet18 trained with PETRA.

Reference: Rivaud et al., ICLR 2025, Sec. 4 and Table 2: PETRA on RevNet18
reaches 71.0 % top-1 on ImageNet (backprop: RevNet18 70.8 %, ResNet18 70.8 %,
PyTorch's ResNet18 69.8 %). Recipe: 90 epochs, micro-batch 64, k = 4 (the
authors' ImageNet setting; Table 2 picks the best k in {1, ..., 32}, Fig. 4
shows larger k closing the gap to backprop), SGD-Nesterov 0.9,
lr 0.1 * 64k / 256 = 0.1, 5 warm-up epochs, lr x0.1 at epochs 30, 60 and 80,
weight decay 1e-4 on kernels. ImageNet stem (7x7/2 conv + max-pool); tfds
``imagenet2012`` decoded per batch: random-resized crop 224 + flip for
training, resize 256 + center crop 224 for the validation split.

Command::

  python -m petra_jax.train --config=configs/imagenet.py --workdir=runs/imagenet

Not run here: ImageNet is not on our machines (tfds needs the manually
downloaded archives prepared into a data dir; point to it with
``--config.data_dir`` or ``TFDS_DATA_DIR``).
"""

from petra_jax import config as default


def get_config():
  c = default.imagenet_recipe("imagenet")
  c.eval_batch_size = 250
  return c
