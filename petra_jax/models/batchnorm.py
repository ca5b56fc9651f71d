"""BatchNorm with a closed-form backward: Flax's ``BatchNorm``, cheaper on XLA-CPU.

:class:`BatchNorm` is a drop-in for ``flax.linen.BatchNorm`` over the last
(channel) axis: the same variables (``params``: ``scale``, ``bias``;
``batch_stats``: ``mean``, ``var``, all ``float32[C]``), the same forward
arithmetic (one pass: ``var = max(0, E[x^2] - E[x]^2)`` in float32, then
``(x - mean) * (rsqrt(var + eps) * scale) + bias``) and the same running
statistics (``m * running + (1 - m) * batch``, biased variance, not updated
while initialising). What differs is the training-mode backward: autodiff of
Flax's graph walks the statistics' chain rule (several passes over the
activation, each a separate XLA-CPU loop); :func:`batch_norm` instead has the
textbook closed form (Ioffe & Szegedy, 2015), two reductions and one
elementwise pass::

    x^ = (x - mean) * r,  r = rsqrt(var + eps),  N = B * H * W
    dbias  = sum dy,  dscale = sum dy * x^
    dx     = scale * r * (dy - (dbias + x^ * dscale) / N)

Optionally the ReLU that follows most BatchNorms is fused (``relu=True``):
forward ``max(y, 0)``, backward ``dy * (y > 0)`` inside the same pass.
Gradients equal autodiff of Flax's graph up to float32 round-off
(``tests/test_batchnorm.py``).
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.custom_derivatives import SymbolicZero

from petra_jax.engine.stages import stage as stage_lib

_F32 = jnp.float32
_BLOCKS = (64, 32, 16, 8, 4, 2, 1)


def channel_sums(*arrays):
  """Each array summed over all axes but the last: ``float32[..., C] -> float32[C]``.

  XLA-CPU's reduction over the leading axes of ``[N, C]`` is a slow strided
  loop (about 5x a copy of the array), and its ``ones[1, N] @ a`` loses
  digits. Here each array's ``N`` rows are first added in ``k`` blocks
  (``[k, N/k, C] -> [N/k, C]``, a vectorised elementwise sum, ``k`` the
  largest of 64, 32, ..., 1 dividing ``N``); the partial sums of all arrays,
  side by side (``[N/k, A C]``), then take one GEMV with ``ones[N/k]``: about
  3x faster than ``a.sum`` and closer to the float64 sum. A BatchNorm's two
  sums take one GEMV this way instead of two (issue 23).

  Args:
    *arrays: ``A >= 1`` arrays of one shape ``[..., C]``.

  Returns:
    A tuple of ``A`` arrays ``[C]``.

  Raises:
    ValueError: no array, or arrays of different shapes.
  """
  if not arrays or any(a.shape != arrays[0].shape for a in arrays):
    raise ValueError(f"channel_sums takes arrays of one shape, got "
                     f"{[a.shape for a in arrays]}.")
  c = arrays[0].shape[-1]
  n = arrays[0].size // c
  k = next(k for k in _BLOCKS if n % k == 0)
  rows = [a.reshape(k, n // k, c).sum(0) for a in arrays]
  both = rows[0] if len(rows) == 1 else jnp.concatenate(rows, axis=1)
  sums = jnp.dot(both.T, jnp.ones((n // k,), both.dtype), precision="highest")
  return tuple(sums[i * c:(i + 1) * c] for i in range(len(arrays)))


def _stats(x):
  """One-pass batch statistics over all axes but the last, in float32.

  Returns ``(mean, var)``, each ``float32[C]``, with Flax's fast variance
  ``max(0, E[x^2] - E[x]^2)``.
  """
  xf = x.astype(_F32)
  n = x.size // x.shape[-1]
  total, total2 = channel_sums(xf, jnp.square(xf))
  mean, mean2 = total / n, total2 / n
  return mean, jnp.maximum(0.0, mean2 - jnp.square(mean))


def _affine(x, mean, var, scale, bias, eps, relu):
  """``(x - mean) * (rsqrt(var + eps) * scale) + bias`` [then ReLU], Flax's order.

  The result has ``x``'s dtype when ``scale``/``bias`` have it too (as under a
  ``bfloat16`` :class:`~petra_jax.engine.arrays.precision.Precision`), Flax's rule.
  """
  mul = jax.lax.rsqrt(var + eps) * scale
  y = ((x - mean) * mul + bias).astype(jnp.result_type(x, scale, bias))
  return jnp.maximum(y, 0) if relu else y


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def batch_norm(x, scale, bias, eps: float = 1e-5, relu: bool = False):
  """Training-mode BatchNorm over the last axis, with a closed-form backward.

  Args:
    x: ``[..., C]`` activation (``float32`` or ``bfloat16``); statistics over
      every axis but the last.
    scale, bias: ``[C]``.
    eps: added to the variance.
    relu: apply ``max(., 0)`` to the output (fused into the backward).

  Returns:
    ``(y, mean, var)``: ``y`` like ``x``; the batch ``mean`` and biased
    ``var``, ``float32[C]`` (differentiable too).
  """
  mean, var = _stats(x)
  return _affine(x, mean, var, scale, bias, eps, relu), mean, var


def _fwd(x, scale, bias, eps, relu):
  x, scale, bias = x.value, scale.value, bias.value
  mean, var = _stats(x)
  y = _affine(x, mean, var, scale, bias, eps, relu)
  return (y, mean, var), (x, y if relu else None, mean, var, scale, bias)


def _bwd(eps, relu, res, cts):
  """Closed-form vjp (module docstring); ``cts`` may hold symbolic zeros."""
  x, y, mean, var, scale, bias = res
  dy, dmean, dvar = cts
  n = x.size // x.shape[-1]
  r = jax.lax.rsqrt(var + eps)
  xc = x.astype(_F32) - mean
  dyf = jnp.zeros(x.shape, _F32) if isinstance(dy, SymbolicZero) else dy.astype(_F32)
  if relu:
    dyf = jnp.where(y > 0, dyf, 0.0)
  dbias, dscale = channel_sums(dyf, dyf * xc)
  dscale = dscale * r
  g = scale.astype(_F32) * r
  dx = g * (dyf - (dbias + xc * (r * dscale)) / n)
  if not isinstance(dmean, SymbolicZero):
    dx = dx + dmean / n
  if not isinstance(dvar, SymbolicZero):
    dx = dx + xc * (2.0 * dvar / n)
  return dx.astype(x.dtype), dscale.astype(scale.dtype), dbias.astype(bias.dtype)


batch_norm.defvjp(_fwd, _bwd, symbolic_zeros=True)

def _batch_norm_plain(x, scale, bias, eps: float, relu: bool):
  """:func:`batch_norm` without its custom vjp (forward-mode differentiable)."""
  mean, var = _stats(x)
  return _affine(x, mean, var, scale, bias, eps, relu), mean, var


class BatchNorm(nn.Module):
  """``flax.linen.BatchNorm`` over the last axis, with :func:`batch_norm`'s backward.

  Same variable names, shapes, initialisers and running-statistics update as
  Flax's (``momentum`` in Flax's convention: 0.9 is PyTorch's 0.1), so
  checkpoints are interchangeable.

  Attributes:
    use_running_average: normalise with the running statistics (evaluation).
    momentum: running ``m * running + (1 - m) * batch``.
    epsilon: added to the variance.
    relu: apply a ReLU after the affine (fused).
  """
  use_running_average: bool | None = None
  momentum: float = 0.99
  epsilon: float = 1e-5
  relu: bool = False

  @nn.compact
  def __call__(self, x, use_running_average: bool | None = None):
    """``[..., C] -> [..., C]``."""
    use_running_average = nn.merge_param(
        "use_running_average", self.use_running_average, use_running_average)
    c = (x.shape[-1],)
    ra_mean = self.variable("batch_stats", "mean", lambda s: jnp.zeros(s, _F32), c)
    ra_var = self.variable("batch_stats", "var", lambda s: jnp.ones(s, _F32), c)
    scale = self.param("scale", nn.initializers.ones, c, _F32)
    bias = self.param("bias", nn.initializers.zeros, c, _F32)
    if use_running_average:
      return _affine(x, ra_mean.value, ra_var.value, scale, bias, self.epsilon, self.relu)
    fn = _batch_norm_plain if stage_lib.is_linearizing() else batch_norm
    y, mean, var = fn(x, scale, bias, self.epsilon, self.relu)
    if not self.is_initializing():
      m = self.momentum
      ra_mean.value = m * ra_mean.value + (1 - m) * jax.lax.stop_gradient(mean)
      ra_var.value = m * ra_var.value + (1 - m) * jax.lax.stop_gradient(var)
    return y
