"""Zero bubble (ZB-H1, Qi et al., ICLR 2024): its table, its bubble, and updates equal to backprop's."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from petra_jax import models
from petra_jax.benchmarks.memory import model as memory_model
from petra_jax.benchmarks import simulate
from petra_jax.engine import pipeline
from petra_jax.engine.schedules import Schedule, Task, TaskKind
from petra_jax.engine.stages.stage import Stage
import reference_loop
from helpers import batches_of, random_batch, run_ticks, tiny_revnet


def _when(table):
  when = {}
  for t, tick in enumerate(table):
    assert len({task.stage for task in tick}) == len(tick), tick  # one task per stage and tick
    for task in tick:
      assert task not in when, task
      when[task] = t
  return when


def _consumes(task, J):
  """Read off Qi et al. Fig. 2: F after the previous stage's F, B after the next stage's B
  (or the loss), W after its own B; the last stage's F and B (with the loss) before its W."""
  j, kind, m = task
  if kind == TaskKind.FORWARD:
    return [Task(j - 1, TaskKind.FORWARD, m)] if j else []
  if kind == TaskKind.LOSS_INPUT_GRAD:
    return [Task(J - 2, TaskKind.FORWARD, m)]
  if kind == TaskKind.INPUT_GRAD:
    return [Task(j, TaskKind.FORWARD, m), Task(j + 1, TaskKind.LOSS_INPUT_GRAD if j == J - 2 else TaskKind.INPUT_GRAD, m)]
  return [Task(j, TaskKind.LOSS_INPUT_GRAD if j == J - 1 else TaskKind.INPUT_GRAD, m)]


@pytest.mark.parametrize("J, k", [(2, 1), (3, 4), (4, 8), (8, 8), (10, 4)])
def test_table_runs_every_task_once_after_what_it_consumes(J, k):
  table = Schedule("zb_h1", J, 2 * k, k)
  when = _when(table)
  kinds = {TaskKind.FORWARD: J - 1, TaskKind.INPUT_GRAD: J - 1, TaskKind.WEIGHT_GRAD: J, TaskKind.LOSS_INPUT_GRAD: 1}
  assert len(when) == sum(kinds.values()) * 2 * k
  for task, t in when.items():
    assert all(when[d] < t for d in _consumes(task, J)), task
  first_update_end = max(t for (_, _, m), t in when.items() if m < k)
  assert all(t > first_update_end for (_, _, m), t in when.items() if m >= k)  # flushed


def test_half_of_1f1b_bubble_at_1f1b_peak_memory():
  """J = k = 8, T_F = T_B = T_W = 1 (the loss F + B + W = 3): 1F1B idles (J-1)/(k+J-1);
  ZB-H1 at most half of it, each stage holding at most 1F1B's peak (stage 0's, min(J, k))."""
  J, k = 8, 8
  F, B = [1.0] * J, [2.0] * (J - 1) + [3.0]
  one_f_one_b = simulate.ms_per_update("1f1b", J, k, F, B)["bubble_fraction"]
  zero_bubble = simulate.ms_per_update("zb_h1", J, k, F, B)["bubble_fraction"]
  assert one_f_one_b == pytest.approx((J - 1) / (k + J - 1))
  assert zero_bubble <= one_f_one_b / 2
  peak_1f1b = memory_model.peak_held(Schedule("1f1b", J, 2 * k, k))
  peak_zb = memory_model.peak_held(Schedule("zb_h1", J, 2 * k, k))
  assert max(peak_zb) == max(peak_1f1b) == min(J, k)


def test_peak_device_memory_of_1f1b_on_a_revnet():
  """The memory model on RevNet18 (J = 10 stages, k = 8): the device that holds most holds as
  much under ZB-H1 as under 1F1B (a stage's bytes: held micro-batches x its input's bytes)."""
  sizes = memory_model.stage_bytes(models.build_model("revnet18", width=4), (32, 32, 3), 8)
  peaks = {m: max(memory_model.stored_bytes(sizes, m, accumulation_steps=8))
           for m in ("1f1b", "zb_h1")}
  assert peaks["zb_h1"] == peaks["1f1b"] > 0


class _Block(nn.Module):
  """A user's plain block: Dense, BatchNorm, ReLU on ``[B, D]``."""
  features: int

  @nn.compact
  def __call__(self, x, train=True):
    x = nn.Dense(self.features)(x.reshape(x.shape[0], -1))
    return nn.relu(nn.BatchNorm(use_running_average=not train)(x))


class _Out(nn.Module):
  """A user's head: logits ``[B, 10]``."""

  @nn.compact
  def __call__(self, x, train=True):
    return nn.Dense(10)(x)


def _user_model():
  return [Stage("in", _Block(8), False), Stage("mid", _Block(8), False), Stage("out", _Out(), False)]


@pytest.mark.parametrize("model", ["revnet", "revvit", "user"])
def test_updates_equal_backprop(model):
  """k = 2 accumulated micro-batches per update, stages on 4 virtual devices: the losses and
  the weights after 2 updates ``==`` jax.grad of the composed model's (method backprop) on
  the user's model; on the RevNet and the RevViT, where XLA compiles a stage's vjp
  differently from the whole model's, equal to float32 round-off, as for ``1f1b`` and
  ``gpipe`` (measured: at most 5e-7 of a stage's norm)."""
  stages = {"revnet": tiny_revnet,
            "revvit": lambda: models.build_model("revvit_tiny", width=2, depth=1),
            "user": _user_model}[model]()
  k, M = 2, 4
  tx = optax.MultiSteps(optax.sgd(0.5, momentum=0.9), k)
  out = {}
  for name, devices in (("backprop", jax.devices()[:1]), ("zb_h1", jax.devices()[:4])):
    pipe = pipeline.Pipeline(stages, tx, devices, method=name, accumulation_steps=k)
    state = pipe.init(0, random_batch()[0])
    state, losses = run_ticks(pipe, state, M, batches_of())
    assert state.in_flight() == 0
    out[name] = (np.array([float(o.loss) for o in sorted(losses)]),
                 jax.device_get([s.params for s in state.train_states]))
  if model == "user":
    np.testing.assert_array_equal(out["zb_h1"][0], out["backprop"][0])
    jax.tree.map(np.testing.assert_array_equal, out["zb_h1"][1], out["backprop"][1])
  else:
    np.testing.assert_allclose(out["zb_h1"][0], out["backprop"][0], rtol=1e-6)
    assert reference_loop.max_rel_diff(out["zb_h1"][1], out["backprop"][1]) < 2e-6
  assert not jnp.allclose(out["backprop"][0][0], out["backprop"][0][-1])  # it trains


def test_step_wrap_wraps_the_split_backward_too():
  """``step_wrap`` reaches ZB-H1's own steps (B, W, the last stage's F and B), not only the
  shared forward: a hollow ZB-H1 pipeline (the host benchmark's) computes nothing."""
  from petra_jax.benchmarks import host  # pylint: disable=g-import-not-at-top
  wrapped = []

  def wrap(fn):
    inner = getattr(fn, "__wrapped__", fn)  # packing.on_packed's
    wrapped.append(getattr(inner, "func", inner).__name__)  # a functools.partial's
    return host.noop_step(fn)

  pipe = pipeline.Pipeline(tiny_revnet(), optax.sgd(0.1), jax.devices()[:1], method="zb_h1",
                           step_wrap=wrap)
  assert {"input_grad_step", "weight_grad_step", "loss_input_grad_step"} <= set(wrapped)
  state = pipe.init(0, random_batch()[0])
  state, losses = run_ticks(pipe, state, 4, batches_of())
  assert state.in_flight() == 0 and len(losses) == 4
  assert all(float(o.loss) == 0 for o in losses)  # every step hollow, the loss stage's too
