"""Tests for petra_jax.optim.compensation, against hand computations of the papers'
equations (NumPy, float64) on a tiny pytree.

The configs are built here (not from petra_jax.config) so these tests only
depend on the fields make_optimizer reads.
"""

import chex
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest

from petra_jax.optim import compensation as comp
from petra_jax.optim import delays, lr_scaling, prediction
from petra_jax.optim import momentum as momentum_lib
from petra_jax import optim

SPE = 4  # optimizer updates per epoch in these tests
LR = 0.1


def make_config(name="sgd", momentum=0.9, nesterov=True, weight_decay=5e-4, k=1,
                schedule="constant", warmup_epochs=0.0, **compensation):
  c = ml_collections.ConfigDict()
  c.batch_size = 128
  c.num_epochs = 10
  c.accumulation_steps = k
  c.optim = ml_collections.ConfigDict(dict(
      name=name, learning_rate=LR, momentum=momentum, nesterov=nesterov,
      weight_decay=weight_decay, schedule=schedule, warmup_epochs=warmup_epochs,
      decay_epochs=(2,), decay_factor=0.1, end_learning_rate=0.0, polynomial_power=2.0,
      trust_coefficient=0.02, lars_eps=1e-8, adam_b1=0.9, adam_b2=0.999, adam_eps=1e-8))
  if compensation:
    c.compensation = comp.defaults()
    for key, value in compensation.items():
      c.compensation[key] = value
  return c


def tiny_params():
  """A dense kernel (weight-decayed) and a bias (not decayed)."""
  return {"dense": {"kernel": jnp.array([[1.0, -2.0, 0.5], [0.25, 3.0, -1.0]]),
                    "bias": jnp.array([0.3, -0.1, 0.2])}}


def grads(step):
  rng = np.random.default_rng(100 + step)
  return {"dense": {"kernel": jnp.asarray(rng.normal(size=(2, 3)), jnp.float32),
                    "bias": jnp.asarray(rng.normal(size=(3,)), jnp.float32)}}


def run(tx, steps, params=None, grad_fn=grads):
  """``steps`` updates; returns (params after each step, updates, final state)."""
  params = tiny_params() if params is None else params
  state = tx.init(params)
  history, updates_seen = [], []
  for t in range(steps):
    updates, state = tx.update(grad_fn(t), state, params)
    params = optax.apply_updates(params, updates)
    history.append(params)
    updates_seen.append(updates)
  return history, updates_seen, state


def np_tree(tree):
  return jax.tree.map(lambda x: np.asarray(x, np.float64), tree)


def decay_mask(tree):
  return {"dense": {"kernel": 1.0, "bias": 0.0}}


def tmap(f, *trees):
  return jax.tree.map(f, *trees)


def close(a, b, rtol=2e-5, atol=2e-6):
  chex.assert_trees_all_close(np_tree(a), np_tree(b), rtol=rtol, atol=atol)


# ----------------------------------------------------------------------------
# Delays and names.
# ----------------------------------------------------------------------------

def test_stage_delays_and_updates():
  assert delays.stage_delays(4) == [6, 4, 2, 0]
  assert delays.stage_delays(2, [0, 0]) == [0, 0]
  assert delays.delay_in_updates(6, 4) == 1.5
  assert delays.delay_in_updates(0, 3) == 0.0
  # The mean over an update's k micro-batches of floor((tau + k - 1 - i) / k) is tau / k.
  for tau in range(0, 9):
    for k in (1, 2, 3, 4):
      mean = np.mean([(tau + k - 1 - i) // k for i in range(k)])
      assert mean == pytest.approx(delays.delay_in_updates(tau, k))
  with pytest.raises(ValueError):
    delays.stage_delays(4, [6, 4, 2])
  with pytest.raises(ValueError):
    delays.delay_in_updates(2, 0)


def test_parse_name():
  assert comp.parse_name("spike+weight_prediction") == ("spike", "weight_prediction")
  assert comp.parse_name("none") == ("none",)
  for bad in ("spikes", "none+spike", "lr_scale+pipemare", "spike+spike"):
    with pytest.raises(ValueError):
      comp.parse_name(bad)


# ----------------------------------------------------------------------------
# "none" and delay 0: the plain optimizer, bit for bit.
# ----------------------------------------------------------------------------

@pytest.mark.parametrize("k", [1, 2])
def test_none_is_make_optimizer(k):
  c = make_config(k=k, schedule="step", warmup_epochs=0.5)
  plain = run(optim.make_optimizer(c, SPE), 3 * k)
  for kw in ({"name": "none"}, {}):  # explicit, and the default name
    got = run(comp.make_compensated_optimizer(c, SPE, delay_ticks=6, **kw), 3 * k)
    chex.assert_trees_all_equal(got[0], plain[0])
    chex.assert_trees_all_equal(got[2], plain[2])
  assert comp.make_predictor(c, SPE, name="none", delay_ticks=6) is None


NAMES_AT_ZERO = ["lr_scale", "pipemare", "spike", "weight_prediction", "nesterov_lookahead",
                 "spike+weight_prediction+pipemare", "nesterov_lookahead+lr_scale"]


@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("name", NAMES_AT_ZERO)
def test_delay_zero_is_plain_sgd_nesterov(name, k):
  c = make_config(k=k, schedule="step", warmup_epochs=0.5)
  plain, _, _ = run(optim.make_optimizer(c, SPE), 3 * k)
  tx = comp.make_compensated_optimizer(c, SPE, name=name, delay_ticks=0, max_delay_ticks=6)
  got, _, state = run(tx, 3 * k)
  chex.assert_trees_all_equal(got, plain)
  assert comp.make_predictor(c, SPE, name=name, delay_ticks=0) is None
  # A zero horizon predicts the weights themselves.
  chex.assert_trees_all_equal(prediction.predict_params(got[-1], state, 0, LR), got[-1])


def test_last_stage_is_plain():
  c = make_config()
  txs = comp.stage_optimizers(c, SPE, 4, name="spike+pipemare")
  preds = comp.stage_predictors(c, SPE, 4, name="spike+weight_prediction")
  assert len(txs) == len(preds) == 4
  assert preds[-1] is None and all(p is not None for p in preds[:-1])
  chex.assert_trees_all_equal(run(txs[-1], 3)[0], run(optim.make_optimizer(c, SPE), 3)[0])
  # Methods without delay: zeros make every stage plain.
  assert all(p is None for p in comp.stage_predictors(
      c, SPE, 4, delays_ticks=[0] * 4, name="weight_prediction"))


# ----------------------------------------------------------------------------
# (a) Learning-rate scaling (PipeMare T1).
# ----------------------------------------------------------------------------

def _update_ratio(c, name, delay_ticks, steps, **params):
  """Compensated over plain updates (no weight decay: updates do not depend
  on the params, so both see the same directions)."""
  _, base_u, _ = run(optim.make_optimizer(c, SPE), steps)
  _, comp_u, _ = run(comp.make_compensated_optimizer(c, SPE, name=name,
                                                     delay_ticks=delay_ticks, **params), steps)
  return base_u, comp_u


def test_lr_scale_formula():
  c = make_config(weight_decay=0.0, k=2)
  # tau = 6 ticks, k = 2 -> D = 3 updates: eta_j = eta * 3 ** -0.5.
  base_u, comp_u = _update_ratio(c, "lr_scale", 6, 6, lr_power=0.5)
  for b, u in zip(base_u, comp_u):
    close(u, tmap(lambda x: x * 3.0 ** -0.5, b), rtol=1e-6, atol=0)
  # D = 1 / 2 < 1: no scaling (max(D, 1) = 1), bit for bit.
  base_u, comp_u = _update_ratio(c, "lr_scale", 1, 4)
  chex.assert_trees_all_equal(comp_u, base_u)
  assert lr_scaling.delay_lr_factor(3.0, 0.5) == pytest.approx(3.0 ** -0.5)
  assert lr_scaling.delay_lr_factor(0.0, 1.0) == 1.0


def test_pipemare_warmup_formula():
  # K = pipemare_warmup_epochs * SPE = 4 updates; D = 4: factor 4 ** -(1 - min(n / 4, 1)).
  c = make_config(weight_decay=0.0, pipemare_warmup_epochs=1.0)
  base_u, comp_u = _update_ratio(c, "pipemare", 4, 6)
  for n, (b, u) in enumerate(zip(base_u, comp_u)):
    factor = 4.0 ** -(1.0 - min(n / 4.0, 1.0))
    close(u, tmap(lambda x: x * factor, b), rtol=1e-6, atol=0)
  # Counted in updates inside MultiSteps (k = 2): factor changes every 2 micro-batches.
  c2 = make_config(weight_decay=0.0, k=2, pipemare_warmup_epochs=1.0)
  base_u, comp_u = _update_ratio(c2, "pipemare", 8, 8)  # D = 8 / 2 = 4
  for t, (b, u) in enumerate(zip(base_u, comp_u)):
    n = t // 2  # updates done before this one
    factor = 4.0 ** -(1.0 - min(n / 4.0, 1.0))
    close(u, tmap(lambda x: x * factor, b), rtol=1e-6, atol=0)


# ----------------------------------------------------------------------------
# (b) Spike compensation (Kosson et al., 2021, Sec. 4.1).
# ----------------------------------------------------------------------------

def hand_sgd(steps, delay, momentum=0.9, nesterov=True, wd=5e-4, lr=LR, k=1, spike=True,
             grad_fn=grads, params=None):
  """Momentum SGD (PyTorch semantics, optax's trace) with spike compensation,
  written from the equations; ``k`` micro-batches averaged per update.
  Returns (params after every micro-batch, velocity)."""
  w = np_tree(tiny_params() if params is None else params)
  v = tmap(np.zeros_like, w)
  mask = decay_mask(w) if params is None else tmap(lambda _: 0.0, w)
  a, b = ((1 - momentum ** delay) / (1 - momentum), momentum ** delay) if spike else (0.0, 1.0)
  acc, history = tmap(np.zeros_like, w), []
  for t in range(steps):
    acc = tmap(lambda s, g: s + g, acc, np_tree(grad_fn(t)))
    if (t + 1) % k == 0:
      g = tmap(lambda s, x, m: s / k + wd * m * x, acc, w, mask)   # d = g + wd theta
      v = tmap(lambda vv, gg: momentum * vv + gg, v, g)             # v = m v + d
      d = tmap(lambda gg, vv: gg + momentum * vv, g, v) if nesterov else v
      w = tmap(lambda x, gg, dd: x - lr * (a * gg + b * dd), w, g, d)
      acc = tmap(np.zeros_like, w)
    history.append(w)
  return history, v


@pytest.mark.parametrize("nesterov", [True, False])
def test_spike_matches_hand_computation(nesterov):
  c = make_config(nesterov=nesterov)
  # tau = 3 ticks, k = 1: D = 3.
  got, _, _ = run(comp.make_compensated_optimizer(c, SPE, name="spike", delay_ticks=3), 5)
  want, _ = hand_sgd(5, 3, nesterov=nesterov)
  for g, w in zip(got, want):
    close(g, w)
  # Not the plain optimizer.
  plain, _, _ = run(optim.make_optimizer(c, SPE), 5)
  assert not np.allclose(plain[-1]["dense"]["kernel"], got[-1]["dense"]["kernel"])


def test_spike_coefficients_and_impulse_response():
  m, delay = 0.9, 2
  a, b = momentum_lib.spike_coefficients(m, delay)
  assert a == pytest.approx((1 - m ** 2) / (1 - m)) and b == pytest.approx(m ** 2)
  assert momentum_lib.spike_coefficients(m, 0) == (0.0, 1.0)
  # A unit gradient then zeros, lr 1, no decay. On time, Nesterov momentum moves
  # the weight by c_0 = 1 + m, then c_i = m ** (i + 1). Arriving D late, the
  # compensated step is c_0 + ... + c_D, then c_{D+i}: the same total 1 / (1 - m).
  c = make_config(weight_decay=0.0)
  c.optim.learning_rate = 1.0
  params = {"w": jnp.zeros(1)}
  unit = lambda t: {"w": jnp.ones(1) if t == 0 else jnp.zeros(1)}  # noqa: E731
  _, moves, _ = run(comp.make_compensated_optimizer(c, SPE, name="spike", delay_ticks=delay),
                    12, params=params, grad_fn=unit)
  moves = np.array([-float(u["w"][0]) for u in moves])
  on_time = np.array([1 + m] + [m ** (i + 1) for i in range(1, 40)])
  np.testing.assert_allclose(moves[0], on_time[:delay + 1].sum(), rtol=1e-6)
  np.testing.assert_allclose(moves[1:], on_time[delay + 1:delay + 12], rtol=1e-5)
  # Heavy ball: c_i = m ** i.
  c.optim.nesterov = False
  _, moves, _ = run(comp.make_compensated_optimizer(c, SPE, name="spike", delay_ticks=delay),
                    12, params=params, grad_fn=unit)
  moves = np.array([-float(u["w"][0]) for u in moves])
  on_time = m ** np.arange(40)
  np.testing.assert_allclose(moves[0], on_time[:delay + 1].sum(), rtol=1e-6)
  np.testing.assert_allclose(moves[1:], on_time[delay + 1:delay + 12], rtol=1e-5)


def test_spike_with_multisteps_k2():
  # tau = 4 ticks, k = 2: D = 2 updates; updates every second micro-batch.
  c = make_config(k=2)
  tx = comp.make_compensated_optimizer(c, SPE, name="spike", delay_ticks=4)
  assert isinstance(tx, optax.MultiSteps)
  got, updates, state = run(tx, 8)
  want, _ = hand_sgd(8, 2.0, k=2)
  for g, w in zip(got, want):
    close(g, w)
  for t in (0, 2, 4, 6):  # accumulation micro-batches: zero updates
    chex.assert_trees_all_equal(updates[t], tmap(jnp.zeros_like, updates[t]))
  # Everything is in the optax state (checkpointable arrays).
  assert all(isinstance(x, jax.Array) for x in jax.tree.leaves(state))


# ----------------------------------------------------------------------------
# (c) Linear weight prediction (Kosson et al., 2021, Sec. 4.2).
# ----------------------------------------------------------------------------

@pytest.mark.parametrize("k,delay_ticks,steps", [(1, 4, 3), (2, 6, 6), (2, 6, 7)])
def test_weight_prediction_matches_hand_computation(k, delay_ticks, steps):
  # Warm-up over 1 epoch = 4 updates: the rate of the next update depends on the count.
  c = make_config(k=k, schedule="constant", warmup_epochs=1.0)
  tx = comp.make_compensated_optimizer(c, SPE, name="weight_prediction", delay_ticks=delay_ticks)
  predictor = comp.make_predictor(c, SPE, name="weight_prediction", delay_ticks=delay_ticks)
  hist, _, state = run(tx, steps)
  # The optimizer itself is the plain one.
  chex.assert_trees_all_equal(hist, run(optim.make_optimizer(c, SPE), steps)[0])
  # Hand: SGD-Nesterov with the warm-up rate lr * n / 4 at update n.
  w = np_tree(tiny_params())
  v = tmap(np.zeros_like, w)
  acc, n = tmap(np.zeros_like, w), 0
  for t in range(steps):
    acc = tmap(lambda s, g: s + g, acc, np_tree(grads(t)))
    if (t + 1) % k == 0:
      g = tmap(lambda s, x, m: s / k + 5e-4 * m * x, acc, w, decay_mask(w))
      v = tmap(lambda vv, gg: 0.9 * vv + gg, v, g)
      w = tmap(lambda x, gg, vv: x - LR * n / 4 * (gg + 0.9 * vv), w, g, v)
      acc, n = tmap(np.zeros_like, w), n + 1
  close(hist[-1], w)
  delay = delay_ticks / k
  predicted = tmap(lambda x, vv: x - (LR * n / 4) * delay * vv, w, v)  # w - eta D v
  close(predictor(hist[-1], state), predicted)
  close(jax.jit(predictor)(hist[-1], state), predicted)  # the engine jits it
  close(prediction.find_velocity(state), v)


def test_predict_params_through_wrappers():
  # MultiSteps(chain(decay, inject_hyperparams(sgd))): the velocity is nested
  # three deep and the rate is an injected hyperparameter.
  tx = optax.MultiSteps(optax.chain(
      optax.add_decayed_weights(1e-3),
      optax.inject_hyperparams(optax.sgd)(learning_rate=0.05, momentum=0.9, nesterov=True)),
      every_k_schedule=2)
  hist, _, state = run(tx, 4)
  trace = state.inner_opt_state[1].inner_state[0].trace
  want = tmap(lambda w, v: np.float64(w) - 0.05 * 2.5 * np.float64(v), hist[-1], trace)
  close(prediction.predict_params(hist[-1], state, 2.5), want)
  # A fixed rate, and a horizon scale.
  close(prediction.predict_params(hist[-1], state, 2.5, 0.05), want)
  close(prediction.predict_params(hist[-1], state, 1.25, 0.05, scale=2.0), want)
  # A traced delay (e.g. per micro-batch).
  close(jax.jit(prediction.predict_params)(hist[-1], state, jnp.float32(2.5)), want)


def test_predict_params_errors():
  params = tiny_params()
  with pytest.raises(ValueError, match="TraceState"):
    prediction.predict_params(params, optax.adam(1e-3).init(params), 2.0, 1e-3)
  two = optax.chain(optax.trace(0.9), optax.trace(0.5)).init(params)
  with pytest.raises(ValueError, match="Several"):
    prediction.predict_params(params, two, 2.0, 0.1)
  with pytest.raises(ValueError, match="learning_rate"):
    prediction.predict_params(params, optax.sgd(0.1, momentum=0.9).init(params), 2.0)
  with pytest.raises(ValueError):
    comp.make_compensated_optimizer(make_config(name="adam"), SPE, name="spike", delay_ticks=2)
  with pytest.raises(ValueError):
    comp.make_predictor(make_config(momentum=0.0), SPE, name="weight_prediction", delay_ticks=2)


# ----------------------------------------------------------------------------
# (d) Nesterov look-ahead for asynchronous pipelines (Ajanthan et al., 2025).
# ----------------------------------------------------------------------------

def test_lookahead_momentum():
  assert momentum_lib.lookahead_momentum(0.9, 0.99, 0.0, 8.0) == 0.9
  assert momentum_lib.lookahead_momentum(0.9, 0.99, 4.0, 8.0) == pytest.approx(0.945)
  assert momentum_lib.lookahead_momentum(0.9, 0.99, 8.0, 8.0) == pytest.approx(0.99)
  assert momentum_lib.lookahead_momentum(0.9, 0.99, 16.0, 8.0) == pytest.approx(0.99)


@pytest.mark.parametrize("k", [1, 2])
def test_nesterov_lookahead_matches_paper_equations(k):
  """The paper's update in its own (Sutskever) form::

    d_t = gamma (w_t - w_{t-1});  w_{t+1} = w_t + d_t - eta' (1 - gamma) g_t

  with ``g_t`` the gradient at the look-ahead point ``w_t + d_t`` (with its
  weight decay there) and ``eta' = eta / (1 - m)`` (our normalisation). The
  optax params are those look-ahead points."""
  c = make_config(k=k)
  # tau = 4 k ticks (D = 4), the pipeline's largest 8 k (D_ref = 8): gamma = 0.945.
  tx = comp.make_compensated_optimizer(c, SPE, name="nesterov_lookahead", delay_ticks=4 * k,
                                       max_delay_ticks=8 * k)
  steps = 5 * k
  hist, _, _ = run(tx, steps)
  gamma, eta = 0.945, LR / (1 - 0.9)
  w = w_prev = np_tree(tiny_params())
  acc = tmap(np.zeros_like, w)
  for t in range(steps):
    acc = tmap(lambda s, g: s + g, acc, np_tree(grads(t)))
    if (t + 1) % k == 0:
      d = tmap(lambda x, y: gamma * (x - y), w, w_prev)
      look = tmap(lambda x, dd: x + dd, w, d)
      g = tmap(lambda s, x, m: s / k + 5e-4 * m * x, acc, look, decay_mask(w))
      w, w_prev = tmap(lambda x, dd, gg: x + dd - eta * (1 - gamma) * gg, w, d, g), w
      acc = tmap(np.zeros_like, w)
      look = tmap(lambda x, y: x + gamma * (x - y), w, w_prev)
      close(hist[t], look)
  with pytest.raises(ValueError):
    comp.make_compensated_optimizer(make_config(nesterov=False), SPE,
                                    name="nesterov_lookahead", delay_ticks=2)
