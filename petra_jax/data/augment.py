"""Augmentation and normalisation (paper Sec. 4, "standard data augmentation").

CIFAR and ImageNet32: pad-4 random crop + horizontal flip + per-channel
standardisation, a jittable pure function run on the accelerator
(``augment``). ImageNet: torchvision's ``RandomResizedCrop(224)`` + flip for
training and ``Resize(256)`` + ``CenterCrop(224)`` for evaluation, on the host
with Pillow (``imagenet_train_image``, ``imagenet_eval_image``).
"""

import math
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from PIL import Image

from petra_jax.data import sources

# ImageNet crops: torchvision's RandomResizedCrop(224) for training,
# Resize(256) + CenterCrop(224) to eval.
CROP_SCALE = (0.08, 1.0)
CROP_RATIO = (3 / 4, 4 / 3)
EVAL_RESIZE = 256


def normalize(
    images: jax.Array, mean: Sequence[float], std: Sequence[float]
) -> jax.Array:
  """Per-channel standardisation ``(x / 255 - mean) / std``.

  Args:
    images: ``[..., C]`` pixels in 0..255 (uint8 or float).
    mean: ``[C]`` channel means in [0, 1] units.
    std: ``[C]`` channel standard deviations in [0, 1] units.

  Returns:
    float32 array of the same shape.
  """
  mean = jnp.asarray(mean, jnp.float32)
  std = jnp.asarray(std, jnp.float32)
  return (images.astype(jnp.float32) / 255.0 - mean) / std


def augment(
    key: jax.Array,
    images: jax.Array,
    mean: Sequence[float],
    std: Sequence[float],
    pad: int = 4,
) -> jax.Array:
  """Random crop (zero padding), random horizontal flip, then ``normalize``.

  The standard CIFAR augmentation: each image is zero-padded by ``pad`` pixels
  on every side, a random ``H x W`` window is cut out (offsets uniform in
  ``0 .. 2 * pad``, independently per image), and it is mirrored left-right
  with probability 0.5. Padding happens before normalisation, so padded pixels
  are black (as in torchvision's ``RandomCrop(padding=4)``). Pure and jittable.

  Args:
    key: PRNG key.
    images: uint8 ``[B, H, W, C]``.
    mean: ``[C]`` channel means in [0, 1] units.
    std: ``[C]`` channel standard deviations in [0, 1] units.
    pad: padding in pixels (a static Python int).

  Returns:
    float32 ``[B, H, W, C]``.
  """
  b, h, w, c = images.shape
  crop_key, flip_key = jax.random.split(key)
  offsets = jax.random.randint(crop_key, (b, 2), 0, 2 * pad + 1)
  flips = jax.random.bernoulli(flip_key, 0.5, (b,))
  padded = jnp.pad(images, ((0, 0), (pad, pad), (pad, pad), (0, 0)))

  def crop_flip(image, offset, flip):
    crop = jax.lax.dynamic_slice(image, (offset[0], offset[1], 0), (h, w, c))
    return jnp.where(flip, crop[:, ::-1], crop)

  return normalize(jax.vmap(crop_flip)(padded, offsets, flips), mean, std)


def random_resized_crop_box(
    height: int,
    width: int,
    rng: np.random.Generator,
    scale: tuple[float, float] = CROP_SCALE,
    ratio: tuple[float, float] = CROP_RATIO,
) -> tuple[int, int, int, int]:
  """A random crop box, as torchvision's ``RandomResizedCrop.get_params``.

  Up to 10 tries draw an area fraction uniform in ``scale`` and a log-uniform
  aspect ratio (width / height) in ``ratio``; the first box that fits is
  placed uniformly. If none fits, the central crop of the whole image with
  its aspect ratio clamped to ``ratio`` is returned.

  Args:
    height: image height H in pixels.
    width: image width W in pixels.
    rng: NumPy generator (the only source of randomness).
    scale: bounds of the crop area as a fraction of ``H * W``.
    ratio: bounds of the crop's width / height.

  Returns:
    ``(top, left, crop_height, crop_width)`` in pixels, inside the image.
  """
  area = height * width
  log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
  for _ in range(10):
    target_area = area * rng.uniform(*scale)
    aspect = math.exp(rng.uniform(*log_ratio))
    w = int(round(math.sqrt(target_area * aspect)))
    h = int(round(math.sqrt(target_area / aspect)))
    if 0 < w <= width and 0 < h <= height:
      return int(rng.integers(0, height - h + 1)), int(rng.integers(0, width - w + 1)), h, w
  in_ratio = width / height
  if in_ratio < ratio[0]:
    w, h = width, int(round(width / ratio[0]))
  elif in_ratio > ratio[1]:
    h, w = height, int(round(height * ratio[1]))
  else:
    w, h = width, height
  return (height - h) // 2, (width - w) // 2, h, w


def imagenet_train_image(encoded: bytes, seed: int, size: int = 224) -> np.ndarray:
  """Decodes one image, random-resized-crops it to ``size`` and maybe flips it.

  Bilinear resampling (Pillow), a horizontal flip with probability 0.5.

  Args:
    encoded: JPEG/PNG bytes of an image of any size.
    seed: seed of this image's crop and flip.
    size: output side in pixels.

  Returns:
    uint8 ``[size, size, 3]``.
  """
  rng = np.random.default_rng(seed)
  image = sources.decode(encoded)
  top, left, h, w = random_resized_crop_box(image.height, image.width, rng)
  image = image.resize((size, size), Image.BILINEAR, box=(left, top, left + w, top + h))
  out = np.asarray(image)
  return out[:, ::-1] if rng.random() < 0.5 else out


def imagenet_eval_image(
    encoded: bytes, size: int = 224, resize: int = EVAL_RESIZE
) -> np.ndarray:
  """Decodes one image, resizes its shorter side to ``resize``, center-crops.

  As torchvision's ``Resize(256)`` + ``CenterCrop(224)``, bilinear.

  Args:
    encoded: JPEG/PNG bytes of an image of any size.
    size: output side in pixels.
    resize: shorter side after resizing, in pixels (>= ``size``).

  Returns:
    uint8 ``[size, size, 3]``.
  """
  image = sources.decode(encoded)
  w, h = image.size
  if w <= h:
    new_w, new_h = resize, int(resize * h / w)
  else:
    new_w, new_h = int(resize * w / h), resize
  if (new_w, new_h) != (w, h):
    image = image.resize((new_w, new_h), Image.BILINEAR)
  top, left = int(round((new_h - size) / 2)), int(round((new_w - size) / 2))
  return np.asarray(image)[top:top + size, left:left + size]
