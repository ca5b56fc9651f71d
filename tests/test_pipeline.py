"""The PETRA engine: Eq. 5 read literally, the tick schedule, device placement."""

import collections
import functools

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from petra_jax.engine import observers
from petra_jax.engine import pipeline
from petra_jax.engine import schedules as schedule
from petra_jax.engine.transport import pipeline_state as state_lib
from petra_jax.engine.stages import steps as steps_lib
from petra_jax.engine.stages import stage as stage_lib
from petra_jax.engine.stages import stage_checks
from petra_jax.engine.stages.stage import Stage
from helpers import batches_of, random_batch, run_ticks, tiny_revnet

LR = 0.1


class _In(nn.Module):  # stage 0: x [B, 3] -> streams 2 x [B, 2]
  @nn.compact
  def __call__(self, x, train=True):
    h = jnp.tanh(nn.Dense(4)(x))
    return h[:, :2], h[:, 2:]


class _F(nn.Module):  # residual function of the reversible stage 1
  @nn.compact
  def __call__(self, x, train=True):
    return jnp.tanh(nn.Dense(2)(x))


class _Head(nn.Module):  # stage 2: streams -> logits [B, 3]
  @nn.compact
  def __call__(self, x, train=True):
    return nn.Dense(3)(jnp.concatenate(x, -1))


def _toy_stages():
  return [Stage("in", _In(), False), Stage("rev", _F(), True), Stage("head", _Head(), False)]


def _toy_data(num, seed=0):
  rng = np.random.default_rng(seed)
  xs = [jnp.asarray(rng.normal(size=(4, 3)), jnp.float32) for _ in range(num)]
  ys = [jnp.asarray(rng.integers(0, 3, 4), jnp.int32) for _ in range(num)]
  return xs, ys


def _literal_eq5(theta0, xs, ys, num_ticks):
  """Paper Eq. 5 and Alg. 1 for J = 3, written out tick by tick.

  Plain SGD theta <- theta - LR * Delta; every stage uses theta_j^t for both
  its forward and its backward of tick t, then updates.
  """
  f0 = lambda p, x: _In().apply({"params": p}, x)
  F1 = lambda p, x1: _F().apply({"params": p}, x1)
  f2 = lambda p, h: _Head().apply({"params": p}, h)
  loss = lambda p, h, y: optax.softmax_cross_entropy_with_integer_labels(f2(p, h), y).mean()
  th = list(theta0)
  to_1 = to_2 = None          # forward messages (arrive next tick)
  back_to_1 = back_to_0 = None  # backward messages (x~, delta)
  buffer0 = collections.deque()  # stage 0 is not reversible: it buffers its input
  history = []
  for t in range(num_ticks):
    new = list(th)
    n_to_1 = n_to_2 = n_back_to_1 = n_back_to_0 = None
    # stage 0: forward on micro-batch t; backward on what came from stage 1.
    if t < len(xs):
      buffer0.append(xs[t])
      n_to_1 = (f0(th[0], xs[t]), t)
    if back_to_0 is not None:
      delta1 = back_to_0
      x_buf = buffer0.popleft()
      _, vjp = jax.vjp(lambda p: f0(p, x_buf), th[0])
      (g0,) = vjp(delta1)
      new[0] = jax.tree.map(lambda a, g: a - LR * g, th[0], g0)
    # stage 1 (reversible): x_1^{t+1} = F_1(x_0^t, theta_1^t) ...
    if to_1 is not None:
      (x1, x2), m = to_1
      n_to_2 = ((x2 + F1(th[1], x1), x1), m)
    if back_to_1 is not None:
      (y1, y2), delta2 = back_to_1
      x_tilde = (y2, y1 - F1(th[1], y2))           # x~_0^{t+1} = F_1^{-1}(x~_1^t, theta_1^t)
      coupling = lambda p, x: (x[1] + F1(p, x[0]), x[0])
      _, vjp = jax.vjp(coupling, th[1], x_tilde)  # derivatives at (x~_0^{t+1}, theta_1^t)
      g1, delta1 = vjp(delta2)
      new[1] = jax.tree.map(lambda a, g: a - LR * g, th[1], g1)
      n_back_to_0 = delta1
    # stage 2 (last): forward, loss and backward at once.
    if to_2 is not None:
      h, m = to_2
      l, (g2, delta2) = jax.value_and_grad(loss, argnums=(0, 1))(th[2], h, ys[m])
      new[2] = jax.tree.map(lambda a, g: a - LR * g, th[2], g2)
      n_back_to_1 = (h, delta2)
    th = new
    to_1, to_2, back_to_1, back_to_0 = n_to_1, n_to_2, n_back_to_1, n_back_to_0
    history.append(th)
  return history


def test_engine_equals_literal_eq5():
  stages = _toy_stages()
  pipe = pipeline.Pipeline(stages, optax.sgd(LR), jax.devices()[:1])
  xs, ys = _toy_data(8)
  state = pipe.init(0, xs[0])
  theta0 = [jax.tree.map(lambda a: a.copy(), s.params) for s in state.train_states]
  table = pipe.schedule(len(xs))
  num_ticks = len(table)
  assert num_ticks == 12  # 8 micro-batches + 2(J-1) to drain
  expected = _literal_eq5(theta0, xs, ys, num_ticks)
  moved = 0
  for t in range(num_ticks):
    state, _ = pipe.run_tick(state, table[t], lambda m: (xs[m], ys[m]))
    got = [s.params for s in state.train_states]
    # Same float32 operations in a different order: agreement to ~1e-7.
    chex.assert_trees_all_close(got, expected[t], atol=1e-6, rtol=1e-6)
    moved += t > 0 and not all(np.allclose(a, b) for a, b in zip(
        jax.tree.leaves(expected[t]), jax.tree.leaves(expected[t - 1])))
  assert moved >= 8  # the comparison covers real updates at every stage
  assert state.in_flight() == 0


def test_backward_runs_tau_ticks_after_forward():
  stages = tiny_revnet()  # J = 5: reversible and recomputing stages, delays up to 8
  recorder = observers.TimelineRecorder()
  pipe = pipeline.Pipeline(stages, optax.sgd(0.01), jax.devices()[:1], observers=[recorder])
  x, y = random_batch()
  state = pipe.init(0, x)
  num_micro = 25
  state, _ = run_ticks(pipe, state, num_micro, lambda m: (x, y))
  J = len(stages)
  fwd = {(j, m): t for t, j, k, m in recorder.events if k == "F"}
  bwd = {(j, m): t for t, j, k, m in recorder.events if k == "B"}
  assert len(fwd) == len(bwd) == J * num_micro
  for (j, m), t in fwd.items():
    assert t == m + j
    assert bwd[(j, m)] - t == schedule.delay(j, J) == 2 * (J - 1 - j)
  # Once the pipeline is full, every stage runs a forward and a backward per tick.
  steady = 2 * (J - 1)
  per_tick = collections.Counter((t, k) for t, _, k, _ in recorder.events)
  assert per_tick[(steady, "F")] == J and per_tick[(steady, "B")] == J
  # Drained: nothing held, nothing in flight.
  assert all(len(b) == 0 for b in state.buffers) and state.in_flight() == 0


def test_one_and_four_devices_give_identical_losses():
  stages = tiny_revnet()  # 5 stages on 4 devices
  x, y = random_batch()
  losses = {}
  for n in (1, 4):
    devices = jax.devices()[:n]
    assert len(devices) == n
    pipe = pipeline.Pipeline(stages, optax.sgd(0.05, momentum=0.9), devices)
    state = pipe.init(0, x)
    if n == 4:
      placed = {next(iter(jax.tree.leaves(s.params)[0].devices()))
                for s in state.train_states}
      assert len(placed) == 4
    state, out = run_ticks(pipe, state, 30, batches_of(), num_ticks=30)
    losses[n] = np.asarray(jax.device_get([o.loss for o in out]))
  assert len(losses[1]) == 30 - (len(stages) - 1)
  # Same XLA programs on identical CPU devices: bit-identical.
  np.testing.assert_array_equal(losses[1], losses[4])


def test_steps_compile_once(monkeypatch):
  # A step's Python function runs only while jax traces it (once per
  # compilation): count those runs per step and stage.
  traces = collections.Counter()

  def counted(name):
    fn = getattr(steps_lib, name)

    def traced(stage, *args, **kwargs):
      traces[(name, index[id(stage)])] += 1
      return fn(stage, *args, **kwargs)
    return traced

  names = ("forward_step", "reverse_backward_step", "recompute_backward_step", "loss_step")
  for name in names:
    monkeypatch.setattr(steps_lib, name, counted(name))
  stages = tiny_revnet()
  index = {id(s): j for j, s in enumerate(stages)}
  pipe = pipeline.Pipeline(stages, optax.sgd(0.01), jax.devices()[:2])
  x, y = random_batch()
  state = pipe.init(0, x)
  state, _ = run_ticks(pipe, state, 3 * len(stages), batches_of())
  J = len(stages)
  # Twice each: alone (fill, drain) and inside the fused step (steady state).
  expected = collections.Counter({("forward_step", j): 2 for j in range(J - 1)})
  for j, s in enumerate(stages[:-1]):
    expected["reverse_backward_step" if s.reversible else "recompute_backward_step", j] = 2
  expected["loss_step", J - 1] = 1  # (the head never runs a separate forward)
  assert traces == expected


def test_init_gives_each_stage_its_seed_rules_variables_and_traces_it_twice(monkeypatch):
  """Stage ``j``'s variables are ``stage.init(fold_in(key(seed), j), zeros)`` on its input's
  shape (the rule ``Pipeline.init`` documents, computed here stage by stage), its optimizer
  state ``tx.init`` of them; ``init`` traces each stage's ``init`` twice (the stage check, the
  program), not a third time to learn the stages' shapes."""
  traces = collections.Counter()
  stage_init = Stage.init

  def counted(self, key, x):
    traces[self.name] += 1
    return stage_init(self, key, x)
  monkeypatch.setattr(Stage, "init", counted)
  stages, tx = tiny_revnet(), optax.adamw(1e-3)
  x, _ = random_batch()
  state = pipeline.Pipeline(stages, tx, jax.devices()[:1]).init(5, x)
  assert traces == {s.name: 2 for s in stages}
  one = jax.ShapeDtypeStruct((1, *x.shape[1:]), x.dtype)  # the shapes the check hands on
  assert stage_checks.checked_outputs(stages, one) == [y for _, y in stage_lib.trace(stages, one)]
  key, h = jax.random.key(5, impl="rbg"), jnp.zeros((1, *x.shape[1:]))
  for j, (s, got) in enumerate(zip(stages, state.train_states)):
    want = jax.jit(functools.partial(stage_init, s))(jax.random.fold_in(key, j), h)
    chex.assert_trees_all_equal(got.params, want["params"])
    chex.assert_trees_all_equal(got.batch_stats, want["batch_stats"])
    chex.assert_trees_all_equal(got.opt_state, tx.init(want["params"]))
    h = jax.tree.map(jnp.zeros_like, stage_lib.forward(s, want["params"], want["batch_stats"], h)[0])


def test_bad_stage_lists_raise():
  stages = _toy_stages()
  with pytest.raises(ValueError, match="at least 2"):
    pipeline.Pipeline(stages[:1], optax.sgd(0.1))
  with pytest.raises(ValueError, match="cannot be reversible"):
    pipeline.Pipeline(stages[1:], optax.sgd(0.1))
  with pytest.raises(ValueError, match="bn_stats"):
    pipeline.Pipeline(stages, optax.sgd(0.1), bn_stats="sometimes")


@pytest.mark.parametrize("lr, low, high", [(0.0, 0.0, 1e-5), (0.5, 1e-4, 10.0)])
def test_reconstruction_error_probe(lr, low, high):
  """Without updates the reconstruction is exact up to float32 round-off;
  with updates between forward and backward it is not."""
  stages = tiny_revnet()
  probe = observers.ReconstructionProbe(every_updates=4)
  pipe = pipeline.Pipeline(stages, optax.sgd(lr), jax.devices()[:1], observers=[probe])
  state = pipe.init(0, random_batch()[0])
  num_ticks, J = 30, len(stages)
  state, _ = run_ticks(pipe, state, 30, batches_of(), num_ticks=num_ticks)
  errors = [(m, j, float(e)) for m, j, e in probe.pop_results()]
  reversible = [j for j, s in enumerate(stages) if s.reversible]
  # Probed: every 4th micro-batch (k = 1) at each reversible stage j, whose
  # backward (tick m + j + 2(J - 1 - j)) ran within the ticks.
  assert sorted((m, j) for m, j, _ in errors) == sorted(
      (m, j) for j in reversible for m in range(0, 30, 4) if m + 2 * J - 2 - j < num_ticks)
  # Measured on the tiny RevNet: ~3e-8 at rate 0, 0.23-0.35 at rate 0.5.
  first = max(e for _, j, e in errors if j == reversible[0])
  assert low <= first <= high


def test_a_task_before_its_input_arrives_is_a_schedule_error():
  stages = _toy_stages()
  pipe = pipeline.Pipeline(stages, optax.sgd(LR), jax.devices()[:1])
  xs, ys = _toy_data(1)
  state = pipe.init(0, xs[0])
  with pytest.raises(state_lib.ScheduleError, match="stage 1 has no input for micro-batch 0"):
    pipe.run_tick(state, (schedule.Task(1, schedule.TaskKind.FORWARD, 0),), lambda m: (xs[m], ys[m]))
