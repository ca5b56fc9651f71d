"""Tests for petra_jax.optim (optimizers, schedules, accumulation) and configs/."""

import importlib.util
import math
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from petra_jax.training import validation
from petra_jax import config as config_lib
from petra_jax import optim

from helpers import override

SPE = 10  # optimizer updates per epoch in these tests


def make_config(**overrides):
  """The default config, with ``"optim.x"``-style keys overridden."""
  return override(config_lib.get_config(), **overrides)


def tiny_params():
  """A conv kernel (decayed) and a bias and a BN scale (not decayed)."""
  return {
      "conv": {"kernel": jnp.array([[1.0, -2.0], [0.5, 3.0]]),
               "bias": jnp.array([0.3, -0.1])},
      "bn": {"scale": jnp.array([1.0, 2.0])},
  }


def grads(step):
  rng = np.random.default_rng(step)
  return jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape), jnp.float32),
                      tiny_params())


def run(tx, params, grad_list):
  """Applies ``tx`` to each gradient in turn; returns the final params."""
  state = tx.init(params)
  for g in grad_list:
    updates, state = tx.update(g, state, params)
    params = optax.apply_updates(params, updates)
  return params


def is_kernel(path):
  return path[-1].key == "kernel"


# ---------------------------------------------------------------- SGD


def test_kernel_mask():
  assert optim.kernel_mask(tiny_params()) == {
      "conv": {"kernel": True, "bias": False}, "bn": {"scale": False}}


@pytest.mark.parametrize("momentum", [0.9, 0.0])
def test_sgd_chain_is_optax_sgd(momentum):
  # The state tree checkpoints save, and the updates, are those of optax.sgd
  # behind optax.add_decayed_weights (momentum 0: optax.sgd(momentum=None)).
  lr, wd = 0.05, 5e-4
  c = make_config(**{"optim.learning_rate": lr, "optim.schedule": "constant",
                     "optim.warmup_epochs": 0, "optim.weight_decay": wd,
                     "optim.momentum": momentum, "accumulation_steps": 1})
  want = optax.chain(optax.add_decayed_weights(wd, mask=optim.kernel_mask),
                     optax.sgd(optax.constant_schedule(lr), momentum=momentum or None,
                               nesterov=True))
  got = optim.make_optimizer(c, SPE)
  params = tiny_params()
  assert (jax.tree.structure(got.init(params)) == jax.tree.structure(want.init(params)))
  np.testing.assert_array_equal(run(got, params, [grads(0), grads(1)])["conv"]["kernel"],
                                run(want, params, [grads(0), grads(1)])["conv"]["kernel"])


def test_momentum_chain_rejects_adam():
  with pytest.raises(ValueError, match="sgd"):
    optim.momentum_chain(make_config(**{"optim.name": "adam"}).optim, 0.1)


def test_sgd_nesterov_matches_pytorch_semantics():
  lr, mu, wd = 0.05, 0.9, 5e-4
  c = make_config(**{"optim.learning_rate": lr, "optim.schedule": "constant",
                     "optim.warmup_epochs": 0, "optim.weight_decay": wd,
                     "accumulation_steps": 1})
  tx = optim.make_optimizer(c, SPE)
  params = tiny_params()
  state = tx.init(params)
  # PyTorch SGD(momentum=mu, dampening=0, nesterov=True), wd on kernels only.
  theta = jax.tree.map(np.asarray, params)
  buf = jax.tree.map(np.zeros_like, theta)
  for step in range(3):
    g = grads(step)
    updates, state = tx.update(g, state, params)
    params = optax.apply_updates(params, updates)

    def torch_step(path, t, b, g):
      d = np.asarray(g) + (wd * t if is_kernel(path) else 0.0)
      b[...] = mu * b + d
      d = d + mu * b
      return t - lr * d

    theta = jax.tree_util.tree_map_with_path(torch_step, theta, buf, g)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7),
                 params, theta)


# ---------------------------------------------------------------- schedules


def schedule_of(**overrides):
  base = {"optim.learning_rate": 0.2, "num_epochs": 100, "optim.warmup_epochs": 5}
  return optim.learning_rate_schedule(make_config(**{**base, **overrides}), SPE)


def test_warmup_is_linear_from_zero():
  for name in optim.LR_SCHEDULES:
    s = schedule_of(**{"optim.schedule": name})
    np.testing.assert_allclose([s(0), s(10), s(25), s(49)],
                               [0.0, 0.04, 0.1, 0.2 * 49 / 50], rtol=1e-6)
    np.testing.assert_allclose(s(50), 0.2, rtol=1e-6)


def test_step_decay_boundaries_are_absolute_epochs():
  s = schedule_of(**{"optim.schedule": "step", "optim.decay_epochs": (30, 60, 80)})
  steps = [50, 299, 300, 599, 600, 799, 800, 999]
  want = [0.2, 0.2, 0.02, 0.02, 0.002, 0.002, 0.0002, 0.0002]
  np.testing.assert_allclose([s(n) for n in steps], want, rtol=1e-5)
  # Default lr: 0.1 * batch_size / 256.
  c = make_config(**{"batch_size": 256})
  assert optim.base_learning_rate(c) == pytest.approx(0.1)


def test_cosine_values():
  s = schedule_of(**{"optim.schedule": "cosine", "optim.end_learning_rate": 0.002})
  decay = 1000 - 50
  for n in (50, 200, 525, 900, 1000):
    t = (n - 50) / decay
    want = 0.002 + (0.2 - 0.002) * 0.5 * (1 + math.cos(math.pi * t))
    np.testing.assert_allclose(s(n), want, rtol=1e-5)


def test_polynomial_values():
  s = schedule_of(**{"optim.schedule": "polynomial", "optim.polynomial_power": 2.0})
  for n in (50, 100, 525, 999, 1000, 1200):
    t = min((n - 50) / 950, 1.0)
    np.testing.assert_allclose(s(n), 0.2 * (1 - t) ** 2, rtol=1e-5, atol=1e-9)


def test_constant_and_no_warmup():
  s = schedule_of(**{"optim.schedule": "constant"})
  np.testing.assert_allclose([s(50), s(500), s(5000)], [0.2] * 3, rtol=1e-6)
  s = schedule_of(**{"optim.schedule": "step", "optim.warmup_epochs": 0,
                     "optim.decay_epochs": (30,)})
  np.testing.assert_allclose([s(0), s(299), s(300)], [0.2, 0.2, 0.02], rtol=1e-6)


def test_unknown_names_list_the_choices():
  with pytest.raises(ValueError, match="cosine.*polynomial"):
    schedule_of(**{"optim.schedule": "exponential"})
  with pytest.raises(ValueError, match="sgd.*lars.*adam"):
    optim.make_optimizer(make_config(**{"optim.name": "rmsprop"}), SPE)
  with pytest.raises(ValueError, match="accumulation_steps"):
    optim.make_optimizer(make_config(**{"accumulation_steps": 0}), SPE)


# ---------------------------------------------------------------- MultiSteps


@pytest.mark.parametrize("name", optim.OPTIMIZERS)
def test_multisteps_averages_k_gradients(name):
  k = 3
  common = {"optim.name": name, "optim.learning_rate": 0.1,
            "optim.schedule": "constant", "optim.warmup_epochs": 0}
  tx_k = optim.make_optimizer(make_config(**common, accumulation_steps=k), SPE)
  tx_1 = optim.make_optimizer(make_config(**common, accumulation_steps=1), SPE)
  params = tiny_params()
  state = tx_k.init(params)
  micro = [grads(i) for i in range(k)]
  for i, g in enumerate(micro):
    updates, state = tx_k.update(g, state, params)
    if i < k - 1:  # no update until the k-th micro-batch
      assert all(float(jnp.abs(u).max()) == 0 for u in jax.tree.leaves(updates))
    params = optax.apply_updates(params, updates)
  mean = jax.tree.map(lambda *g: sum(g) / k, *micro)
  want = run(tx_1, tiny_params(), [mean])
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7),
               params, want)


# ---------------------------------------------------------------- LARS


def test_larc_trust_ratio_clipped_at_one():
  lr, wd, eta = 0.1, 1e-4, 0.02
  p = {"kernel": jnp.full((4,), 5.0), "bias": jnp.full((4,), 1.0)}  # |p| = 10, 2
  # Large kernel gradient: local_lr = 0.02 * 10 / (20 + 1e-3) < lr -> scaled.
  # Small bias gradient: local_lr = 0.02 * 2 / 0.02 = 2 > lr -> ratio 1.
  g = {"kernel": jnp.full((4,), 10.0), "bias": jnp.full((4,), 0.01)}
  tx = optim.scale_by_larc(lr, wd, eta, eps=0.0)
  updates, _ = tx.update(g, tx.init(p), p)
  local_lr = eta * 10.0 / (20.0 + wd * 10.0)
  np.testing.assert_allclose(updates["kernel"], (10.0 + wd * 5.0) * local_lr / lr, rtol=1e-6)
  np.testing.assert_allclose(updates["bias"], g["bias"], rtol=1e-6)  # no decay, no scaling
  # Zero gradient or zero weights: left alone; lr = 0 (warm-up start): ratio 1.
  zero = {"kernel": jnp.zeros(4), "bias": jnp.zeros(4)}
  updates, _ = tx.update(zero, tx.init(p), p)
  np.testing.assert_allclose(updates["kernel"], wd * p["kernel"], rtol=1e-6)
  updates, _ = tx.update(g, tx.init(zero), zero)
  np.testing.assert_allclose(updates["kernel"], g["kernel"])
  tx0 = optim.scale_by_larc(0.0, wd, eta)
  updates, _ = tx0.update(g, tx0.init(p), p)
  assert np.all(np.isfinite(updates["kernel"]))
  np.testing.assert_allclose(updates["kernel"], g["kernel"] + wd * p["kernel"], rtol=1e-6)


def test_lars_optimizer_one_step_by_hand():
  lr, mu, wd, eta = 0.1, 0.9, 1e-4, 0.02
  c = make_config(**{"optim.name": "lars", "optim.learning_rate": lr,
                     "optim.schedule": "constant", "optim.warmup_epochs": 0,
                     "optim.weight_decay": wd, "accumulation_steps": 1})
  params, g = tiny_params(), grads(0)
  got = run(optim.make_optimizer(c, SPE), params, [g])

  def by_hand(path, t, g):
    t, g = np.asarray(t, np.float64), np.asarray(g, np.float64)
    w = wd if is_kernel(path) else 0.0
    local_lr = eta * np.linalg.norm(t) / (np.linalg.norm(g) + w * np.linalg.norm(t) + 1e-8)
    d = (g + w * t) * min(local_lr / lr, 1.0)
    d = d + mu * d  # Nesterov from a zero buffer: b = d; d + mu b
    return t - lr * d

  want = jax.tree_util.tree_map_with_path(by_hand, params, g)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5), got, want)


# ---------------------------------------------------------------- Adam


def test_adam_decoupled_decay_on_kernels_only():
  lr, wd = 0.01, 0.05
  c = make_config(**{"optim.name": "adam", "optim.learning_rate": lr,
                     "optim.schedule": "constant", "optim.warmup_epochs": 0,
                     "optim.weight_decay": wd, "accumulation_steps": 1})
  params = tiny_params()
  zero = jax.tree.map(jnp.zeros_like, params)
  got = run(optim.make_optimizer(c, SPE), params, [zero])
  np.testing.assert_allclose(got["conv"]["kernel"],
                             params["conv"]["kernel"] * (1 - lr * wd), rtol=1e-6)
  np.testing.assert_allclose(got["conv"]["bias"], params["conv"]["bias"])
  np.testing.assert_allclose(got["bn"]["scale"], params["bn"]["scale"])
  # First Adam step moves every leaf by about lr * sign(g) (bias-corrected).
  got = run(optim.make_optimizer(c.copy_and_resolve_references(), SPE), params, [grads(0)])
  step = jax.tree.map(lambda a, b: np.asarray(b - a), got, params)
  np.testing.assert_allclose(np.abs(step["bn"]["scale"]), lr, rtol=1e-4)


# ---------------------------------------------------------------- configs


CONFIG_DIR = pathlib.Path(__file__).resolve().parents[1] / "configs"
CONFIG_FILES = sorted(CONFIG_DIR.glob("*.py"))


def load_config_file(path):
  """Imports ``path`` as a module and calls ``get_config()`` (config_flags' way)."""
  spec = importlib.util.spec_from_file_location(f"_config_{path.stem}", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config()


@pytest.mark.parametrize("path", CONFIG_FILES, ids=lambda p: p.stem)
def test_config_file_loads_with_trainer_fields(path, monkeypatch):
  from petra_jax import data

  monkeypatch.syspath_prepend(str(CONFIG_DIR.parent / "docs" / "examples"))  # the recipe's PYTHONPATH

  c = load_config_file(path)
  default = config_lib.get_config()
  # Every default field is there (the trainer reads them), with the same type.
  flat = lambda d, pre="": {  # noqa: E731
      k2: v2 for k, v in d.items()
      for k2, v2 in (flat(v, f"{pre}{k}.") if hasattr(v, "items") else {f"{pre}{k}": v}).items()}
  want, got = flat(default), flat(c)
  assert set(want) <= set(got), set(want) - set(got)
  for key in want:
    assert isinstance(got[key], type(want[key])) or isinstance(want[key], float), key
  validation.validate_config(c, num_local_devices=max(c.num_devices, 1))
  data.get_dataset_info(c.dataset)
  optim.make_optimizer(c, 100)
  optim.learning_rate_schedule(c, 100)


# The paper's recipes (Sec. 4): micro-batch 64, k micro-batches per update,
# SGD-Nesterov 0.9, base rate 0.1 * 64 k / 256, linear warm-up over 5 epochs,
# rate x0.1 at each of the decay epochs, weight decay on kernels.
PAPER_RECIPES = [
    ("cifar10", "cifar10", 2, 300, (150, 225), 5e-4),
    ("cifar100", "cifar100", 2, 300, (150, 225), 5e-4),
    ("imagenet32", "imagenet32", 4, 90, (30, 60, 80), 1e-4),
    ("imagenet", "imagenet", 4, 90, (30, 60, 80), 1e-4),
]


@pytest.mark.parametrize("name,dataset,k,epochs,decay,wd", PAPER_RECIPES)
def test_paper_recipe_learning_rate_by_hand(name, dataset, k, epochs, decay, wd):
  c = load_config_file(CONFIG_DIR / f"{name}.py")
  assert (c.dataset, c.method, c.model.name, c.model.width) == (dataset, "petra", "revnet18", 64)
  assert c.batch_size // c.accumulation_steps == 64 and c.accumulation_steps == k
  assert c.num_epochs == epochs
  lr = 0.1 * 64 * k / 256
  warmup = 5 * SPE

  def by_hand(n):  # the paper's rate at update n
    if n < warmup:
      return lr * n / warmup
    return lr * 0.1 ** sum(n >= e * SPE for e in decay)

  s = optim.learning_rate_schedule(c, SPE)
  points = [0, 1, warmup // 2, warmup - 1, warmup, epochs * SPE - 1]
  for e in decay:
    points += [e * SPE - 1, e * SPE]
  for n in sorted(points):
    np.testing.assert_allclose(s(n), by_hand(n), rtol=1e-5, atol=1e-12, err_msg=f"update {n}")


@pytest.mark.parametrize("name,dataset,k,epochs,decay,wd", PAPER_RECIPES)
def test_paper_recipe_optimizer_updates_by_hand(name, dataset, k, epochs, decay, wd):
  # Three updates of k micro-batches each, one update per epoch: the rate is
  # 0, lr/5, 2 lr/5 (warm-up). PyTorch's SGD(momentum=0.9, nesterov=True) on
  # the mean of the k micro-batch gradients, L2 decay on kernels only. The
  # gradients are small (|g| ~ 0.01) so that the decay term (wd |theta|) is
  # a visible part of each update; updates are compared before they are
  # added to the parameters, to keep float32 round-off out.
  c = load_config_file(CONFIG_DIR / f"{name}.py")
  lr, mu, steps_per_epoch = 0.1 * 64 * k / 256, 0.9, 1
  rates = [lr * n / 5 for n in range(3)]
  tx = optim.make_optimizer(c, steps_per_epoch)
  params = tiny_params()
  state = tx.init(params)
  theta = jax.tree.map(lambda p: np.asarray(p, np.float64), params)
  buf = jax.tree.map(np.zeros_like, theta)
  for update, rate in enumerate(rates):
    micro = [jax.tree.map(lambda g: 0.01 * g, grads(update * k + i)) for i in range(k)]
    for i, g in enumerate(micro):
      updates, state = tx.update(g, state, params)
      if i < k - 1:  # accumulating: nothing applied yet
        assert all(float(jnp.abs(u).max()) == 0 for u in jax.tree.leaves(updates))
    mean = jax.tree.map(lambda *gs: np.mean([np.asarray(x, np.float64) for x in gs], 0), *micro)

    def torch_step(path, t, b, g, rate=rate):
      d = g + (wd * t if is_kernel(path) else 0.0)
      b[...] = mu * b + d
      return -rate * (d + mu * b)

    want = jax.tree_util.tree_map_with_path(torch_step, theta, buf, mean)
    if update == 0:  # rate 0: no move, but the momentum buffer fills
      assert all(float(jnp.abs(u).max()) == 0 for u in jax.tree.leaves(updates))
    else:
      jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-12),
                   updates, want)
    params = optax.apply_updates(params, updates)
    theta = jax.tree.map(lambda p: np.asarray(p, np.float64), params)
