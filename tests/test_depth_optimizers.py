"""The optimizers that scale with the delay (issue 35, item 3) against float64 NumPy
transcriptions of their papers' equations, with k > 1 (``optax.MultiSteps``) and
per-stage hyper-parameters; and bit for bit the plain optimizer at delay 0."""

import jax
import numpy as np
import pytest
from helpers import gradient_sequence, run_optimizer, tree_params

from petra_jax import optim
from petra_jax.optim import compensation as comp
from petra_jax.optim import momentum

SPE, LR, WD, B1, B2, EPS = 4, 1e-2, 0.05, 0.9, 0.999, 1e-8
MUON_LR, MUON_BETA = 0.02, 0.95


def make_config(opt="adam", k=1, **compensation):
  from petra_jax import config as config_lib  # pylint: disable=g-import-not-at-top
  c = config_lib.get_config()
  c.accumulation_steps, c.num_epochs = k, 10
  o = c.optim
  o.name, o.learning_rate, o.weight_decay, o.schedule, o.warmup_epochs = opt, LR, WD, \
      "constant", 1.0
  o.adam_b1, o.adam_b2, o.adam_eps, o.muon_learning_rate, o.muon_momentum = B1, B2, EPS, \
      MUON_LR, MUON_BETA
  for key, value in compensation.items():
    c.compensation[key] = value
  return c


def lr_at(n):
  """The schedule at update count n: warm-up from 0 over SPE updates, then LR."""
  return LR * min(n / SPE, 1.0)


def means(gs, k):
  """MultiSteps' update gradients: the mean of each k consecutive micro-batch gradients."""
  return [jax.tree.map(lambda *a: sum(a) / k, *gs[i:i + k]) for i in range(0, len(gs), k)]


def is_kernel(path):
  return path[-1].key == "kernel"


def run(tx, gs):
  """Applies ``tx`` (jitted) to ``gs`` (float32); the params after each call and the last state."""
  return run_optimizer(tx, gs, tree_params())


def assert_close(got, want, rtol=1e-5, atol=1e-6):
  jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), b, rtol=rtol, atol=atol),
               got, want)


def np_adamw(gs, b1=B1, nesterov=False, lr_factor=1.0):
  """Float64 AdamW (Loshchilov & Hutter), NAdam's first moment with ``nesterov`` (optax's
  form: b1 m_t / (1 - b1^(t+1)) + (1 - b1) g / (1 - b1^t)); params after each update."""
  p, m, v = tree_params(), *(jax.tree.map(np.zeros_like, tree_params()) for _ in range(2))
  out = []
  for t, g in enumerate(gs, start=1):
    m = jax.tree.map(lambda m, g: b1 * m + (1 - b1) * g, m, g)
    v = jax.tree.map(lambda v, g: B2 * v + (1 - B2) * g * g, v, g)
    mh = jax.tree.map((lambda m, g: b1 * m / (1 - b1 ** (t + 1)) + (1 - b1) * g / (1 - b1 ** t))
                      if nesterov else (lambda m, g: m / (1 - b1 ** t)), m, g)
    p = jax.tree_util.tree_map_with_path(
        lambda path, w, mh, v: w - lr_factor * lr_at(t - 1) * (
            mh / (np.sqrt(v / (1 - B2 ** t)) + EPS) + (WD * w if is_kernel(path) else 0.0)),
        p, mh, v)
    out.append(p)
  return out


# -- per-stage look-ahead from each stage's own delay ---------------------------------------


def test_own_delay_momentum_by_hand():
  """1 - (1 - m) / (1 + D), capped at gamma_max, m at D = 0."""
  assert momentum.own_delay_momentum(0.9, 0.99, 0) == 0.9
  assert momentum.own_delay_momentum(0.9, 0.99, 1.0) == pytest.approx(0.95)
  assert momentum.own_delay_momentum(0.9, 0.99, 3.0) == pytest.approx(0.975)
  assert momentum.own_delay_momentum(0.9, 0.99, 20.0) == 0.99
  with pytest.raises(ValueError, match=">= 0"):
    momentum.own_delay_momentum(0.9, 0.99, -1.0)


def test_adam_lookahead_own_delay_per_stage_with_k2():
  """8 stages' delays (14, ..., 2, 0 ticks, k = 2: D_j = 7 - j updates): each stage is NAdam
  with b1_j = min(1 - 0.1 / (1 + D_j), 0.99) on the mean of its 2 micro-batch gradients; the
  last stage (D = 0) is plain AdamW. Never depends on the run's largest delay."""
  c = make_config(k=2, name="adam_lookahead", lookahead_rule="own_delay")
  gs = gradient_sequence(8)
  txs = comp.stage_optimizers(c, SPE, 8)
  for j in (0, 4, 7):  # D = 7, 3, 0
    d = 7 - j
    got, _ = run(txs[j], gs)
    b1 = min(1 - (1 - B1) / (1 + d), 0.99) if d else B1
    want = np_adamw(means(gs, 2), b1=b1, nesterov=d > 0)
    assert_close(got[-1], want[-1])
  alone, _ = run(comp.make_compensated_optimizer(c, SPE, delay_ticks=4, max_delay_ticks=4), gs)
  in_deep_run, _ = run(txs[5], gs)  # 4 ticks in the 8-stage run
  jax.tree.map(np.testing.assert_array_equal, alone[-1], in_deep_run[-1])


def test_run_max_rule_is_kept_as_default():
  """The documented results (the RevNet main job, the ViT recipe) used gamma linear in
  D / D_max: still the default."""
  c = make_config(name="adam_lookahead")
  assert c.compensation.lookahead_rule == "run_max"
  gs = gradient_sequence(4)
  got, _ = run(comp.make_compensated_optimizer(c, SPE, delay_ticks=2, max_delay_ticks=4), gs)
  assert_close(got[-1], np_adamw(gs, b1=B1 + (0.99 - B1) * 0.5, nesterov=True)[-1])
  with pytest.raises(ValueError, match="lookahead_rule"):
    comp.make_compensated_optimizer(make_config(lookahead_rule="max"), SPE, name="adam_lookahead",
                                    delay_ticks=2)


@pytest.mark.parametrize("opt,name,extra", [
    ("adam", "adam_lookahead", {"lookahead_rule": "own_delay"}),
    ("sgd", "nesterov_lookahead", {"lookahead_rule": "own_delay"}),
    ("muon", "update_prediction", {}), ("muon", "error_feedback", {}),
    ("muon", "update_prediction+error_feedback", {}), ("adam", "lr_scale", {})])
def test_delay_zero_is_the_plain_optimizer_bit_for_bit(opt, name, extra):
  c = make_config(opt, k=2, **extra)
  gs = gradient_sequence(8)
  want, _ = run(optim.make_optimizer(c, SPE), gs)
  got, _ = run(comp.make_compensated_optimizer(c, SPE, name=name, delay_ticks=0), gs)
  jax.tree.map(np.testing.assert_array_equal, got, want)
  assert comp.make_predictor(c, SPE, name=name, delay_ticks=0) is None


# -- Ajanthan et al.'s NAdamW ---------------------------------------------------------------


def np_nadamw(gs, b1, psi=0.004, clip=0.0):
  """Float64 NAdam with Dozat's schedule and decoupled decay, as PyTorch's ``NAdam``
  (Ajanthan et al.'s optimizer): mu_t = b1 (1 - 0.5 0.96^(t psi)), P_t = prod mu;
  w <- w - lr ((1-mu_t)/(1-P_t) g + mu_{t+1}/(1-P_t mu_{t+1}) m) / (sqrt(v/(1-b2^t)) + eps)
  - lr wd w; g first clipped to global norm ``clip``."""
  p, m, v = tree_params(), *(jax.tree.map(np.zeros_like, tree_params()) for _ in range(2))
  prod, out = 1.0, []
  for t, g in enumerate(gs, start=1):
    norm = np.sqrt(sum(np.sum(x * x) for x in jax.tree.leaves(g)))
    if clip and norm > clip:
      g = jax.tree.map(lambda x: x * clip / norm, g)
    mu, mu_next = (b1 * (1 - 0.5 * 0.96 ** (s * psi)) for s in (t, t + 1))
    prod *= mu
    m = jax.tree.map(lambda m, g: b1 * m + (1 - b1) * g, m, g)
    v = jax.tree.map(lambda v, g: B2 * v + (1 - B2) * g * g, v, g)
    lr = lr_at(t - 1)
    p = jax.tree_util.tree_map_with_path(
        lambda path, w, g, m, v: w - lr * (
            ((1 - mu) / (1 - prod) * g + mu_next / (1 - prod * mu_next) * m)
            / (np.sqrt(v / (1 - B2 ** t)) + EPS) + (WD * w if is_kernel(path) else 0.0)),
        p, g, m, v)
    out.append(p)
  return out


@pytest.mark.parametrize("k,clip", [(1, 0.0), (2, 1.5)])
def test_nadamw_is_ajanthan_et_al_optimizer(k, clip):
  """optim.name='nadamw', b1 0.99 on the stage, clipping at ``clip`` (it triggers: the
  gradients' global norm is about 5), k micro-batches per update."""
  c = make_config("nadamw", k=k)
  c.optim.adam_b1, c.optim.clip_norm = 0.99, clip
  gs = gradient_sequence(6 * k)
  got, _ = run(optim.make_optimizer(c, SPE), gs)
  want = np_nadamw(means(gs, k), 0.99, clip=clip)
  assert_close(got[k - 1::k], want, rtol=2e-5, atol=2e-6)


# -- Muon: error feedback, weight prediction along its update ---------------------------------


def np_newton_schulz(x, steps=5, coeffs=(3.4445, -4.775, 2.0315), eps=1e-8):
  transposed = x.shape[0] > x.shape[1]
  x = x.T if transposed else x
  x = x / (np.linalg.norm(x) + eps)
  a, b, c = coeffs
  for _ in range(steps):
    s = x @ x.T
    x = a * x + (b * s + c * s @ s) @ x
  return x.T if transposed else x


def np_muon(gs, feedback=0.0, lr_factor=1.0):
  """Float64 Muon (Jordan et al., 2024) on the kernels (the 3-D query kernel a 4 x 6
  matrix), AdamW on the rest, with error feedback applied_t = u_t + h (u_t - u_{t-1})
  (Zmushko et al., 2026; none at t = 1), every step times ``lr_factor`` (a float, or a
  function of the update number t >= 1). The params and the applied updates per update."""
  p = tree_params()
  mom, m, v = {}, {}, {}
  prev, out = None, []
  for t, g in enumerate(gs, start=1):
    u = {}
    for path, w in jax.tree_util.tree_flatten_with_path(p)[0]:
      keys = tuple(x.key for x in path)
      gk = _at(g, keys)
      if keys[-1] == "kernel":
        mk = MUON_BETA * _get(mom, keys) + (1 - MUON_BETA) * gk
        _set(mom, keys, mk)
        mbar = (MUON_BETA * mk / (1 - MUON_BETA ** (t + 1)) + (1 - MUON_BETA) * gk
                / (1 - MUON_BETA ** t))
        mat = mbar.reshape(w.shape[0], -1)
        o = np_newton_schulz(mat) * max(1.0, mat.shape[1] / mat.shape[0]) ** 0.5
        step = -MUON_LR * min((t - 1) / SPE, 1.0) * (o.reshape(w.shape) + WD * w)
      else:
        mt = B1 * _get(m, keys) + (1 - B1) * gk
        vt = B2 * _get(v, keys) + (1 - B2) * gk * gk
        _set(m, keys, mt)
        _set(v, keys, vt)
        step = -lr_at(t - 1) * (mt / (1 - B1 ** t)) / (np.sqrt(vt / (1 - B2 ** t)) + EPS)
      _set(u, keys, step)
    factor = lr_factor(t) if callable(lr_factor) else lr_factor
    u = jax.tree.map(lambda a: factor * a, u)
    applied = u if prev is None else jax.tree.map(lambda a, b: a + feedback * (a - b), u, prev)
    prev = u
    p = jax.tree.map(np.add, p, applied)
    out.append((p, applied))
  return out


def _at(tree, keys):
  for key in keys:
    tree = tree[key]
  return tree


def _get(tree, keys):
  """The leaf at ``keys``, 0 where none was set yet (zero-initialised moments)."""
  for key in keys:
    tree = tree.get(key, {})
  return tree if isinstance(tree, np.ndarray) else 0.0


def _set(tree, keys, value):
  for key in keys[:-1]:
    tree = tree.setdefault(key, {})
  tree[keys[-1]] = value


def test_muon_transcription_holds():
  gs = gradient_sequence(4)
  got, _ = run(optim.make_optimizer(make_config("muon"), SPE), gs)
  assert_close(got[-1], np_muon(gs)[-1][0], rtol=1e-4, atol=1e-5)


def test_muon_error_feedback_with_k2_per_stage():
  """4 stages (6, 4, 2, 0 ticks), k = 2: stage j feeds back h = D_j = (3 - j) times the
  change of its Muon update, on the mean of its micro-batch gradients."""
  c = make_config("muon", k=2, name="error_feedback")
  gs = gradient_sequence(8)
  txs = comp.stage_optimizers(c, SPE, 4)
  for j in (0, 2):
    got, _ = run(txs[j], gs)
    want = np_muon(means(gs, 2), feedback=3.0 - j)
    assert_close(got[1::2], [w for w, _ in want], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("scale", [1.0, 0.5])
def test_update_prediction_with_muon(scale):
  """w_hat = w + (s D) u_t, u_t the last Muon update applied (marin #6431), D = 4 / 2."""
  c = make_config("muon", k=2, name="update_prediction", prediction_scale=scale)
  gs = gradient_sequence(8)
  tx = comp.make_compensated_optimizer(c, SPE, delay_ticks=4)
  got, state = run(tx, gs)
  want = np_muon(means(gs, 2))
  assert_close(got[1::2], [w for w, _ in want], rtol=1e-4, atol=1e-5)  # plain Muon's params
  predict = comp.make_predictor(c, SPE, delay_ticks=4)
  w, u = want[-1]
  assert_close(predict(got[-1], state), jax.tree.map(lambda w, u: w + scale * 2.0 * u, w, u),
               rtol=1e-4, atol=1e-5)


def test_update_prediction_with_a_delay_scaled_muon_rate():
  """lr_scale+update_prediction, p = 1/2, D = 8 / 2 = 4: every Muon step times 4^-1/2, and the
  forward's w_hat = w + D u_t along that scaled step (the update actually applied)."""
  c = make_config("muon", k=2, name="lr_scale+update_prediction", lr_power=0.5)
  gs = gradient_sequence(8)
  tx = comp.make_compensated_optimizer(c, SPE, delay_ticks=8)
  got, state = run(tx, gs)
  want = np_muon(means(gs, 2), lr_factor=0.5)
  assert_close(got[1::2], [w for w, _ in want], rtol=1e-4, atol=1e-5)
  w, u = want[-1]
  assert_close(comp.make_predictor(c, SPE, delay_ticks=8)(got[-1], state),
               jax.tree.map(lambda w, u: w + 4.0 * u, w, u), rtol=1e-4, atol=1e-5)


def test_update_prediction_with_pipemare_annealed_muon_rate():
  """pipemare+update_prediction, K = 1 epoch = 4 updates, D = 8 / 2 = 4: update t's Muon step
  times 4^-(1 - min((t - 1) / K, 1)) (PipeMare's T1, Yang et al., 2021), the prediction along it."""
  c = make_config("muon", k=2, name="pipemare+update_prediction", pipemare_warmup_epochs=1.0)
  gs = gradient_sequence(12)
  tx = comp.make_compensated_optimizer(c, SPE, delay_ticks=8)
  got, state = run(tx, gs)
  want = np_muon(means(gs, 2), lr_factor=lambda t: 4.0 ** -(1.0 - min((t - 1) / SPE, 1.0)))
  assert_close(got[1::2], [w for w, _ in want], rtol=1e-4, atol=1e-5)
  w, u = want[-1]
  assert_close(comp.make_predictor(c, SPE, delay_ticks=8)(got[-1], state),
               jax.tree.map(lambda w, u: w + 4.0 * u, w, u), rtol=1e-4, atol=1e-5)


def test_update_prediction_excludes_the_other_predictions():
  with pytest.raises(ValueError, match="Choose one of"):
    comp.parse_name("update_prediction+adam_prediction")


def test_delay_scaled_learning_rate_per_stage_with_k2():
  """PipeMare's T1 (lr_scale): stage j's rate times max(D_j, 1)^-1, D_j = (6 - 2j) / 2."""
  c = make_config(k=2, name="lr_scale")
  gs = gradient_sequence(8)
  for j, tx in enumerate(comp.stage_optimizers(c, SPE, 4)):
    got, _ = run(tx, gs)
    assert_close(got[1::2], np_adamw(means(gs, 2), lr_factor=1 / max(3.0 - j, 1.0)))


@pytest.mark.parametrize("opt,name,rule", [("muon", "update_prediction", "run_max"),
                                           ("nadamw", "none", "run_max")])
def test_petra_trains_a_revvit_with_them(opt, name, rule):
  """The training assembly on a 4-stage RevViT (delays 6, 4, 2, 0 ticks, k = 2): the config
  validates, the delayed stages get a predictor for update_prediction, and the 12
  micro-batches' losses and final weights equal the independent reference's
  (``tests/reference_loop.py``: PETRA's delays, and for update_prediction its own
  ``w + D_j u`` with ``D_j = 3, 2, 1, 0`` updates), the row's own optimizer step
  (Muon, NAdamW with clipping, cosine schedule with warm-up) as the base."""
  import reference_loop as ref  # pylint: disable=g-import-not-at-top
  from helpers import batches_of, run_ticks  # pylint: disable=g-import-not-at-top

  from petra_jax import config as config_lib  # pylint: disable=g-import-not-at-top
  from petra_jax.training import assembly, validation  # pylint: disable=g-import-not-at-top
  c = config_lib.get_config()
  c.model.name, c.model.width, c.model.depth, c.model.patch_size = "revvit_tiny", 2, 1, 4
  c.model.stage_sizes, c.batch_size, c.num_epochs = (1, 1, 1, 1), 16, 1
  c.optim.name, c.optim.learning_rate, c.optim.schedule = opt, 1e-3, "cosine"
  c.optim.warmup_epochs, c.optim.clip_norm = 0.5, 1.0
  c.compensation.name, c.compensation.lookahead_rule = name, rule
  validation.validate_config(c, 1)
  pipe, _, _ = assembly.build_pipeline(c, "/nonexistent", assembly.data_lib.DATASETS["cifar10"],
                                       8, steps_per_epoch=10)
  predicts = "prediction" in name
  assert [p is not None for p in comp.stage_predictors(c, 10, 4)] == (
      [True, True, True, False] if predicts else [False] * 4)
  state = pipe.init(0, batches_of()(0)[0])
  p0 = [jax.tree.map(np.array, s.params) for s in state.train_states]
  s0 = [jax.tree.map(np.array, s.batch_stats) for s in state.train_states]
  state, out = run_ticks(pipe, state, 12, batches_of())
  got = np.array([float(o.loss) for o in sorted(out)])
  k = c.accumulation_steps
  base = optim.base_optimizer(c, optim.learning_rate_schedule(c, 10))
  comps = [ref.Compensation("last_update" if predicts else "none", 2 * (3 - j) / k)
           for j in range(4)]
  want = ref.run(ref.StageFunctions(pipe.stages), ref.ROWS["petra"], [base] * 4, k, p0, s0,
                 batches_of(), 12, comps)
  np.testing.assert_allclose(got, want.losses, rtol=1e-5)
  # (the attention key bias left out: its gradient cancels in the softmax, so it is round-off,
  # which NAdamW's and Muon's AdamW normalise into +-lr steps: measured 1.4 relative)
  engine_params = [ref.without_key_bias(s.params) for s in state.train_states]
  assert ref.max_rel_diff(engine_params, [ref.without_key_bias(p) for p in want.params]) < 1e-5
  if predicts:  # the prediction moved the trajectory
    plain = ref.run(ref.StageFunctions(pipe.stages), ref.ROWS["petra"], [base] * 4, k, p0, s0,
                    batches_of(), 12)
    assert ref.max_rel_diff(plain.params, want.params) > 1e-4
