"""engine/transport/ordered_writes.py on a toy pipeline scan: the same bits, fewer copies."""

import re

import jax
import jax.numpy as jnp
import numpy as np

from petra_jax.engine.transport.ordered_writes import ordered_writes

W = jnp.asarray(np.random.default_rng(0).normal(size=(3, 3, 4, 4)), jnp.float32)


def _conv(x):
  return jax.lax.conv_general_dilated(x, W, (1, 1), "SAME",
                                      dimension_numbers=("NHWC", "HWIO", "NHWC"))


def _shift(carry, x):
  """Two inboxes handed on as a pipeline's are: ``a, b -> conv(x), conv(a)``; ``conv(b)``
  summed out; a counter and a label vector carried beside them."""
  a, b, step, labels = carry
  return (_conv(x), _conv(a), step + 1, labels + 1), _conv(b).sum()


def _signed_zeros(carry, x):
  """As :func:`_shift`, the second inbox's new value all -0.0 (NaN where ``conv(a)`` is not
  finite)."""
  a, b, step, labels = carry
  return (_conv(x), -jnp.abs(_conv(a)) * 0.0, step + 1, labels + 1), _conv(b).sum()


def _run(body, init, xs):
  return jax.jit(lambda c, xs: jax.lax.scan(body, c, xs))(init, xs)


def _never_in_place(node):
  del node
  return False


def test_the_scan_computes_the_same_bits_with_infinities_nans_and_negative_zeros():
  """``new - 0.0`` is ``new`` for -0.0, inf and NaN, and a NaN or inf in a reader's output
  does not leak into the zero (a literal reading of IEEE 754, compared bit by bit)."""
  x = np.random.default_rng(1).normal(size=(5, 2, 8, 8, 4)).astype(np.float32)
  x[0, 0, 0, 0, 0] = -0.0   # a slot's value, and so element 0 of a reader's output, is special
  x[1, 0, 0, 0, 0] = np.inf
  x[2, 0, 0, 0, 0] = np.nan
  x[3, 1, 2, 3, 1] = -np.inf
  a = np.zeros((2, 8, 8, 4), np.float32)
  a[0, 0, 0, 0] = -0.0
  init = (jnp.asarray(a), jnp.asarray(-a), jnp.int32(0), jnp.arange(2, dtype=jnp.int32))
  want = _run(_signed_zeros, init, jnp.asarray(x))
  got = _run(ordered_writes(_signed_zeros, _never_in_place), init, jnp.asarray(x))
  assert np.signbit(want[0][1]).mean() > 0.5  # the case in question: -0.0 carried
  for w, g in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
    assert w.dtype == g.dtype
    np.testing.assert_array_equal(np.atleast_1d(w).view(np.uint8), np.atleast_1d(g).view(np.uint8))


def _body_copies(body) -> int:
  """Copies of an inbox (``f32[2, 8, 8, 4]``) in the optimized loop body of ``body``'s scan."""
  init = (jnp.zeros((2, 8, 8, 4)), jnp.zeros((2, 8, 8, 4)), jnp.int32(0),
          jnp.zeros((2,), jnp.int32))
  text = jax.jit(lambda c, xs: jax.lax.scan(body, c, xs), donate_argnums=0).lower(
      init, jnp.zeros((3, 2, 8, 8, 4))).compile().as_text()
  name = re.search(r"\bwhile\(.*?body=%?([\w.\-]+)", text).group(1)
  block = re.search(r"^%?" + re.escape(name) + r" .*?\n}", text, re.M | re.S).group(0)
  return len(re.findall(r"= f32\[2,8,8,4\]\S*\s+copy\(", block))


def test_ordered_inboxes_are_updated_in_place():
  """Each inbox is read (``conv(a)``, ``conv(b)``) and written (``conv(x)``, ``conv(a)``) in
  one iteration with nothing ordering the two: XLA copies each inbox out of its slot and the
  new value in (4 copies measured on jax 0.10.2's XLA:CPU); ordered, none."""
  assert _body_copies(_shift) >= 2
  assert _body_copies(ordered_writes(_shift, _never_in_place)) == 0


def test_a_slot_updated_in_place_is_left_alone():
  """A leaf under a node that ``in_place`` names keeps its own new value: no subtraction is
  added for it (a ring buffer XLA already updates in place), while the same leaf otherwise
  gets one."""
  def body(carry, x):
    (ring,) = carry
    return (jax.lax.dynamic_update_index_in_dim(ring, x, 0, 0),), ring.sum()

  def subtractions(in_place) -> int:
    closed = jax.make_jaxpr(lambda c, xs: jax.lax.scan(ordered_writes(body, in_place), c, xs))(
        (jnp.zeros((3, 4)),), jnp.ones((2, 4)))
    return len(re.findall(r"= sub ", str(closed)))
  assert subtractions(_never_in_place) == 1
  assert subtractions(lambda node: isinstance(node, jax.Array) and node.shape == (3, 4)) == 0
