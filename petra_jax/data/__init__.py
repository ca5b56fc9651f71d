"""Image-classification data: tfds splits, batching and augmentation.

Data sets (paper Sec. 4): CIFAR-10, CIFAR-100, ImageNet32 and ImageNet. The
small ones are decoded once into host memory (``load_split``); their random
crop / flip / normalisation runs on the accelerator as a jittable pure function
(``augment``). ImageNet (1.28M images) cannot be held in memory: its split is a
``LazySplit`` whose records are read and decoded per batch on the host, with
the standard random-resized crop for training and resize 256 / center crop 224
for evaluation. Either way the training loop sees index batches
(``batch_indices``) and one uniform API:

* ``open_split(name, split, data_dir, download=None)`` -> ``Split`` or
  ``LazySplit``;
* ``make_train_batch_fn(info, device)(split, indices, key)`` -> augmented,
  normalised float32 images on ``device`` and their int32 labels;
* ``eval_batches(split, info, batch_size)`` -> normalised batches of one shape
  (the last one padded) with their labels and valid counts.

Opening a split checks the data first and fails with one ``DataError`` line
that names the fix: a data set that is not prepared in the data dir (CIFAR is
downloaded and prepared by tfds on first use unless ``download=False``;
``ensure_prepared``), and a shard file that is missing, truncated or holds
another number of records than the data set's metadata says (re-prepare it).
Only the shards' footers are read for that, not their records.

Modules, one concept each:

* ``sources``: the registry (``DatasetInfo``, ``DATASETS``), ``Split`` /
  ``LazySplit``, tfds builders and data sources, record reads;
* ``prepare``: the data dir, and preparing a missing data set with tfds;
* ``shards``: the integrity check of a split's shard files;
* ``splits``: ``load_split`` / ``open_split`` / ``open_labels``;
* ``augment``: normalisation, CIFAR augmentation, ImageNet crops;
* ``batches``: epoch order, training and evaluation batches;
* ``errors``: ``DataError`` and the texts of the fixes.

Example:
  info = get_dataset_info("cifar100")
  train = open_split("cifar100", info.train_split)
  batch_fn = make_train_batch_fn(info, jax.devices()[0])
  for step, idx in enumerate(batch_indices(len(train), 128, seed=0, epoch=0)):
    x, y = batch_fn(train, idx, jax.random.fold_in(key, step))
    # x: f32 [128, 32, 32, 3] on the device; y: int32 [128] (numpy)
"""

from petra_jax.data.augment import (
    CROP_RATIO,
    CROP_SCALE,
    EVAL_RESIZE,
    augment,
    imagenet_eval_image,
    imagenet_train_image,
    normalize,
    random_resized_crop_box,
)
from petra_jax.data.batches import (
    TrainBatchFn,
    batch_indices,
    epoch_permutation,
    eval_batches,
    make_train_batch_fn,
    make_update_batch_fn,
)
from petra_jax.data.errors import DataError
from petra_jax.data.prepare import ensure_prepared, resolve_data_dir
from petra_jax.data.sources import (
    DATASETS,
    IMAGENET_MEAN,
    IMAGENET_STD,
    DatasetInfo,
    LazySplit,
    Split,
    get_dataset_info,
)
from petra_jax.data.splits import load_split, open_labels, open_split, read_labels

__all__ = [
    "CROP_RATIO", "CROP_SCALE", "DATASETS", "DataError", "DatasetInfo", "EVAL_RESIZE",
    "IMAGENET_MEAN", "IMAGENET_STD", "LazySplit", "Split", "TrainBatchFn", "augment",
    "batch_indices", "ensure_prepared", "epoch_permutation", "eval_batches",
    "get_dataset_info", "imagenet_eval_image", "imagenet_train_image", "load_split",
    "make_train_batch_fn", "make_update_batch_fn", "normalize", "open_labels", "open_split",
    "random_resized_crop_box", "read_labels", "resolve_data_dir",
]
