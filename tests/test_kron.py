"""PSGD Kron (``optim.name="kron"``, issue 35's Shampoo-style optimizer): the step against a
float64 NumPy transcription of the module's equations where the preconditioner is the identity,
with k = 2 (``optax.MultiSteps``); the optimizer the config builds (preconditioner fitted with
the package's annealed probability) against the package's own, bit for bit."""

import jax
import numpy as np
import pytest
from helpers import run_optimizer

pytest.importorskip("psgdax")

from petra_jax import optim  # noqa: E402
from petra_jax.optim import compensation as comp  # noqa: E402
from petra_jax.optim.kron import kron  # noqa: E402

SPE, LR, WD, B1 = 4, 1e-2, 0.05, 0.9


def make_config(k=1):
  from petra_jax import config as config_lib  # pylint: disable=g-import-not-at-top
  c = config_lib.get_config()
  c.accumulation_steps, c.num_epochs = k, 10
  o = c.optim
  o.name, o.learning_rate, o.weight_decay, o.schedule, o.warmup_epochs, o.adam_b1 = \
      "kron", LR, WD, "constant", 1.0, B1
  return c


def params0():
  rng = np.random.default_rng(0)
  return {"dense": {"kernel": rng.normal(size=(6, 4)), "bias": rng.normal(size=(4,))}}


def grad_seq(n, scale=1.0):
  rng = np.random.default_rng(1)
  return [jax.tree.map(lambda a: scale * rng.normal(size=a.shape), params0()) for _ in range(n)]


def run(tx, gs):
  return run_optimizer(tx, gs, params0())[0]


def np_kron_identity(gs):
  """Float64: mu_t = b_t mu + (1 - b_t) g, b_t = min(t / (1 + t), b1) (t from 0); the step
  mu / max(1, rms(mu)) per leaf (Q = I); w <- w - lr_t (step + wd w) on kernels, lr_t the
  warm-up from 0 over SPE updates."""
  p, mu, out = params0(), None, []
  for t, g in enumerate(gs):
    b = min(t / (1 + t), B1)
    mu = g if mu is None else jax.tree.map(lambda m, g: b * m + (1 - b) * g, mu, g)
    lr = LR * min(t / SPE, 1.0)
    p = jax.tree_util.tree_map_with_path(
        lambda path, w, m: w - lr * (m / max(1.0, np.sqrt(np.mean(m * m)))
                                     + (WD * w if path[-1].key == "kernel" else 0.0)), p, mu)
    out.append(p)
  return out


@pytest.mark.parametrize("scale", [0.1, 10.0])  # below and above the RMS clip
def test_identity_preconditioner_step_with_k2(scale):
  """p_t = 0 and factors of scale 1: the step is the clipped momentum, on the k = 2 means."""
  c = make_config(k=2)
  schedule = optim.learning_rate_schedule(c, SPE)
  tx = optim.accumulate(kron(schedule, b1=B1, weight_decay=WD, decay_mask=optim.kernel_mask,
                             update_probability=0.0, init_scale=1.0), 2)
  gs = grad_seq(8, scale)
  means = [jax.tree.map(lambda a, b: (a + b) / 2, gs[i], gs[i + 1]) for i in range(0, 8, 2)]
  got = run(tx, gs)[1::2]
  jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), b, rtol=1e-5, atol=1e-6),
               got, np_kron_identity(means))


def test_config_builds_the_package_optimizer():
  """optim.name="kron": the package's kron with the schedule, b1, wd on kernels, bit for bit."""
  import psgdax  # pylint: disable=g-import-not-at-top
  c = make_config(k=1)
  gs = grad_seq(6)
  want = run(psgdax.kron(learning_rate=optim.learning_rate_schedule(c, SPE), b1=B1,
                         weight_decay=WD, weight_decay_mask=optim.kernel_mask), gs)
  got = run(optim.make_optimizer(c, SPE), gs)
  jax.tree.map(np.testing.assert_array_equal, got, want)
  got_none = run(comp.make_compensated_optimizer(c, SPE, name="update_prediction",
                                                 delay_ticks=0), gs)
  jax.tree.map(np.testing.assert_array_equal, got_none, want)

