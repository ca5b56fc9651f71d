"""Checkpoints hold the whole pipeline: bit-exact resume, corruption, mismatch;
orbax_local keeps to orbax's public API and to what it relies on in orbax."""

import pathlib

import jax
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

from petra_jax.training.checkpoint import blocks as checkpoint_blocks

from petra_jax.training import checkpoint


from petra_jax.engine import pipeline
from petra_jax.models import auxiliary
from helpers import random_batch, tiny_revnet

FP = {"model": "revnet18", "width": 4}


def _tiny_pipeline(method="petra"):
  """The tiny RevNet (J = 5: reversible, recomputing and BatchNorm stages) on
  2 devices, SGD-momentum accumulated over k = 2 micro-batches; with auxiliary heads
  for ``forward_gradient`` (its local guesses)."""
  stages = tiny_revnet()
  if method == "forward_gradient":
    stages = auxiliary.with_heads(stages, "mlp", 10, hidden=8)
  tx = optax.MultiSteps(optax.sgd(0.05, momentum=0.9), every_k_schedule=2)
  pipe = pipeline.Pipeline(stages, tx, jax.devices()[:2], method=method)
  return pipe, pipe.init(0, random_batch()[0])


TABLE_SIZE = 40  # micro-batches of the stream the tests run ticks of


def _run(pipe, state, ticks):
  """Runs the given ticks of a 40-micro-batch stream; the losses they produce."""
  table = pipe.schedule(TABLE_SIZE)
  state, out = pipe.run(state, (table[t] for t in ticks), lambda m: random_batch(seed=m))
  return state, np.asarray(jax.device_get([o.loss for o in out]))


# delayed: weight stashes too; forward_gradient: auxiliary heads and its own in-flight messages
# (its CLI stop and resume, tests/test_train_resume.py, is in the long set)
@pytest.mark.parametrize("method", ["petra", "delayed", "forward_gradient"])
def test_restore_mid_flight_continues_bit_exactly(tmp_path, method):
  pipe, state = _tiny_pipeline(method)
  state, _ = _run(pipe, state, range(13))  # pipeline full, accumulators half full
  assert state.in_flight() > 0 and any(len(b) for b in state.buffers)
  # delayed stashes weights; forward_gradient keeps each micro-batch's guess there until its update
  assert any(len(w) for w in state.weight_stash) == (method != "petra")
  ckpt = checkpoint.Checkpointer(str(tmp_path), keep=2, fingerprint=FP)
  ckpt.save(13, state, extra={"hello": 1}, extra_arrays={5: jax.numpy.float32(2.5)})
  ckpt.wait()
  _, expected = _run(pipe, state, range(13, 30))

  pipe2, template = _tiny_pipeline(method)
  step, restored, extra, extra_arrays = checkpoint.Checkpointer(
      str(tmp_path), keep=2, fingerprint=FP).restore(template, pipe2.devices)
  assert step == 13 and extra == {"hello": 1} and float(extra_arrays[5]) == 2.5
  assert restored.tick == 13 and restored.in_flight() > 0
  _, got = _run(pipe2, restored, range(13, 30))
  assert len(got) == 17
  np.testing.assert_array_equal(got, expected)


def test_corrupt_latest_falls_back_then_errors(tmp_path, caplog):
  pipe, state = _tiny_pipeline()
  state, _ = _run(pipe, state, range(4))
  ckpt = checkpoint.Checkpointer(str(tmp_path), keep=3, fingerprint=FP)
  ckpt.save(1, state, extra={})
  ckpt.wait()
  state, _ = _run(pipe, state, range(4, 8))
  ckpt.save(2, state, extra={})
  ckpt.wait()

  def corrupt(step):
    for f in pathlib.Path(tmp_path, str(step), "arrays").rglob("*"):
      if f.is_file() and f.stat().st_size > 0:
        f.write_bytes(b"garbage")

  corrupt(2)
  _, template = _tiny_pipeline()
  step, *_ = checkpoint.Checkpointer(str(tmp_path), keep=3, fingerprint=FP).restore(
      template, pipe.devices)
  assert step == 1
  # Named corrupt (not incomplete) and kept aside, not deleted.
  assert f"checkpoint {tmp_path}/2 is corrupt" in caplog.text
  assert "incomplete" not in caplog.text
  assert (tmp_path / "corrupt_2" / "arrays").is_dir() and not (tmp_path / "2").exists()
  corrupt(1)
  with pytest.raises(checkpoint_blocks.CheckpointError, match=r"every checkpoint in .* is corrupt "
                     r"\(steps \[1\]"):
    checkpoint.Checkpointer(str(tmp_path), keep=3, fingerprint=FP).restore(
        template, pipe.devices)


def test_checkpoint_of_another_run_is_refused(tmp_path):
  pipe, state = _tiny_pipeline()
  ckpt = checkpoint.Checkpointer(str(tmp_path), keep=1, fingerprint=FP)
  ckpt.save(1, state, extra={})
  ckpt.wait()
  other = checkpoint.Checkpointer(str(tmp_path), keep=1, fingerprint={"model": "revnet34",
                                                                      "width": 4})
  with pytest.raises(checkpoint_blocks.CheckpointError, match="model: checkpoint 'revnet18' vs "
                     "config 'revnet34'"):
    other.restore(state, pipe.devices)


def test_fingerprint_fields_missing_from_an_older_checkpoint_are_not_checked(tmp_path):
  pipe, state = _tiny_pipeline()
  ckpt = checkpoint.Checkpointer(str(tmp_path), keep=1, fingerprint=FP)
  ckpt.save(1, state, extra={})
  ckpt.wait()
  assert checkpoint.saved_fingerprint(str(tmp_path)) == FP
  newer = checkpoint.Checkpointer(str(tmp_path), keep=1, fingerprint=dict(FP, stage_sizes=None))
  assert newer.restore(state, pipe.devices)[0] == 1
  assert checkpoint.saved_fingerprint(str(tmp_path / "none")) is None


def test_quantised_messages_in_flight_restore_bit_exactly(tmp_path):
  # int8 activations and buffers, bfloat16 (x~, delta): Quantized payloads.
  from petra_jax.engine.arrays import quantize

  def build():
    pipe = pipeline.Pipeline(tiny_revnet(), optax.sgd(0.05, momentum=0.9), jax.devices()[:1],
                             formats=quantize.MessageFormats("int8", "bfloat16", "int8"))
    return pipe, pipe.init(0, random_batch()[0])

  pipe, state = build()
  state, _ = _run(pipe, state, range(13))
  is_q = lambda x: isinstance(x, quantize.Quantized)  # noqa: E731
  assert any(is_q(x) for box in state.inbox + state.buffers
             for x in jax.tree.leaves(list(box.values()), is_leaf=is_q))
  ckpt = checkpoint.Checkpointer(str(tmp_path), keep=1, fingerprint=FP)
  ckpt.save(13, state, extra={})
  ckpt.wait()
  _, expected = _run(pipe, state, range(13, 25))
  pipe2, template = build()
  _, restored, _, _ = ckpt.restore(template, pipe2.devices)
  _, got = _run(pipe2, restored, range(13, 25))
  assert len(got) == 12
  np.testing.assert_array_equal(got, expected)


# ----------------------------------------------------------------------------
# orbax_local: orbax's public API, and what it relies on in orbax.
# ----------------------------------------------------------------------------

def _local_manager(path, **async_options):
  from petra_jax.training.checkpoint import orbax_local
  options = orbax_local.manager_options(str(path))
  if async_options:
    options.async_options = ocp.AsyncOptions(**async_options)
  return ocp.CheckpointManager(str(path), options=options,
                               item_handlers=orbax_local.item_handlers(str(path)))


def _save_tiny(path, **async_options):
  """Saves ``{"a": arange(6), "b": ones((2, 3))}`` as numpy with
  orbax_local's manager; returns the tree."""
  tree = {"a": np.arange(6, dtype=np.int32), "b": np.ones((2, 3), np.float32)}
  path.mkdir()
  manager = _local_manager(path, **async_options)
  manager.save(3, args=ocp.args.Composite(arrays=ocp.args.PyTreeSave(tree),
                                          meta=ocp.args.JsonSave({"x": 1})))
  manager.wait_until_finished()
  manager.close()
  return tree


def test_local_numpy_handler_files_read_with_plain_orbax(tmp_path):
  # LocalNumpyHandler changes who writes, not what: orbax's own handlers
  # read its files back.
  tree = _save_tiny(tmp_path / "ckpt")
  plain = ocp.CheckpointManager(str(tmp_path / "ckpt"), item_handlers={
      "arrays": ocp.PyTreeCheckpointHandler(), "meta": ocp.JsonCheckpointHandler()})
  got = plain.restore(3, args=ocp.args.Composite(
      arrays=ocp.args.PyTreeRestore(), meta=ocp.args.JsonRestore()))
  plain.close()
  assert got["meta"] == {"x": 1}
  for k, v in tree.items():
    np.testing.assert_array_equal(np.asarray(got["arrays"][k]), v)
    assert np.asarray(got["arrays"][k]).dtype == v.dtype


def test_orbax_sets_no_signal_when_directories_are_created_synchronously(tmp_path,
                                                                         monkeypatch):
  # orbax_local relies on it: orbax names the signals of a save after an
  # operation counter that every process of a run shares in jax.distributed's
  # key-value store; two processes saving at once must not set any.
  from petra_jax.training.checkpoint import orbax_local
  try:
    # pylint: disable-next=g-import-not-at-top
    from orbax.checkpoint._src.futures import signaling_client
    client = signaling_client.get_signaling_client()
    real_set = client.key_value_set
  except (ImportError, AttributeError) as e:
    pytest.fail(f"orbax-checkpoint {ocp.__version__} moved its signaling client ({e}; tested "
                f"with {orbax_local.TESTED_ORBAX}): check that a save with "
                "create_directories_asynchronously=False still sets no signal, then update "
                "this test's probe.")
  keys = []

  def record(key, *args, **kwargs):
    keys.append(key)
    return real_set(key, *args, **kwargs)

  monkeypatch.setattr(client, "key_value_set", record)
  _save_tiny(tmp_path / "async", create_directories_asynchronously=True)
  assert keys, "the probe sees no signal even where orbax sets them: fix the probe"
  keys.clear()
  _save_tiny(tmp_path / "sync")
  assert not keys, (
      f"orbax-checkpoint {ocp.__version__} sets signals {keys} on a save with synchronous "
      f"directories (tested with {orbax_local.TESTED_ORBAX}): processes saving at once "
      "would read each other's; give each process its own signal names in orbax_local.py.")


def test_missing_orbax_name_fails_naming_the_tested_version():
  from petra_jax.training.checkpoint import orbax_local
  with pytest.raises(ImportError, match=r"orbax\.checkpoint\.type_handlers\.NoSuch.*"
                     r"pip install orbax-checkpoint==0\.12\.8"):
    orbax_local._public("type_handlers.NoSuch")  # pylint: disable=protected-access


@pytest.mark.parametrize("dtype", ["float32", "int32", "bfloat16"])
def test_local_write_needs_no_dtype_in_the_spec(tmp_path, dtype):
  # Some orbax releases build zarr specs without "dtype" in the metadata (seen on a GPU
  # image: tensorstore then refused the save); the writer passes the array's own dtype.
  import asyncio
  import tensorstore as ts
  from petra_jax.training.checkpoint import orbax_local
  value = np.arange(6).reshape(2, 3).astype(jax.numpy.dtype(dtype))
  spec = {"driver": "zarr", "kvstore": {"driver": "file", "path": str(tmp_path / "a")},
          "metadata": {"chunks": [2, 3], "shape": [2, 3]}}
  asyncio.run(orbax_local._write(value, spec, ts.Context()))
  back = ts.open(ts.Spec(spec), open=True).result().read().result()
  assert back.dtype == value.dtype
  np.testing.assert_array_equal(np.asarray(back, np.float64), np.arange(6).reshape(2, 3))
