"""Tests of petra_jax.engine.arrays.quantize: bounds, real byte savings, unbiasedness, jit."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from petra_jax.engine.arrays import quantize as Q

SHAPE = (4, 8, 8, 16)  # [B, H, W, C]


def _activation(seed=0, shape=SHAPE):
  """float32 [B, H, W, C], channels of different magnitudes, plus tiny values."""
  x = jax.random.normal(jax.random.key(seed), shape, jnp.float32)
  x = x * jnp.geomspace(0.01, 10.0, shape[-1], dtype=jnp.float32)
  return x.at[0, 0, 0, :3].set(jnp.array([1e-30, -3e-7, 0.0], jnp.float32))


def _two_streams(seed=0):
  return (_activation(seed), 3.0 * _activation(seed + 1))


def _check_within(x, fmt, **kw):
  """Round trip of pytree x within error_bound, leaf by leaf; returns max err / bound."""
  stochastic = kw.get("key") is not None
  q = Q.quantize(x, fmt, **kw)
  d = Q.dequantize(q)
  bound = Q.error_bound(x, fmt, per_channel=kw.get("per_channel", False), stochastic=stochastic)
  assert jax.tree.structure(d) == jax.tree.structure(x)
  worst = 0.0
  for xl, dl, bl in zip(jax.tree.leaves(x), jax.tree.leaves(d), jax.tree.leaves(bound)):
    assert dl.shape == xl.shape and dl.dtype == jnp.float32
    err = np.abs(np.asarray(dl, np.float64) - np.asarray(xl, np.float64))
    b = np.asarray(bl, np.float64)
    assert np.all(err <= b), (fmt, float(np.max(err - b)))
    worst = max(worst, float(np.max(err / b)))
  return worst


@pytest.mark.parametrize("fmt", ["bfloat16", "float16"])
@pytest.mark.parametrize("tree", ["array", "two_streams"])
def test_float_formats_round_trip_within_relative_bound(fmt, tree):
  x = _activation() if tree == "array" else _two_streams()
  worst = _check_within(x, fmt)
  assert worst > 0.5  # the bound is attained, not vacuous
  # The bound itself is u |x| on normal values.
  xl = jax.tree.leaves(x)[0]
  b = Q.error_bound(xl, fmt)
  big = np.abs(np.asarray(xl)) > 1e-3
  np.testing.assert_array_equal(np.asarray(b)[big], Q.UNIT_ROUNDOFF[fmt] * np.abs(np.asarray(xl))[big])
  assert Q.UNIT_ROUNDOFF == {"bfloat16": 2.0 ** -8, "float16": 2.0 ** -11}


@pytest.mark.parametrize("per_channel", [False, True])
@pytest.mark.parametrize("tree", ["array", "two_streams"])
def test_int8_nearest_round_trip_within_half_scale(per_channel, tree):
  x = _activation() if tree == "array" else _two_streams()
  worst = _check_within(x, "int8", per_channel=per_channel)
  assert worst > 0.9  # nearest rounding reaches s / 2 somewhere


@pytest.mark.parametrize("per_channel", [False, True])
def test_int8_stochastic_round_trip_within_scale(per_channel):
  x = _two_streams()
  _check_within(x, "int8", per_channel=per_channel, key=jax.random.key(1))


def test_none_is_identity():
  x = _two_streams()
  assert Q.quantize(x, "none") is x
  assert Q.quantize(x, "none", per_channel=True, key=jax.random.key(0)) is x
  assert Q.dequantize(x) is x
  assert Q.nbytes(Q.quantize(x, "none")) == Q.nbytes(x) == 2 * 4 * int(np.prod(SHAPE))
  for b in jax.tree.leaves(Q.error_bound(x, "none")):
    assert not np.any(np.asarray(b))


def test_int8_values_really_int8_and_bytes():
  x = _activation()
  n = int(np.prod(SHAPE))
  assert Q.nbytes(x) == 4 * n
  q = Q.quantize(x, "int8")
  assert isinstance(q, Q.Quantized)
  assert q.values.dtype == jnp.int8 and q.values.shape == SHAPE
  assert q.scale.dtype == jnp.float32 and q.scale.shape == (1,)
  assert [leaf.dtype for leaf in jax.tree.leaves(q)] == [jnp.int8, jnp.float32]
  assert Q.nbytes(q) == n + 4
  qc = Q.quantize(x, "int8", per_channel=True)
  assert qc.scale.shape == (SHAPE[-1],)
  assert Q.nbytes(qc) == n + 4 * SHAPE[-1]
  assert int(jnp.max(jnp.abs(q.values.astype(jnp.int32)))) == 127  # -128 never used
  for fmt, dt in [("bfloat16", jnp.bfloat16), ("float16", jnp.float16)]:
    qf = Q.quantize(x, fmt)
    assert [leaf.dtype for leaf in jax.tree.leaves(qf)] == [dt]
    assert Q.nbytes(qf) == 2 * n
  # A pytree of two streams: every leaf shrinks.
  q2 = Q.quantize(_two_streams(), "int8", per_channel=True)
  assert Q.nbytes(q2) == 2 * (n + 4 * SHAPE[-1])
  # nbytes also reads abstract shapes.
  assert Q.nbytes(jax.ShapeDtypeStruct(SHAPE, jnp.int8)) == n


def test_int8_per_channel_hand_check():
  # Channel 0 is ~1000x channel 1.
  x = jnp.array([[1000.0, 1.0], [-400.0, -0.6], [250.0, 0.25]], jnp.float32)
  pt = Q.quantize(x, "int8")
  pc = Q.quantize(x, "int8", per_channel=True)
  # Per tensor: s = 1000/127 ~ 7.87, so |small| / s <= 0.127 rounds to 0.
  np.testing.assert_array_equal(np.asarray(pt.values), [[127, 0], [-51, 0], [32, 0]])
  # Per channel: s = (1000/127, 1/127); -0.6*127 = -76.2, 0.25*127 = 31.75.
  np.testing.assert_array_equal(np.asarray(pc.values), [[127, 127], [-51, -76], [32, 32]])
  np.testing.assert_allclose(np.asarray(pc.scale), [1000 / 127, 1 / 127], rtol=1e-6)
  err_pt = np.abs(np.asarray(Q.dequantize(pt) - x))
  err_pc = np.abs(np.asarray(Q.dequantize(pc) - x))
  # The small channel is lost entirely per tensor ...
  np.testing.assert_allclose(err_pt[:, 1], [1.0, 0.6, 0.25], rtol=1e-6)
  # ... and within half its own step per channel (>100x smaller error).
  assert np.all(err_pc[:, 1] <= 0.5 / 127 + 1e-7)
  assert np.max(err_pc[:, 1]) * 100 < np.min(err_pt[:, 1])
  # The large channel has the same scale both ways.
  np.testing.assert_array_equal(err_pc[:, 0], err_pt[:, 0])


@pytest.mark.parametrize("per_channel", [False, True])
def test_int8_stochastic_rounding_is_unbiased(per_channel):
  x = jax.random.uniform(jax.random.key(3), (8, 8), jnp.float32, -1.0, 1.0)
  x = x * jnp.arange(1, 9, dtype=jnp.float32)  # channels of different scale
  n_keys = 4000
  keys = jax.random.split(jax.random.key(4), n_keys)
  roundtrip = jax.jit(jax.vmap(
      lambda k: Q.dequantize(Q.quantize(x, "int8", per_channel=per_channel, key=k))))
  samples = np.asarray(roundtrip(keys), np.float64)  # [n_keys, 8, 8]
  scale = np.broadcast_to(np.asarray(Q.quantize(x, "int8", per_channel=per_channel).scale), x.shape)
  r = np.asarray(x, np.float64) / scale
  lo = np.floor(r)
  # Every sample is one of the two neighbouring grid points ...
  k = np.rint(samples / scale)
  assert np.all((k == lo) | (k == lo + 1))
  # ... and the mean is x within 5 standard errors, from the known variance
  # s^2 f (1 - f) of stochastic rounding (f = frac(x / s)); the 2^-15 s term
  # covers float32 rounding of x / s.
  f = r - lo
  std_err = scale * np.sqrt(f * (1 - f) / n_keys)
  bias = np.abs(samples.mean(0) - np.asarray(x, np.float64))
  assert np.all(bias <= 5 * std_err + 2.0 ** -15 * scale)
  # The standardised errors of all elements together: their mean is N(0, 1/n).
  ok = f * (1 - f) > 1e-3
  z = (samples.mean(0) - np.asarray(x, np.float64))[ok] / std_err[ok]
  assert abs(z.mean()) <= 5 / np.sqrt(z.size)
  # Nearest rounding, by contrast, is biased by up to s / 2 on the same x.
  nearest = np.asarray(Q.dequantize(Q.quantize(x, "int8", per_channel=per_channel)), np.float64)
  assert np.max(np.abs(nearest - np.asarray(x, np.float64)) / scale) > 0.4


def test_stochastic_keys_differ_per_leaf():
  a = _activation()
  q = Q.quantize((a, a), "int8", key=jax.random.key(0))
  assert not np.array_equal(np.asarray(q[0].values), np.asarray(q[1].values))
  q_again = Q.quantize((a, a), "int8", key=jax.random.key(0))
  np.testing.assert_array_equal(np.asarray(q[0].values), np.asarray(q_again[0].values))


@pytest.mark.parametrize("fmt", Q.FORMATS)
def test_everything_works_under_jit(fmt):
  x = _two_streams()
  kw = {"key": jax.random.key(2)} if fmt == "int8" else {}

  @jax.jit
  def f(x, kw):
    q = Q.quantize(x, fmt, per_channel=True, **kw)
    bound = Q.error_bound(x, fmt, per_channel=True, stochastic=bool(kw))
    return q, Q.dequantize(q), bound, Q.nbytes(q)

  # nbytes reads static shapes, so it runs on tracers; jit returns it as an array.
  q, d, b, nb = f(x, kw)
  q_eager = Q.quantize(x, fmt, per_channel=True, **kw)
  assert jax.tree.structure(q) == jax.tree.structure(q_eager)
  for a, e in zip(jax.tree.leaves(q), jax.tree.leaves(q_eager)):
    assert a.dtype == e.dtype
    np.testing.assert_array_equal(np.asarray(a), np.asarray(e))
  assert int(nb) == Q.nbytes(q_eager)
  for dl, xl, bl in zip(jax.tree.leaves(d), jax.tree.leaves(x), jax.tree.leaves(b)):
    assert np.all(np.abs(np.asarray(dl) - np.asarray(xl)) <= np.asarray(bl))
  # static_argnames form, and a jitted dequantize of an eager message.
  qs = jax.jit(Q.quantize, static_argnames=("fmt", "per_channel"))(x, fmt, per_channel=False)
  d2 = jax.jit(Q.dequantize)(qs)
  for a, e in zip(jax.tree.leaves(d2), jax.tree.leaves(Q.dequantize(Q.quantize(x, fmt)))):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(e))


def test_quantized_message_travels_with_device_put():
  devices = jax.devices()
  q = Q.quantize(_two_streams(), "int8", per_channel=True)
  moved = jax.device_put(q, devices[-1])
  assert isinstance(moved[0], Q.Quantized)
  for leaf in jax.tree.leaves(moved):
    assert leaf.devices() == {devices[-1]}
  assert [leaf.dtype for leaf in jax.tree.leaves(moved)] == [jnp.int8, jnp.float32] * 2
  for a, b in zip(jax.tree.leaves(Q.dequantize(moved)), jax.tree.leaves(Q.dequantize(q))):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_orbax_checkpoint_round_trip(tmp_path):
  ocp = pytest.importorskip("orbax.checkpoint")
  x = _activation()
  tree = {"a": Q.quantize((x, 2 * x), "int8", per_channel=True),
          "b": Q.quantize(x, "bfloat16"), "c": Q.quantize(x, "float16")}
  ck = ocp.StandardCheckpointer()
  ck.save(tmp_path / "ckpt", tree)
  ck.wait_until_finished()
  target = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), tree)
  restored = ck.restore(tmp_path / "ckpt", target)
  assert jax.tree.structure(restored) == jax.tree.structure(tree)
  for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(tree)):
    assert a.dtype == b.dtype
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_requantising_a_nearest_message_is_lossless():
  # A receiver that re-quantises what it got (e.g. PETRA's x~ sent back after
  # the forward message) adds no second error with round to nearest.
  x = _activation()
  for fmt in ("bfloat16", "float16"):
    d = Q.dequantize(Q.quantize(x, fmt))
    np.testing.assert_array_equal(np.asarray(Q.dequantize(Q.quantize(d, fmt))), np.asarray(d))
  q = Q.quantize(x, "int8")
  q2 = Q.quantize(Q.dequantize(q), "int8")
  np.testing.assert_array_equal(np.asarray(q2.values), np.asarray(q.values))


def test_edge_cases():
  # All-zero tensor: guarded scale, exact zeros back.
  z = jnp.zeros((3, 4), jnp.float32)
  for pc in (False, True):
    q = Q.quantize(z, "int8", per_channel=pc)
    assert np.all(np.isfinite(np.asarray(q.scale)))
    np.testing.assert_array_equal(np.asarray(Q.dequantize(q)), 0.0)
  # A zero channel next to a non-zero one.
  x = jnp.array([[0.0, 2.0], [0.0, -1.0]], jnp.float32)
  d = Q.dequantize(Q.quantize(x, "int8", per_channel=True))
  np.testing.assert_array_equal(np.asarray(d)[:, 0], 0.0)
  # Empty and scalar arrays.
  assert Q.dequantize(Q.quantize(jnp.zeros((0, 5)), "int8", per_channel=True)).shape == (0, 5)
  qs = Q.quantize(jnp.float32(-3.0), "int8", per_channel=True)
  assert qs.scale.shape == (1,) and float(Q.dequantize(qs)) == pytest.approx(-3.0)
  # float16 saturates finite overflow, keeps inf / nan.
  big = jnp.array([1e5, -7e4, 6e4, jnp.inf, jnp.nan], jnp.float32)
  h = np.asarray(Q.dequantize(Q.quantize(big, "float16")))
  np.testing.assert_array_equal(h[:2], [65504.0, -65504.0])
  assert h[3] == np.inf and np.isnan(h[4])
  b = np.asarray(Q.error_bound(big[:3], "float16"))
  assert np.all(np.abs(h[:3] - np.asarray(big[:3])) <= b)
  # int8: a nan makes the whole tensor nan (visible, not silently zero).
  assert np.all(np.isnan(np.asarray(Q.dequantize(Q.quantize(big, "int8")))))
  # Non-float leaves pass through; dequantize of a mixed tree keeps them.
  tree = {"x": jnp.ones((2, 2)), "labels": jnp.arange(2)}
  qt = Q.quantize(tree, "int8")
  assert qt["labels"] is tree["labels"] and isinstance(qt["x"], Q.Quantized)
  assert Q.dequantize(qt)["labels"] is tree["labels"]


def test_unknown_format_and_misuse_raise():
  x = _activation()
  for fn in (functools.partial(Q.quantize, x), functools.partial(Q.error_bound, x),
             Q.check_format):
    with pytest.raises(ValueError) as err:
      fn("int4")
    msg = str(err.value)
    assert "'int4'" in msg and all(f in msg for f in Q.FORMATS)
  assert Q.FORMATS == ("none", "bfloat16", "float16", "int8")
  with pytest.raises(ValueError, match="only implemented for 'int8'"):
    Q.quantize(x, "bfloat16", key=jax.random.key(0))
  with pytest.raises(ValueError, match="already quantised"):
    Q.quantize(Q.quantize(x, "int8"), "int8")
