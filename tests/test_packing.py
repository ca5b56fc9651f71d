"""Packed stage states (petra_jax/engine/arrays/packing.py): exact round trips, and
packed steps that compute exactly what the unpacked ones do."""

import dataclasses
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from petra_jax.engine import pipeline as pipeline_lib

from petra_jax.engine import methods as methods_lib
from petra_jax.engine.arrays import packing
from petra_jax.engine.pipeline import Pipeline
from petra_jax.engine.stages.stage_state import StageState
from petra_jax.engine.stages.steps import PipelineSteps

from helpers import batches_of, random_batch, random_variables, run_ticks, tiny_revnet


def _tx():
  return optax.MultiSteps(optax.sgd(0.1, momentum=0.9), every_k_schedule=2)


def _rev_state(seed=0):
  """RevNet stage ``rev0`` of the tiny RevNet (input ``(x1, x2)``, 4x4x2
  each), its state with momentum and MultiSteps k=2 filled with random values
  (counters included), and a batch of inputs."""
  stage = tiny_revnet()[1]
  x = tuple(jnp.asarray(np.random.default_rng(seed + i).normal(size=(2, 4, 4, 2)),
                        jnp.float32) for i in range(2))
  v = random_variables(stage, x, seed)
  state = StageState.create(v["params"], v["batch_stats"], _tx())
  rng = np.random.default_rng(seed + 7)
  fill = lambda a: jnp.asarray(rng.integers(0, 5, a.shape) if a.dtype == jnp.int32  # noqa: E731
                               else rng.normal(size=a.shape), a.dtype)
  return stage, state.replace(opt_state=jax.tree.map(fill, state.opt_state),
                              micro_batches=jnp.int32(3)), x


def _same(a, b):
  """Same structure, shapes, dtypes and bits."""
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    assert u.shape == v.shape and u.dtype == v.dtype
    np.testing.assert_array_equal(np.asarray(u), np.asarray(v))


def test_round_trip_is_exact_for_a_revnet_stage_with_momentum_and_multisteps():
  _, state, _ = _rev_state()
  packed = packing.pack(state)
  assert isinstance(packed, packing.PackedState)
  layout = packed.packer
  assert layout.dtypes == (np.dtype("int32"), np.dtype("float32"))
  n = len(jax.tree.leaves(state))
  assert n > 20 and len(packed.buffers) == 2
  assert sum(layout.sizes) == sum(x.size for x in jax.tree.leaves(state))
  assert [b.shape for b in packed.buffers] == [(s,) for s in layout.sizes]
  back = packing.unpack(packed)
  assert isinstance(back, StageState) and back.tx is state.tx
  _same(back, state)
  _same(jax.jit(lambda p: p.unpacked())(packed), state)  # traced slices too


def test_packer_refuses_another_layout_and_what_it_cannot_pack():
  _, state, _ = _rev_state()
  packer = packing.Packer.of(state)
  with pytest.raises(ValueError):
    packer.pack(state.replace(micro_batches=jnp.zeros((2,), jnp.int32)))
  assert packing.Packer.of({"key": jax.random.key(0)}) is None
  assert packing.pack({"w": 1.0}) == {"w": 1.0}  # weakly typed: left as it is


def test_large_states_stay_unpacked_small_ones_are_packed():
  limit = packing.Packer.MAX_MEAN_LEAF_BYTES // 4  # float32 elements per leaf
  small = {"a": jnp.zeros((limit,)), "b": jnp.zeros((3,))}
  large = {"a": jnp.zeros((2 * limit + 4,)), "b": jnp.zeros((3,))}  # mean just past the limit
  assert packing.Packer.of(small).pays and isinstance(packing.pack(small),
                                                      packing.PackedState)
  assert not packing.Packer.of(large).pays
  assert packing.pack(large) is large


def test_off_the_cpu_no_state_is_packed(monkeypatch):
  small = {"a": jnp.zeros((8,)), "b": jnp.zeros((3,))}
  assert packing.pays(small)
  monkeypatch.setattr(packing, "_on_cpu", lambda tree: False)
  assert not packing.pays(small) and packing.pack(small) is small


def test_a_large_state_packs_and_unpacks_exactly():
  large = {"a": jnp.arange(packing.Packer.MAX_MEAN_LEAF_BYTES, dtype=jnp.float32),
           "b": jnp.ones((3,), jnp.int32)}
  packer = packing.Packer.of(large)
  _same(packing.unpack(packer.pack(large)), large)


def _steps(stages, j, method="petra"):
  """Stage ``j``'s :class:`StageSteps`."""
  return PipelineSteps(stages, methods_lib.get(method), "backward")[j]


def test_a_packed_backward_and_fused_step_equal_the_unpacked_ones():
  stage, state, x = _rev_state()
  stages = tiny_revnet()
  stages[1] = stage
  steps = _steps(stages, 1)
  y, _ = steps.forward(state, x)
  dy = jax.tree.map(lambda a: a * 0.5, y)
  copy = lambda t: jax.tree.map(jnp.copy, t)  # noqa: E731 (the steps donate)
  plain = steps.backward(copy(state), *copy((y, dy)))
  packed = steps.backward(packing.pack(state), *copy((y, dy)))
  assert isinstance(packed[0], packing.PackedState)
  _same(packing.unpack(packed[0]), plain[0])
  _same(packed[1:], plain[1:])
  (yf, _), plain = steps.forward_backward(copy(state), copy(x), *copy((y, dy)))
  (yp, _), packed = steps.forward_backward(packing.pack(state), copy(x), *copy((y, dy)))
  _same(yp, yf)
  _same(packing.unpack(packed[0]), plain[0])
  _same(packed[1:], plain[1:])


def _stages():
  """The tiny RevNet without its second reversible stage: stem, rev,
  downsample, head (J = 4), every kind of stage (reversible, recomputing,
  loss) with BatchNorm, one fewer to compile twice (packed and unpacked)."""
  stages = tiny_revnet()
  return stages[:3] + stages[4:]


@pytest.mark.parametrize("method", ["petra", "delayed"])
def test_a_packed_pipeline_trains_exactly_as_an_unpacked_one(method, monkeypatch):
  """Same losses and states to the last bit, reading ``train_states`` (a plain
  read: the stored states stay packed) midway in the packed run."""
  x, _ = random_batch()
  results, tx = {}, _tx()  # one optimizer: it is part of the states' structure
  real = pipeline_lib.regime
  for packs in (True, False):
    monkeypatch.setattr(pipeline_lib, "regime",
                        lambda *a, p=packs: dataclasses.replace(real(*a), pack=p))
    pipe = Pipeline(_stages(), tx, jax.devices()[:1], method=method)
    assert pipe.regime.pack is packs
    state = pipe.init(0, x)
    state, first = run_ticks(pipe, state, 6, batches_of(), num_ticks=9)
    if packs:
      assert any(isinstance(s, packing.PackedState) for s in state.stage_states)
      _ = state.train_states[1].params
      assert isinstance(state.stage_states[1], packing.PackedState)
    table = pipe.schedule(6)
    state, rest = pipe.run(state, (table[t] for t in range(9, len(table))), batches_of())
    results[packs] = ([float(o.loss) for o in first + rest], state.train_states)
  assert results[True][0] == results[False][0]
  _same(results[True][1], results[False][1])


def test_padded_layout_holds_trees_of_different_shapes_in_equal_buffers_exactly():
  """Several stages' trees (other structures, shapes and dtypes) in one layout: every tree
  packs to buffers of the same sizes (the largest tree's per dtype) and unpacks bit for bit."""
  trees = [{"w": jnp.arange(6.0).reshape(2, 3), "n": jnp.int32(7)},
           (jnp.ones((5,), jnp.bfloat16), jnp.full((2, 2), -1.5)),
           {}]
  layouts = packing.padded(trees)
  packed = [lay.pack(t) for lay, t in zip(layouts, trees)]
  assert len({tuple((b.shape, b.dtype) for b in p) for p in packed}) == 1
  for lay, tree, buffers in zip(layouts, trees, packed):
    back = lay.unpack(buffers)
    assert jax.tree.structure(back) == jax.tree.structure(tree)
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(tree)):
      assert a.dtype == b.dtype and np.array_equal(np.asarray(a), np.asarray(b))
  with pytest.raises(ValueError, match="PRNG key"):
    packing.padded([{"key": jax.random.key(0)}])
