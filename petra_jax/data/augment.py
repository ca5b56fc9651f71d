"""Augmentation and normalisation (paper Sec. 4, "standard data augmentation").

CIFAR / ImageNet32: pad-4 random crop + flip + standardisation, jittable (``augment``).
ImageNet: torchvision's ``RandomResizedCrop(224)`` + flip, ``Resize(256)`` + ``CenterCrop(224)``,
on the host with Pillow.
"""

import math
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from PIL import Image

from petra_jax.data import sources

CROP_SCALE = (0.08, 1.0)
CROP_RATIO = (3 / 4, 4 / 3)
EVAL_RESIZE = 256


def normalize(
    images: jax.Array, mean: Sequence[float], std: Sequence[float]
) -> jax.Array:
  """float32 ``(x / 255 - mean) / std``: pixels ``[..., C]`` in 0..255, ``mean``/``std`` ``[C]``."""
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
  """Zero-pad ``pad``, random ``H x W`` crop, flip with p = 0.5, ``normalize``: uint8 -> float32
  ``[B, H, W, C]``. Padded pixels are black (torchvision's ``RandomCrop(padding=4)``)."""
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
  """``(top, left, crop_height, crop_width)`` in pixels, as torchvision's
  ``RandomResizedCrop.get_params`` (``scale``: area fraction, ``ratio``: width / height)."""
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
  """uint8 ``[size, size, 3]``: JPEG/PNG bytes decoded, random-resized-cropped (bilinear), maybe
  flipped, all drawn from ``seed``."""
  rng = np.random.default_rng(seed)
  image = sources.decode(encoded)
  top, left, h, w = random_resized_crop_box(image.height, image.width, rng)
  image = image.resize((size, size), Image.BILINEAR, box=(left, top, left + w, top + h))
  out = np.asarray(image)
  return out[:, ::-1] if rng.random() < 0.5 else out


def imagenet_eval_image(
    encoded: bytes, size: int = 224, resize: int = EVAL_RESIZE
) -> np.ndarray:
  """uint8 ``[size, size, 3]``: shorter side resized to ``resize`` (bilinear), center crop."""
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
