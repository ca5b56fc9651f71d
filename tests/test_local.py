"""Method ``local`` (DGL): auxiliary heads, and each stage trained on its own loss."""

import jax
import jax.numpy as jnp
import optax
import pytest

from petra_jax.engine import methods
from petra_jax.engine import pipeline
from petra_jax.engine import schedules as schedule
from petra_jax.engine.stages.stage import group
from petra_jax.engine.methods.auxiliary import AUX_KEY
from petra_jax.models import auxiliary
from helpers import batches_of, random_batch, random_variables, rel_err, run_ticks, tiny_revnet

LR = 0.5


def _plain_forward(stage, params, h):
  """A stage's forward spelt out block by block (independent of the engine)."""
  blocks = stage.blocks or (stage,)
  for i, b in enumerate(blocks):
    p = params[f"block_{i}"] if stage.blocks else {k: v for k, v in params.items()
                                                   if k != AUX_KEY}
    if b.reversible:
      f, _ = b.module.apply({"params": p}, h[0], train=True, mutable=["batch_stats"])
      h = (h[1] + f, h[0])
    else:
      h, _ = b.module.apply({"params": p}, h, train=True, mutable=["batch_stats"])
  return h


def _two_stages(kind="mlp"):
  blocks = tiny_revnet()  # stem and a reversible block grouped, then the head
  return auxiliary.with_heads([group(blocks[:2]), blocks[4]], kind, 10, hidden=8)


@pytest.mark.parametrize("kind", auxiliary.HEADS)
def test_local_with_one_stage_before_the_head_is_backprop_on_the_aux_loss(kind):
  stages = _two_stages(kind)
  pipe = pipeline.Pipeline(stages, optax.sgd(LR), jax.devices()[:1], method="local")
  x, y = random_batch()
  state = pipe.init(0, x)
  before = [jax.tree.map(jnp.copy, s.params) for s in state.train_states]

  def aux(p):  # stage 0 and its head, composed and differentiated by jax.grad
    h = _plain_forward(stages[0], p, x)
    logits = auxiliary.AuxHead(kind, 10, 8).apply({"params": p[AUX_KEY]}, h)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

  h0 = _plain_forward(stages[0], before[0], x)

  def last(p):  # the real loss, on stage 0's output (detached)
    logits = stages[1].module.apply({"params": p}, h0, train=True, mutable=["batch_stats"])[0]
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

  state, outs = run_ticks(pipe, state, 1, lambda m: (x, y))
  refs = (jax.jit(jax.grad(aux))(before[0]), jax.jit(jax.grad(last))(before[1]))
  for j, ref in enumerate(refs):
    step = jax.tree.map(lambda b, a: (b - a) / LR, before[j], state.train_states[j].params)
    assert rel_err(step, ref) < 1e-5, j
  assert abs(float(outs[0].loss) - float(jax.jit(last)(before[1]))) < 1e-5


def test_local_stream_has_no_backward_tasks_and_stores_nothing():
  blocks = tiny_revnet()
  stages = auxiliary.with_heads([blocks[0], blocks[1], blocks[4]], "linear", 10)
  pipe = pipeline.Pipeline(stages, optax.sgd(0.1), jax.devices()[:1], method="local")
  table = pipe.schedule(6)
  assert len(table) == 6 + len(stages) - 1
  assert all(t.kind != schedule.TaskKind.BACKWARD for tick in table for t in tick)
  state = pipe.init(0, random_batch()[0])
  state, outs = run_ticks(pipe, state, 6, batches_of(), num_ticks=len(stages) + 1)
  assert state.stored_bytes() == [0] * len(stages)
  assert [o.micro_batch for o in outs] == [0, 1]  # tick m + J - 1 = m + 2
  assert not methods.get("local").delayed


def test_head_does_not_change_the_stage_forward():
  blocks = tiny_revnet()
  x, _ = random_batch()
  with_head = auxiliary.with_heads(blocks, "cnn", 10, hidden=4)
  v = random_variables(with_head[0], x, 0)
  assert AUX_KEY in v["params"]
  plain = {k: a for k, a in v["params"].items() if k != AUX_KEY}
  from petra_jax.engine.stages.stage import forward  # pylint: disable=g-import-not-at-top
  a = forward(with_head[0], v["params"], v["batch_stats"], x)[0]
  b = forward(blocks[0], plain, v["batch_stats"], x)[0]
  assert all(jnp.array_equal(u, w) for u, w in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def test_local_method_needs_auxiliary_heads():
  with pytest.raises(ValueError, match="no auxiliary head"):
    pipeline.Pipeline(tiny_revnet(), optax.sgd(0.1), method="local")


def test_engine_and_config_refuse_quantised_messages_by_one_rule():
  """The Pipeline (API users) and the config check refuse a local method's quantised
  messages with the same words: one rule, ``local_learning.check_transport``."""
  from petra_jax import config as config_lib  # pylint: disable=g-import-not-at-top
  from petra_jax.engine.arrays import quantize  # pylint: disable=g-import-not-at-top
  from petra_jax.training import validation  # pylint: disable=g-import-not-at-top
  with pytest.raises(ValueError) as engine:
    pipeline.Pipeline(auxiliary.with_heads(tiny_revnet(), "cnn", 10), optax.sgd(0.1),
                      method="local", formats=quantize.MessageFormats(backward="int8"))
  config = config_lib.get_config()
  config.method, config.quantize.backward = "local", "int8"
  with pytest.raises(validation.ConfigError) as checked:
    validation.validate_config(config, 1)
  assert str(engine.value) == str(checked.value)
  assert "--config.quantize.backward=none" in str(engine.value)
