"""Delay-robust optimizers (petra_jax.optim.adam_delay, petra_jax.optim.muon)
against float64 NumPy transcriptions of their equations, and bit for bit
against the plain optimizer at delay 0."""

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest
from helpers import gradient_sequence, tree_params

from petra_jax import optim
from petra_jax.optim import compensation as comp

SPE, LR, WD, B1, B2, EPS = 4, 1e-2, 0.05, 0.9, 0.999, 1e-8
MUON_LR, MUON_BETA = 0.02, 0.95
NEW = ["adam_prediction", "adam_lookahead", "adam_momentum", "error_feedback",
       "adam_prediction+adam_lookahead+error_feedback"]


def make_config(name="adam", k=1, **compensation):
  c = ml_collections.ConfigDict()
  c.batch_size, c.num_epochs, c.accumulation_steps = 128, 10, k
  c.optim = ml_collections.ConfigDict(dict(
      name=name, learning_rate=LR, momentum=0.9, nesterov=True, weight_decay=WD,
      schedule="constant", warmup_epochs=1.0, decay_epochs=(2,), decay_factor=0.1,
      end_learning_rate=0.0, polynomial_power=2.0, trust_coefficient=0.02, lars_eps=1e-8,
      adam_b1=B1, adam_b2=B2, adam_eps=EPS, muon_learning_rate=MUON_LR,
      muon_momentum=MUON_BETA))
  c.compensation = comp.defaults()
  for key, value in compensation.items():
    c.compensation[key] = value
  return c


def lr_at(n):
  """The schedule: linear warm-up from 0 over SPE updates, then LR."""
  return LR * min(n / SPE, 1.0)


def f32(tree):
  return jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), tree)


def is_kernel(path):
  return path[-1].key == "kernel"


def run(tx, gs):
  """Applies ``tx`` to the gradients ``gs``; the params after each update and the state."""
  p = f32(tree_params())
  state, out = tx.init(p), []
  for g in gs:
    u, state = tx.update(f32(g), state, p)
    p = optax.apply_updates(p, u)
    out.append(p)
  return out, state


def np_adamw(gs, b1=B1, nesterov=False, feedback=0.0):
  """Float64 AdamW (Loshchilov & Hutter, 2019; NAdam's first moment, Dozat 2016,
  with ``nesterov``; error feedback ``u_t + h (u_t - u_{t-1})``, ``u_{-1} = u_0``):
  per update the params, the step and the moments."""
  p, m, v = tree_params(), *(jax.tree.map(np.zeros_like, tree_params()) for _ in range(2))
  out, prev = [], None
  for t, g in enumerate(gs, start=1):
    m = jax.tree.map(lambda m, g: b1 * m + (1 - b1) * g, m, g)
    v = jax.tree.map(lambda v, g: B2 * v + (1 - B2) * g * g, v, g)
    if nesterov:
      mh = jax.tree.map(lambda m, g: b1 * m / (1 - b1 ** (t + 1)) + (1 - b1) * g / (1 - b1 ** t),
                        m, g)
    else:
      mh = jax.tree.map(lambda m: m / (1 - b1 ** t), m)
    step = jax.tree_util.tree_map_with_path(
        lambda path, w, mh, v: -lr_at(t - 1) * (mh / (np.sqrt(v / (1 - B2 ** t)) + EPS)
                                                + (WD * w if is_kernel(path) else 0.0)),
        p, mh, v)
    prev, step = step, jax.tree.map(lambda u, q: u + feedback * (u - q), step,
                                    step if prev is None else prev)
    p = jax.tree.map(np.add, p, step)
    out.append((p, step, m, v))
  return out


def assert_close(got, want, rtol, atol=0.0):
  jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), b, rtol=rtol, atol=atol),
               got, want)


@pytest.mark.parametrize("name", NEW)
def test_delay_zero_is_the_plain_optimizer_bit_for_bit(name):
  c = make_config(k=2)
  gs = gradient_sequence(8)
  want, _ = run(optim.make_optimizer(c, SPE), gs)
  got, _ = run(comp.make_compensated_optimizer(c, SPE, name=name, delay_ticks=0), gs)
  jax.tree.map(np.testing.assert_array_equal, got, want)
  assert comp.make_predictor(c, SPE, name=name, delay_ticks=0) is None


def test_muon_error_feedback_at_delay_zero_is_muon_bit_for_bit():
  c = make_config("muon")
  gs = gradient_sequence(5)
  want, _ = run(optim.make_optimizer(c, SPE), gs)
  got, _ = run(comp.make_compensated_optimizer(c, SPE, name="error_feedback", delay_ticks=0), gs)
  jax.tree.map(np.testing.assert_array_equal, got, want)


def test_plain_adam_transcription_holds():
  """The NumPy AdamW below is optim.make_optimizer's ``adam`` (the base of the others)."""
  gs = gradient_sequence(6)
  got, _ = run(optim.make_optimizer(make_config(), SPE), gs)
  assert_close(got[-1], np_adamw(gs)[-1][0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("scale", [1.0, 0.5])
def test_adam_prediction_is_pipeoptim(scale):
  """w_hat = w - eta_N (s D) (m_hat / (sqrt(v_hat) + eps) + wd w), D = tau / k = 4 / 2."""
  c = make_config(k=2, prediction_scale=scale)
  gs = gradient_sequence(10)
  tx = comp.make_compensated_optimizer(c, SPE, name="adam_prediction", delay_ticks=4)
  got_p, state = run(tx, gs)
  pred = comp.make_predictor(c, SPE, name="adam_prediction", delay_ticks=4)
  ref = np_adamw([jax.tree.map(lambda a, b: (a + b) / 2, *gs[i:i + 2]) for i in (0, 2, 4, 6, 8)])
  p, _, m, v = ref[-1]
  n = len(ref)
  want = jax.tree_util.tree_map_with_path(
      lambda path, w, m, v: w - lr_at(n) * scale * 2.0 * (
          m / (1 - B1 ** n) / (np.sqrt(v / (1 - B2 ** n)) + EPS)
          + (WD * w if is_kernel(path) else 0.0)), p, m, v)
  assert_close(pred(got_p[-1], state), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name,nesterov", [("adam_lookahead", True), ("adam_momentum", False)])
def test_lookahead_adam_is_nadam_with_delay_grown_beta1(name, nesterov):
  """Ajanthan et al. (2025): the delayed stage's b1 = gamma(D) = b1 + (0.99 - b1) D / D_ref
  (D = 2, D_ref = 3 updates), NAdam's first moment for adam_lookahead."""
  gs = gradient_sequence(6)
  tx = comp.make_compensated_optimizer(make_config(), SPE, name=name, delay_ticks=2,
                                       max_delay_ticks=3)
  got, _ = run(tx, gs)
  gamma = B1 + (0.99 - B1) * 2 / 3
  assert_close(got[-1], np_adamw(gs, b1=gamma, nesterov=nesterov)[-1][0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("scale", [1.0, 0.5])
def test_error_feedback_feeds_back_the_stale_update(scale):
  """applied_t = u_t + h (u_t - u_{t-1}), applied_0 = u_0; h = scale * D, D = 3."""
  gs = gradient_sequence(6)
  tx = comp.make_compensated_optimizer(make_config(prediction_scale=scale), SPE,
                                       name="error_feedback", delay_ticks=3)
  got, _ = run(tx, gs)
  for t, (p, _, _, _) in enumerate(np_adamw(gs, feedback=3.0 * scale)):
    assert_close(got[t], p, rtol=1e-5, atol=1e-6)


def np_newton_schulz(x, steps=5, coeffs=(3.4445, -4.775, 2.0315), eps=1e-8):
  transposed = x.shape[0] > x.shape[1]
  x = x.T if transposed else x
  x = x / (np.linalg.norm(x) + eps)
  a, b, c = coeffs
  for _ in range(steps):
    s = x @ x.T
    x = a * x + (b * s + c * s @ s) @ x
  return x.T if transposed else x


def test_muon_matrices_and_adamw_rest():
  """Muon (Jordan et al., 2024) on the kernels, the 3-D query kernel as a 4 x 6
  matrix; AdamW on the bias and the norm's scale (no weight decay there)."""
  gs = gradient_sequence(4)
  got, _ = run(optim.make_optimizer(make_config("muon"), SPE), gs)
  ref = np_adamw(gs)[-1][0]  # the bias and scale leaves
  p = tree_params()
  mom = jax.tree.map(np.zeros_like, p)
  for t, g in enumerate(gs, start=1):
    for key in ("attn", "dense"):
      sub = p[key]["query"] if key == "attn" else p[key]
      gk = (g[key]["query"] if key == "attn" else g[key])["kernel"]
      mk = mom[key]["query"] if key == "attn" else mom[key]
      w = sub["kernel"]
      mk["kernel"] = MUON_BETA * mk["kernel"] + (1 - MUON_BETA) * gk
      mbar = (MUON_BETA * mk["kernel"] / (1 - MUON_BETA ** (t + 1))
              + (1 - MUON_BETA) * gk / (1 - MUON_BETA ** t))
      mat = mbar.reshape(w.shape[0], -1)
      o = np_newton_schulz(mat) * max(1.0, mat.shape[1] / mat.shape[0]) ** 0.5
      sub["kernel"] = w - MUON_LR * min((t - 1) / SPE, 1.0) * (o.reshape(w.shape) + WD * w)
  p["dense"]["bias"], p["norm"]["scale"] = ref["dense"]["bias"], ref["norm"]["scale"]
  assert_close(got[-1], p, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name,opt", [("adam_prediction", "sgd"), ("adam_lookahead", "muon"),
                                      ("spike", "adam")])
def test_compensation_needs_its_optimizer(name, opt):
  with pytest.raises(ValueError, match="needs"):
    comp.make_compensated_optimizer(make_config(opt), SPE, name=name, delay_ticks=2)


@pytest.mark.parametrize("name", ["weight_prediction+adam_prediction",
                                  "adam_lookahead+adam_momentum"])
def test_exclusive_pairs(name):
  with pytest.raises(ValueError, match="Choose one of"):
    comp.parse_name(name)


@pytest.mark.parametrize("opt,name", [("adam", "adam_prediction+adam_lookahead+error_feedback"),
                                      ("muon", "error_feedback")])
def test_petra_trains_a_revvit_with_them(opt, name):
  """The training assembly on a 4-stage RevViT (delays 6, 4, 2, 0 ticks, k = 2):
  the config validates, the predictors are the delayed stages', losses are finite."""
  from helpers import batches_of, run_ticks  # pylint: disable=g-import-not-at-top

  from petra_jax import config as config_lib  # pylint: disable=g-import-not-at-top
  from petra_jax.training import assembly, validation  # pylint: disable=g-import-not-at-top
  c = config_lib.get_config()
  c.model.name, c.model.width, c.model.depth, c.model.patch_size = "revvit_tiny", 2, 1, 4
  c.model.stage_sizes, c.batch_size, c.num_epochs = (1, 1, 1, 1), 16, 1
  c.optim.name, c.optim.learning_rate, c.optim.schedule = opt, 1e-3, "cosine"
  c.optim.warmup_epochs, c.compensation.name = 0.5, name
  validation.validate_config(c, 1)
  pipe, _, _ = assembly.build_pipeline(c, "/nonexistent", assembly.data_lib.DATASETS["cifar10"],
                                       8, steps_per_epoch=10)
  assert [p is not None for p in comp.stage_predictors(c, 10, 4)] == (
      [True, True, True, False] if "prediction" in name else [False] * 4)
  state = pipe.init(0, batches_of()(0)[0])
  state, out = run_ticks(pipe, state, 12, batches_of())
  assert len(out) == 12 and np.isfinite([float(o.loss) for o in out]).all()


def test_config_check_names_the_optimizer_a_compensation_needs():
  from petra_jax import config as config_lib  # pylint: disable=g-import-not-at-top
  from petra_jax.training import validation  # pylint: disable=g-import-not-at-top
  c = config_lib.get_config()
  c.compensation.name = "adam_prediction"
  with pytest.raises(validation.ConfigError, match="optim.name='adam'.*compensation.name"):
    validation.validate_config(c, 1)
  c.optim.name, c.optim.muon_momentum = "muon", 1.0
  c.compensation.name = "error_feedback"
  with pytest.raises(validation.ConfigError, match="optim.muon_momentum"):
    validation.validate_config(c, 1)
