"""Data parallelism within a stage (``data_parallel = D``).

Each stage on a group of ``D`` devices: state replicated, micro-batches
sharded over a ``data`` axis. BatchNorm statistics and gradients are those of
the whole micro-batch, so losses equal the one-device-per-stage run's up to
float32 reduction order. Runs on conftest's 4 virtual CPU devices: a 5-stage
RevNet on 2 groups of 2 against the same stages on 2 single devices. (Two
processes of 4 devices each: tests/test_multiprocess.py.)
"""

import functools

import jax
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from petra_jax.engine.transport import placement
from petra_jax.engine.pipeline import Pipeline
from petra_jax.training import checkpoint, validation
from helpers import random_batch, tiny_revnet
from helpers import tiny_config

NUM_MICRO_BATCHES = 8
RTOL = 1e-5  # float32: the sharded batch sums in another order


def _pipeline(method, data_parallel):
  devices = jax.devices()[:2 * data_parallel]
  if method == "backprop":
    devices = devices[:data_parallel]
  tx = optax.MultiSteps(optax.sgd(0.05, momentum=0.9), every_k_schedule=2)
  pipe = Pipeline(tiny_revnet(), tx, devices, method=method, accumulation_steps=2,
                  data_parallel=data_parallel)
  return pipe, pipe.init(0, random_batch()[0])


def _losses(pipe, state, ticks=None):
  table = pipe.schedule(NUM_MICRO_BATCHES)
  ticks = range(len(table)) if ticks is None else ticks
  state, out = pipe.run(state, (table[t] for t in ticks), lambda m: random_batch(seed=m))
  return state, np.array([float(o.loss) for o in sorted(out, key=lambda o: o.micro_batch)])


@functools.lru_cache(maxsize=None)
def _all_losses(method, data_parallel):
  """The losses of every micro-batch of a whole run (shared by the tests)."""
  return _losses(*_pipeline(method, data_parallel))[1]


@pytest.mark.parametrize("method", ["petra", "1f1b", "backprop"])
def test_two_devices_per_stage_give_the_losses_of_one(method):
  one, two = _all_losses(method, 1), _all_losses(method, 2)
  assert len(one) == NUM_MICRO_BATCHES
  np.testing.assert_allclose(two, one, rtol=RTOL)


def test_state_is_replicated_and_messages_are_sharded_over_the_group():
  pipe, state = _pipeline("petra", 2)
  state, _ = _losses(pipe, state, range(5))
  groups = [tuple(jax.devices()[:2]), tuple(jax.devices()[2:4])]
  assert [p.devices for p in pipe.placements] == [groups[0]] * 3 + [groups[1]] * 2
  for j, st in enumerate(state.train_states):
    for leaf in jax.tree.leaves(st.params):
      assert isinstance(leaf.sharding, NamedSharding) and leaf.sharding.spec == P()
      assert set(leaf.sharding.device_set) == set(pipe.placements[j].devices)
  messages = [leaf for box in state.inbox[1:] for msg in box.values()
              for leaf in jax.tree.leaves(msg)]
  assert messages
  for leaf in messages:
    assert leaf.sharding.spec == P(placement.DATA_AXIS)
    assert len(leaf.addressable_shards) == 2
    assert leaf.addressable_shards[0].data.shape[0] == leaf.shape[0] // 2


@pytest.mark.parametrize("saved,resumed", [(2, 1), (1, 2)])
def test_checkpoint_mid_flight_resumes_with_another_data_parallel(tmp_path, saved, resumed):
  expected = _all_losses("petra", 1)
  pipe, state = _pipeline("petra", saved)
  state, before = _losses(pipe, state, range(7))
  assert state.in_flight() > 0
  ckpt = checkpoint.Checkpointer(str(tmp_path), keep=1, fingerprint={"model": "tiny"})
  ckpt.save(7, state, extra={})
  ckpt.wait()
  pipe2, template = _pipeline("petra", resumed)
  _, restored, _, _ = checkpoint.Checkpointer(str(tmp_path), keep=1, fingerprint={
      "model": "tiny"}).restore(template, [p.state_sharding for p in pipe2.placements])
  _, after = _losses(pipe2, restored, range(7, len(pipe2.schedule(NUM_MICRO_BATCHES))))
  np.testing.assert_allclose(np.concatenate([before, after]), expected, rtol=RTOL)


def test_a_batch_that_does_not_split_over_the_group_is_one_clear_error():
  c = tiny_config("unused", data_parallel=2, batch_size=6, accumulation_steps=2)
  with pytest.raises(validation.ConfigError, match="micro-batch .* does not split over "
                     "data_parallel=2"):
    validation.validate_config(c, 4)


def test_more_devices_than_exist_is_one_clear_error():
  c = tiny_config("unused", data_parallel=2, num_devices=3)
  with pytest.raises(validation.ConfigError, match="needs 6 devices but only 4 exist"):
    validation.validate_config(c, 4)


def test_devices_that_do_not_form_groups_are_refused():
  with pytest.raises(ValueError, match="do not form groups of data_parallel=2"):
    placement.assign(4, jax.devices()[:3], 2)
