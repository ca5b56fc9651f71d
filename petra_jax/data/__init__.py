"""Image-classification data (paper Sec. 4): CIFAR-10/100, ImageNet32, ImageNet; text:
tiny_shakespeare (``data.text``).

* ``open_split(name, split, data_dir, download=None)`` -> ``Split`` (decoded in
  memory) or ``LazySplit`` (ImageNet, decoded per batch on the host);
* ``make_train_batch_fn(info, device)(split, indices, key)`` -> augmented
  float32 ``[B, H, W, C]`` on ``device`` and int32 labels ``[B]``;
* ``eval_batches(split, info, batch_size)`` -> normalised batches of one shape.

Missing or damaged data raise one ``DataError`` line naming the fix.
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
from petra_jax.data.text import (TextSplit, Vocabulary, load_vocabulary, open_eval_split,
                                 open_text, save_vocabulary)

__all__ = [
    "CROP_RATIO", "CROP_SCALE", "DATASETS", "DataError", "DatasetInfo", "EVAL_RESIZE",
    "IMAGENET_MEAN", "IMAGENET_STD", "LazySplit", "Split", "TrainBatchFn", "augment",
    "batch_indices", "ensure_prepared", "epoch_permutation", "eval_batches",
    "get_dataset_info", "imagenet_eval_image", "imagenet_train_image", "load_split",
    "make_train_batch_fn", "make_update_batch_fn", "normalize", "open_labels", "open_split",
    "random_resized_crop_box", "read_labels", "resolve_data_dir",
    "TextSplit", "Vocabulary", "load_vocabulary", "open_eval_split", "open_text",
    "save_vocabulary",
]
