"""The asynchronous methods of paper Table 4: exact with zero delay, and what
each one stores between a micro-batch's forward and its backward."""

import functools

import jax
import numpy as np
import optax
import pytest

from petra_jax import models
from petra_jax.engine import methods
from petra_jax.engine import pipeline
from petra_jax.engine import schedules as schedule
from petra_jax.engine.stages import steps
from petra_jax.engine.stages.stage import Stage
from helpers import (batches_of, random_batch, run_ticks, tiny_revnet,
                     zero_delay_update_errors)

# Paper Table 4, read off the paper (Sec. 4.2): whether the gradient is
# delayed, whether an input buffer and a parameter buffer are kept, and
# whether reversible stages reconstruct their input.
TABLE4 = {  # method: (delayed, input buffer, parameter buffer, reconstructs)
    "backprop": (False, False, False, False),
    "delayed": (True, True, True, False),
    "dsp": (True, True, False, False),
    "approximate_input": (True, False, True, True),
    "petra": (True, False, False, True),
}
PIPELINED = [m for m in methods.METHODS if m != "backprop"]


def _stages():
  """The tiny RevNet with a second reversible stage after ``rev0`` (J = 6):
  stem, rev, rev, downsample, rev, head, width 2, with BatchNorm. A
  reversible stage's parameter and input cotangents do not depend on the
  ``x2`` it reconstructs, so a reconstruction error reaches the gradients only
  through a reversible stage before it: without two in a row, ``petra``
  trains bit-identically to ``dsp``."""
  stages = tiny_revnet()
  stages.insert(2, Stage("rev0b", models.BasicResidual(2), True))
  return stages


@pytest.mark.parametrize("name", sorted(TABLE4))
def test_method_table_matches_paper_table4(name):
  m = methods.get(name)
  keeps = methods.keeps(m, reversible=True)
  assert (m.delayed, m.pipelined and keeps.input, keeps.weights, m.reconstructs) == TABLE4[name]


def test_unknown_method_names_the_choices():
  with pytest.raises(ValueError, match="Unknown method 'pipedream'.*petra"):
    methods.get("pipedream")


@pytest.mark.parametrize("method", PIPELINED)
def test_zero_delay_equals_jax_grad(method):
  """Drained after every micro-batch, every method's update is -lr * jax.grad
  (:func:`_stages`; revnet18's own chain against jax.grad: test_stage)."""
  errors = zero_delay_update_errors(_stages(), method)
  # float32 round-off of the reconstruction: ~1e-6 measured (see test_stage).
  assert max(errors) < 1e-4, (method, errors)


@pytest.fixture(scope="module")
def steady_runs():
  """Each method run for 2J ticks (past the fill): ``{method: (stages, pipe, state)}``
  on :func:`_stages` (J = 6: delays up to 10 ticks)."""
  stages = _stages()
  runs = {}
  for method in methods.DELAYED:
    pipe = pipeline.Pipeline(stages, optax.sgd(0.1, momentum=0.9), jax.devices()[:1],
                             method=method)
    state = pipe.init(0, random_batch()[0])
    J = len(stages)  # past the fill: every stage holds its steady number of inputs
    state, _ = run_ticks(pipe, state, 4 * J, batches_of(), num_ticks=2 * J)
    runs[method] = (stages, pipe, state)
  return runs


@pytest.mark.parametrize("method", methods.DELAYED)
def test_stored_bytes_match_each_methods_claim(method, steady_runs):
  stages, _, state = steady_runs[method]
  x, _ = random_batch()
  J = len(stages)
  # Independent accounting from shapes: input of stage j and its parameters.
  inputs, h = [], x
  for s, st in zip(stages, state.train_states):
    inputs.append(sum(a.nbytes for a in jax.tree.leaves(h)))
    h = steps.forward_step(s, st, h)[0]
  param_bytes = [sum(a.nbytes for a in jax.tree.leaves(st.params)) for st in state.train_states]
  stash_inputs = method in ("dsp", "delayed")
  stash_params = method in ("delayed", "approximate_input")
  expected = []
  for j, s in enumerate(stages):
    # After a tick's forward and backward, stage j holds the tau_j micro-batches
    # whose forward ran and whose backward has not (the last stage holds none).
    tau = schedule.delay(j, J)
    per_micro = (inputs[j] if (stash_inputs or not s.reversible) else 0) + \
        (param_bytes[j] if stash_params else 0)
    expected.append(tau * per_micro if j < J - 1 else 0)
  assert state.stored_bytes() == expected
  if method == "petra":
    assert all(b == 0 for b, s in zip(state.stored_bytes(), stages) if s.reversible)


def test_methods_differ_once_delays_are_real(steady_runs):
  """Guard against a method silently running another's code path."""
  final = {m: np.concatenate([np.ravel(a) for a in jax.tree.leaves(
      run[2].train_states[1].params)])
           for m, run in steady_runs.items()}
  names = list(final)
  for a in range(len(names)):
    for b in range(a + 1, len(names)):
      assert not np.allclose(final[names[a]], final[names[b]]), (names[a], names[b])


def test_reconstructing_method_on_plain_resnet_raises():
  stages = models.build_model("resnet18", width=4)
  with pytest.raises(ValueError, match="needs a reversible model"):
    pipeline.Pipeline(stages, optax.sgd(0.1), method="petra")
  with pytest.raises(ValueError, match="Unknown method"):
    pipeline.Pipeline(stages, optax.sgd(0.1), method="pipedream")


FLUSHED_K, FLUSHED_M = 4, 12  # accumulated micro-batches per update, micro-batches run


@functools.lru_cache(maxsize=None)
def _flushed_losses(method):
  """Per-micro-batch losses of ``method`` on :func:`_stages`, k = 4, 12
  micro-batches, SGD-momentum (shared by the tests' parameters)."""
  tx = optax.MultiSteps(optax.sgd(0.5, momentum=0.9), FLUSHED_K)
  pipe = pipeline.Pipeline(_stages(), tx, jax.devices()[:1], method=method,
                           accumulation_steps=FLUSHED_K)
  state = pipe.init(0, random_batch()[0])
  state, out = run_ticks(pipe, state, FLUSHED_M, batches_of())
  assert state.in_flight() == 0
  return np.array([float(o.loss) for o in sorted(out)])


@pytest.mark.parametrize("method", ["gpipe", "1f1b"])
def test_flushed_schedules_lose_as_backprop(method):
  """GPipe and 1F1B are exact: with k = 4 accumulated micro-batches per
  update, every micro-batch's loss equals backprop's up to float32 round-off."""
  k, M = FLUSHED_K, FLUSHED_M
  losses = {name: _flushed_losses(name) for name in ("backprop", method)}
  assert len(losses[method]) == M
  assert np.abs(losses["backprop"][k:] - losses["backprop"][0]).max() > 1e-3  # it trains
  np.testing.assert_allclose(losses[method], losses["backprop"], rtol=1e-5)
