"""Quantised messages and buffers in the engine, and bfloat16 compute.

Checked against independent computations: the composed model with the
round-trip written out at every stage boundary (forward messages), a chain
of ``jax.vjp`` with rounded cotangents (backward messages), the dtypes and
bytes of what the devices really hold, and a training run's recorded
reconstruction error in bfloat16.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from petra_jax.training import validation
import helpers
from helpers import random_batch, random_variables, run_ticks, tiny_revnet
from petra_jax import models, train
from petra_jax.training import metrics
from petra_jax.engine.arrays import quantize
from petra_jax.engine.stages import stage as stage_lib
from petra_jax.engine.pipeline import Pipeline
from petra_jax.engine.stages.stage import Stage
from helpers import tiny_config


def _tiny_resnet():
  """stem, block, strided block, head: a 4-stage ResNet of width 2 in which
  every stage recomputes (no reversible stage), with BatchNorm."""
  return [Stage("stem", models.Stem(2, two_streams=False), False),
          Stage("block0", models.ResNetBasicBlock(2), False),
          Stage("down", models.ResNetBasicBlock(4, 2), False),
          Stage("head", models.Head(10), False)]


def _pipeline(formats, method="petra", stages=None, **kwargs):
  """``stages`` (default: the tiny RevNet) trained by SGD at rate 1 on one device."""
  stages = tiny_revnet() if stages is None else stages
  return Pipeline(stages, optax.sgd(1.0), jax.devices()[:1], method=method, formats=formats,
                  **kwargs)


def _set_random_variables(pipe, state, x):
  """Replaces every stage's variables with numpy-drawn ones (fast, seeded)."""
  h = x
  for j, s in enumerate(pipe.stages):
    v = random_variables(s, h, j)
    state.stage_states[j] = state.train_states[j].replace(
        params=v["params"], batch_stats=v["batch_stats"],
        opt_state=state.train_states[j].tx.init(v["params"]))
    h = stage_lib.forward(s, v["params"], v["batch_stats"], h)[0]
  return state


def _round_trip(h, fmt):
  return jax.tree.map(lambda a: quantize.dequantize(quantize.quantize(a, fmt)), h)


def test_int8_messages_and_buffers_are_int8_on_the_stage_devices():
  x, y = random_batch(batch=8, size=16)
  plain = _pipeline(None)
  q8 = _pipeline(quantize.MessageFormats("int8", "int8", "int8"))
  held = {}
  for name, pipe in (("float", plain), ("int8", q8)):
    state = pipe.init(0, x)
    state, _ = run_ticks(pipe, state, 19, lambda m: (x, y), num_ticks=19)  # steady state
    held[name] = sum(state.stored_bytes())
    if name == "int8":
      boxes = state.inbox[1:] + state.grad_inbox[:-1] + state.buffers
      payloads = [p for box in boxes for p in box.values()]
      leaves = jax.tree.leaves(payloads, is_leaf=lambda n: isinstance(n, quantize.Quantized))
      assert payloads and all(isinstance(l, quantize.Quantized) for l in leaves)
      assert {l.values.dtype for l in leaves} == {jnp.dtype(jnp.int8)}
      assert all(l.values.devices() == {pipe.devices[0]} for l in leaves)
  # int8 values plus one float32 scale per tensor: just over a quarter.
  assert 3.5 < held["float"] / held["int8"] <= 4.0


def test_forward_messages_enter_the_next_stage_rounded():
  x, y = random_batch(batch=8, size=16)
  pipe = _pipeline(quantize.MessageFormats(forward="bfloat16"), method="revprop")
  state = _set_random_variables(pipe, pipe.init(0, x), x)
  params = [s.params for s in state.train_states]
  stats = [s.batch_stats for s in state.train_states]
  # Independent: the stages composed with the bfloat16 round-trip written out
  # at each stage boundary (the module's own forward, not the engine's).
  @jax.jit
  def rounded_loss(params, stats, h):
    for j, s in enumerate(pipe.stages):
      if j > 0:
        h = _round_trip(h, "bfloat16")
      h = stage_lib.forward(s, params[j], stats[j], h)[0]
    return optax.softmax_cross_entropy_with_integer_labels(h, y).mean()

  expected = rounded_loss(params, stats, x)
  unrounded = stage_lib.composed_loss(pipe.stages, params, stats, x, y)[0]
  _, loss = helpers.drained_step(pipe, state, x, y)
  # (two float32 programs can round a few elements to the other bfloat16
  # neighbour; measured on the tiny RevNet: equal, while the rounding itself
  # moves the loss by 3.7e-4)
  np.testing.assert_allclose(float(loss), float(expected), rtol=1e-4)
  # ... and it tells the rounded composition from the unrounded one: the
  # engine's loss is several times closer to the rounded one.
  assert abs(float(unrounded) - float(expected)) > 5 * abs(float(loss) - float(expected))


def _stage_vjp(stage, params, batch_stats, h, dh):
  """``(d params, d h)`` of one stage's training forward at ``(params, h)``."""
  return jax.vjp(lambda p, x: stage_lib.forward(stage, p, batch_stats, x)[0], params, h)[1](dh)


def _vjp_chain(stages, params, stats, x, y, fmt):
  """Per-stage parameter gradients of the chain of per-stage vjps of the
  mean cross-entropy, each cotangent sent to the previous stage rounded
  through ``fmt`` ("none": exact). Every stage's forward and vjp is jitted,
  as the engine's steps are (eager and jitted float32 differ in the last bit)."""
  hs, h = [], x
  for s, p, bs in zip(stages, params, stats):
    hs.append(h)
    h = jax.jit(functools.partial(stage_lib.forward, s))(p, bs, h)[0]
  dh = jax.jit(jax.grad(lambda logits: optax.softmax_cross_entropy_with_integer_labels(
      logits, y).mean()))(h)
  grads = [None] * len(stages)
  for j in reversed(range(len(stages))):
    grads[j], dh = jax.jit(functools.partial(_stage_vjp, stages[j]))(params[j], stats[j], hs[j], dh)
    dh = _round_trip(dh, fmt) if fmt != "none" else dh
  return grads


def _flat(tree):
  return np.concatenate([np.ravel(np.asarray(l)) for l in jax.tree.leaves(tree)])


def test_backward_messages_carry_rounded_cotangents():
  # A tiny ResNet (every stage recomputes), one micro-batch of GPipe: the update
  # (SGD, rate 1) is minus the chain of per-stage vjps in which every
  # cotangent sent to the previous stage is rounded to bfloat16. Rounding
  # moves every element of a cotangent by up to half a bfloat16 ulp; the
  # last-bit float32 differences between the engine's programs and these
  # flip the rounding of only a few elements. So the distance is measured
  # in the 2-norm over all of a stage's parameters (which a few flipped
  # elements barely move, unlike the max-norm), and each stage's update must
  # be several times closer to the rounded chain than to the exact one.
  x, y = random_batch(batch=8, size=16)
  pipe = _pipeline(quantize.MessageFormats(backward="bfloat16"), method="gpipe",
                   stages=_tiny_resnet())
  state = _set_random_variables(pipe, pipe.init(0, x), x)
  before = [jax.tree.map(np.array, s.params) for s in state.train_states]  # (donated)
  stats = [jax.tree.map(np.array, s.batch_stats) for s in state.train_states]
  rounded = _vjp_chain(pipe.stages, before, stats, x, y, "bfloat16")
  exact = _vjp_chain(pipe.stages, before, stats, x, y, "none")
  state, _ = run_ticks(pipe, state, 1, lambda m: (x, y))
  for j, s in enumerate(state.train_states):
    applied = _flat(before[j]) - _flat(s.params)
    scale = np.linalg.norm(_flat(rounded[j]))
    to_rounded = np.linalg.norm(applied - _flat(rounded[j])) / scale
    to_exact = np.linalg.norm(applied - _flat(exact[j])) / scale
    if j == len(pipe.stages) - 1:  # the loss stage receives no rounded cotangent
      assert to_rounded < 1e-5 and to_exact < 1e-5
    else:
      assert to_exact > 1e-4, (j, to_exact)  # the rounding is visible ...
      assert to_rounded < 0.2 * to_exact, (j, to_rounded, to_exact)  # ... and was applied


def test_bfloat16_compute_keeps_parameters_and_updates_in_float32():
  x, y = random_batch(batch=8, size=16)
  stages = stage_lib.with_precision(tiny_revnet(),
                                    stage_lib.Precision("bfloat16", "bfloat16"))
  pipe = Pipeline(stages, optax.MultiSteps(optax.sgd(0.1, momentum=0.9), 2), jax.devices()[:1])
  state = pipe.init(0, x)
  state, outs = run_ticks(pipe, state, 21, lambda m: (x, y), num_ticks=21)
  for st in state.train_states:
    assert {a.dtype for a in jax.tree.leaves((st.params, st.opt_state, st.batch_stats))
            if jnp.issubdtype(a.dtype, jnp.floating)} == {jnp.dtype(jnp.float32)}
  messages = [p for box in state.inbox[1:] for p in box.values()]
  assert messages and {a.dtype for a in jax.tree.leaves(messages)} == {jnp.dtype(jnp.bfloat16)}
  assert all(np.isfinite(float(o.loss)) for o in outs)


def test_float32_streams_make_bfloat16_reconstruction_exact():
  # F is deterministic, so with float32 streams y1 - F(y2) gives back x2 up to
  # float32 round-off even though F computes in bfloat16; with bfloat16
  # streams the addition and the subtraction each round to 8 bits.
  rng = np.random.default_rng(1)
  streams = tuple(jnp.asarray(rng.normal(size=(4, 8, 8, 4)), jnp.float32) for _ in range(2))
  block = models.build_model("revnet18", width=4)[1]
  errors = {}
  for name in ("float32", "bfloat16"):
    s = stage_lib.with_precision([block], stage_lib.Precision("bfloat16", name))[0]
    v = random_variables(s, streams, 0)
    x = jax.tree.map(lambda a: a.astype(name), streams)
    back = stage_lib.inverse(s, v["params"], v["batch_stats"],
                             stage_lib.forward(s, v["params"], v["batch_stats"], x)[0])
    errors[name] = max(float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))
                       for a, b in zip(back, x))
  assert errors["float32"] < 1e-5
  assert errors["bfloat16"] > 1e-3


def _reconstruction_errors(cifar10_dir, workdir, **overrides):
  c = tiny_config(cifar10_dir, method="revprop", reconstruction_error_every=5,
                  steps_per_epoch=15, **overrides)
  result = train.train_and_evaluate(c, str(workdir))
  assert np.isfinite(result["test_loss"])
  return [v for r in metrics.read_metrics(str(workdir)) for k, v in r.items()
          if k.startswith("reconstruction_error/")]


@pytest.mark.long
@pytest.mark.slow
def test_bfloat16_training_records_its_reconstruction_drift(cifar10_dir, tmp_path):
  # revprop (every delay 0): in float32 the reconstruction is exact up to
  # round-off (~1e-7), so what is recorded here is the precision's own drift.
  bf16 = _reconstruction_errors(cifar10_dir, tmp_path / "bf16", dtype="bfloat16")
  kept = _reconstruction_errors(cifar10_dir, tmp_path / "f32_streams", dtype="bfloat16",
                                stream_dtype="float32")
  assert len(bf16) == len(kept) >= 8 and all(np.isfinite(bf16))
  assert 1e-4 < max(bf16) < 1e-2  # 8-bit streams: ~2^-8 per stage, chained
  assert max(kept) < 1e-5         # float32 streams: exact reconstruction


@pytest.mark.parametrize("field,value", [("dtype", "float16"), ("stream_dtype", "fp32"),
                                         ("quantize.forward", "int4"),
                                         ("quantize.buffer", "fp8")])
def test_bad_numerics_config_names_the_flag(field, value):
  c = tiny_config("", **{field: value})
  with pytest.raises(validation.ConfigError, match=f"--config.{field}="):
    validation.validate_config(c, 1)


def _payload_key(seed, m, j, kind):
  """The documented key of stage ``j``'s ``kind`` payload of micro-batch
  ``m``, written out: ``fold_in(fold_in(key(seed + 2), m), 3 j + i)``, ``i``
  the index of ``kind`` in (forward, backward, buffer)."""
  code = 3 * j + ("forward", "backward", "buffer").index(kind)
  return jax.random.fold_in(jax.random.fold_in(jax.random.key(seed + 2), m), code)


def _assert_same_leaves(a, b):
  for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_array_equal(u, v)


def test_stochastic_int8_keys_follow_seed_micro_batch_stage_and_kind():
  x, _ = random_batch(batch=8, size=16)
  pipe = _pipeline(quantize.MessageFormats("int8", "int8", "int8", stochastic=True))
  pipe.init(5, x)
  payload = (x, 2.0 * x)
  for m, j, kind in ((0, 0, "forward"), (3, 1, "buffer"), (7, 2, "backward"), (7, 2, "buffer")):
    _assert_same_leaves(pipe.messages.encode(kind, payload, j, m),
                        quantize.quantize(payload, "int8", key=_payload_key(5, m, j, kind)))


def test_stochastic_int8_messages_are_unbiased_draws_of_the_forward():
  # The message stage 0 sends for micro-batch m is the stochastic int8
  # rounding, with the documented key for (forward, 0, m), of the stem's
  # output computed independently; the draws differ between micro-batches
  # and average towards the float activation.
  x, y = random_batch(batch=8, size=16)
  formats = quantize.MessageFormats(forward="int8", stochastic=True)
  pipe = _pipeline(formats)
  state = _set_random_variables(pipe, pipe.init(0, x), x)
  st = state.train_states[0]
  stem_out = stage_lib.forward(pipe.stages[0], st.params, st.batch_stats, x)[0]
  sent = []
  for m in range(16):
    msg = pipe.messages.encode("forward", stem_out, 0, m)
    _assert_same_leaves(msg, quantize.quantize(stem_out, "int8",
                                               key=_payload_key(0, m, 0, "forward")))
    sent.append(quantize.dequantize(msg))
  bound = quantize.error_bound(stem_out, "int8", stochastic=True)
  for d in sent:
    assert all(bool(jnp.all(jnp.abs(a - b) <= e))
               for a, b, e in zip(jax.tree.leaves(d), jax.tree.leaves(stem_out),
                                  jax.tree.leaves(bound)))
  assert not np.array_equal(sent[0][0], sent[1][0])
  mean = jax.tree.map(lambda *a: jnp.mean(jnp.stack(a), 0), *sent)
  one = jnp.abs(sent[0][0] - stem_out[0]).mean()
  assert jnp.abs(mean[0] - stem_out[0]).mean() < 0.5 * one  # averaging 16 draws: ~1/4


@pytest.mark.long
def test_stochastic_int8_run_is_reproducible():
  x, y = random_batch(batch=8, size=16)
  losses = []
  for _ in range(2):
    pipe = _pipeline(quantize.MessageFormats("int8", "int8", "int8", stochastic=True))
    state = pipe.init(3, x)
    _, outs = run_ticks(pipe, state, 4, lambda m: (x, y))
    losses.append([float(o.loss) for o in outs])
  assert losses[0] == losses[1] and all(np.isfinite(losses[0]))
