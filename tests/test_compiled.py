"""The compiled executor against the host executor (the reference): same losses, same
weights, a fraction of the dispatches, no implicit transfer, no wait inside a call."""

import functools
import re
import types

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from petra_jax.engine import compiled
from petra_jax.engine.transport import rings
from petra_jax.engine.arrays import quantize
from petra_jax.engine.observers import GradientProbe
from petra_jax.engine.methods import forward_gradient
from petra_jax.engine.pipeline import Pipeline
from petra_jax.models import auxiliary

from helpers import compiles_counted, tiny_revnet

IMAGE = (8, 8, 3)
# Every method whose cotangents travel back; the local methods below (auxiliary heads).
METHODS = ("backprop", "revprop", "petra", "approximate_input", "dsp", "delayed", "gpipe",
           "1f1b", "zb_h1")
LOCAL_METHODS = ("local", "forward_gradient")


def _batches(batch_size=4):
  cache = {}

  def batches(m):
    if m not in cache:
      rng = np.random.default_rng(m)
      cache[m] = (jnp.asarray(rng.normal(size=(batch_size, *IMAGE)), jnp.float32),
                  jnp.asarray(rng.integers(0, 10, batch_size), jnp.int32))
    return cache[m]
  return batches


def _stages(method, guess="local"):
  """The tiny RevNet; with auxiliary heads for the methods that train on local losses (not
  ``forward_gradient``'s random guesses, which train no head)."""
  if method in LOCAL_METHODS and guess == "local":
    return auxiliary.with_heads(tiny_revnet(), "mlp", 10, hidden=8)
  return tiny_revnet()


def _train(method, executor, micro_batches=16, k=2, n=4, devices=None, data_parallel=1,
           guess="local", unroll_ticks=4, order_writes=False):
  """``({m: loss}, final params, executor)`` of ``micro_batches`` micro-batches (``guess``:
  ``forward_gradient``'s; ``n``, ``unroll_ticks`` and ``order_writes``: the compiled
  executor's)."""
  pipe = Pipeline(_stages(method, guess), optax.sgd(0.02, momentum=0.9),
                  devices or jax.devices()[:1], method=method, accumulation_steps=k,
                  data_parallel=data_parallel,
                  forward_gradient=forward_gradient.Options(guess=guess))
  batches = _batches(4 * data_parallel)
  state = pipe.init(0, batches(0)[0])
  table = pipe.schedule(micro_batches)
  ex = compiled.executor(pipe, executor, n, unroll_ticks, order_writes)
  t, losses = 0, {}
  while t < len(table):
    state, outputs, ran = ex.advance(state, table, t, batches)
    losses.update({o.micro_batch: float(o.loss) for o in outputs})
    t += ran
  return losses, [s.params for s in state.train_states], ex


@functools.lru_cache(maxsize=None)
def _host_run(method, micro_batches=16, guess="local"):
  """The host executor's ``({m: loss}, final params)`` of :func:`_train` (the reference): run
  once per test process and row, shared by the tests that compare with it (the losses a
  read-only mapping, the params a tuple of arrays)."""
  losses, params, _ = _train(method, "host", micro_batches=micro_batches, guess=guess)
  return types.MappingProxyType(losses), tuple(params)


@pytest.mark.parametrize("method", [  # a stream, a drained round, a flushed round; the rest long
    m if m in ("petra", "revprop", "gpipe", "local") else pytest.param(m, marks=pytest.mark.long)
    for m in METHODS + LOCAL_METHODS])
def test_compiled_losses_and_weights_equal_the_host_executors(method):
  host, host_params = _host_run(method)
  comp, comp_params, ex = _train(method, "compiled")
  assert ex.dispatches > 0
  assert_same_run(host, host_params, comp, comp_params)


def assert_same_run(host, host_params, comp, comp_params) -> None:
  """Every micro-batch's loss (rtol 1e-6) and the final weights (rtol 1e-5) as the host's."""
  assert sorted(comp) == sorted(host) == list(range(16))
  np.testing.assert_allclose([comp[m] for m in host], [host[m] for m in host], rtol=1e-6)
  for a, b in zip(jax.tree.leaves(comp_params), jax.tree.leaves(host_params)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("method, n, unroll_ticks, per_iteration", [
    pytest.param("petra", 8, 4, 4, marks=pytest.mark.long),  # 2 loop iterations of 4 ticks
    ("petra", 6, 4, 3),    # 2 iterations of 3 ticks: periods that divide N
    ("petra", 6, 1, 1),    # one tick per iteration
    ("gpipe", 4, 25, 2),   # whole rounds of 11 ticks: 2 per iteration
])
def test_compiled_with_several_periods_per_loop_iteration_equals_the_host(
    method, n, unroll_ticks, per_iteration):
  host, host_params = _host_run(method, micro_batches=32)
  comp, comp_params, ex = _train(method, "compiled", micro_batches=32, n=n,
                                 unroll_ticks=unroll_ticks)
  assert ex.unroll == per_iteration and ex.dispatches > 0
  assert sorted(comp) == sorted(host) == list(range(32))
  np.testing.assert_allclose([comp[m] for m in host], [host[m] for m in host], rtol=1e-6)
  for a, b in zip(jax.tree.leaves(comp_params), jax.tree.leaves(host_params)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("method", [  # local: its labels ride with the activations
    "petra", pytest.param("local", marks=pytest.mark.long)])
def test_compiled_with_ordered_writes_equals_the_host(method):
  """``order_writes`` subtracts a zero from each carried slot's new value: the same run."""
  host, host_params = _host_run(method)
  comp, comp_params, ex = _train(method, "compiled", order_writes=True)
  assert ex.dispatches > 0 and "writes ordered" in ex.describe()
  assert_same_run(host, host_params, comp, comp_params)


def test_unroll_ticks_below_one_is_refused():
  pipe = Pipeline(tiny_revnet(), optax.sgd(0.1), jax.devices()[:1])
  with pytest.raises(ValueError, match="unroll_ticks must be >= 1"):
    compiled.CompiledExecutor(pipe, 4, unroll_ticks=0)


def test_compiled_draws_the_random_guesses_of_the_host_executor():
  """``forward_gradient.guess='random'``: micro-batch ``m``'s key folds in ``m``, its index in
  the run, which the program takes per period (the state's ``origin``). Losses and weights as
  the host's; with every origin 0 instead, the losses move by 7e-5 (measured)."""
  host, host_params = _host_run("forward_gradient", guess="random")
  comp, comp_params, ex = _train("forward_gradient", "compiled", guess="random")
  assert ex.dispatches > 0
  assert_same_run(host, host_params, comp, comp_params)


def test_compiled_on_a_data_parallel_group_of_four_devices():
  devices = jax.devices()[:4]
  host, _, _ = _train("petra", "host", devices=devices, data_parallel=4)
  comp, _, ex = _train("petra", "compiled", devices=devices, data_parallel=4)
  assert ex.dispatches > 0
  np.testing.assert_allclose([comp[m] for m in host], [host[m] for m in host], rtol=1e-6)


def test_steady_state_is_one_dispatch_per_n_ticks_and_no_step_call():
  """PETRA's steady ticks (2(J-1) .. M-1) run in calls of N ticks; once compiled, no
  jitted step of the host executor runs in between (tracing called them once), the state a
  call returns stays in the program's rings until read (the next call takes it as it is),
  and the calls after the first compile nothing (the one from plain messages and the ones
  from the rings run one scan program)."""
  n, M, J = 8, 48, 5
  pipe = Pipeline(tiny_revnet(), optax.sgd(0.02), jax.devices()[:1], method="petra")
  batches = _batches()
  state = pipe.init(0, batches(0)[0])
  table, ex = pipe.schedule(M), compiled.CompiledExecutor(pipe, n)
  state, t = fill_until_the_first_call(ex, state, table, batches, J, n)
  first = state
  host_calls = count_host_step_calls(pipe)
  steady = (M - 2 * (J - 1)) // n * n
  with compiles_counted() as compiles:
    while t < 2 * (J - 1) + steady:
      state, _, ran = ex.advance(state, table, t, batches)
      assert ran == n
      t += ran
  assert not compiles
  assert ex.dispatches == steady // n and not host_calls
  assert state.block_until_ready() is state and ex.conversions == 0  # (waiting converts nothing)
  with pytest.raises(RuntimeError, match="donated"):
    first.stage_states  # noqa: B018  (a state a later call took)
  assert state.in_flight() == 2 * (J - 1)  # read: converted, one call
  assert ex.conversions == 1


def fill_until_the_first_call(ex, state, table, batches, J: int, n: int):
  """Advances ``ex`` through PETRA's 2(J-1) filling ticks (one host tick each) and its first
  compiled call of ``n`` ticks; ``(state, ticks run)``."""
  t, ticks = 0, []
  while ex.dispatches < 1:  # filling on the host executor, then the first call compiles
    state, _, ran = ex.advance(state, table, t, batches)
    ticks.append(ran)
    t += ran
  assert t == 2 * (J - 1) + n and ticks == [1] * 2 * (J - 1) + [n]
  return state, t


def count_host_step_calls(pipe) -> list:
  """Wraps every stage's jitted host steps so each call appends to the returned list."""
  host_calls = []
  for steps in pipe.steps:
    for name in ("_forward", "_backward", "_fused"):
      fn = getattr(steps, name)
      if fn is not None:  # (the last stage has no fused step)
        setattr(steps, name, lambda *a, fn=fn: host_calls.append(1) or fn(*a))
  return host_calls


def test_steady_state_calls_make_no_implicit_transfer():
  pipe = Pipeline(tiny_revnet(), optax.sgd(0.02), jax.devices()[:1], method="petra")
  batches = _batches()
  state = pipe.init(0, batches(0)[0])
  table, ex = pipe.schedule(64), compiled.CompiledExecutor(pipe, 4)
  for m in range(64):
    batches(m)  # on the device before the guard
  t = 0
  while ex.dispatches < 1:  # fill and compile
    state, _, ran = ex.advance(state, table, t, batches)
    t += ran
  with jax.transfer_guard("disallow"):
    for _ in range(3):
      state, outputs, ran = ex.advance(state, table, t, batches)
      t += ran
  assert ran == 4 and len(outputs) == 4


def test_a_call_returns_before_the_device_has_finished():
  """Dispatch is asynchronous: the host does not wait inside a call, so host and device
  time overlap. With a large micro-batch, the call's losses are not ready when it returns."""
  pipe = Pipeline(tiny_revnet(), optax.sgd(0.02), jax.devices()[:1], method="petra")
  batches = _batches(batch_size=256)  # 8 ticks: a few hundred ms of device work (measured)
  state = pipe.init(0, batches(0)[0])
  table, ex = pipe.schedule(40), compiled.CompiledExecutor(pipe, 8)
  t = 0
  while ex.dispatches < 1:
    state, outputs, ran = ex.advance(state, table, t, batches)
    t += ran
  jax.block_until_ready(outputs[-1].loss)
  state, outputs, ran = ex.advance(state, table, t, batches)
  assert ran == 8
  assert not outputs[-1].loss.is_ready()
  jax.block_until_ready(outputs[-1].loss)


@pytest.mark.parametrize("build, missing", [
    (lambda: Pipeline(tiny_revnet(), optax.sgd(0.1), jax.devices()[:4]), "on 4 devices"),
    (lambda: Pipeline(tiny_revnet(), optax.sgd(0.1), jax.devices()[:1],
                      observers=[GradientProbe(1, 1)]), "observers"),
    (lambda: Pipeline(tiny_revnet(), optax.sgd(0.1), jax.devices()[:1],
                      formats=quantize.MessageFormats(forward="int8")), "quantised"),
])
def test_unsupported_pipeline_is_one_line_naming_the_host_executor(build, missing):
  assert_refused_in_one_line(build(), missing)


def assert_refused_in_one_line(pipe, missing: str) -> None:
  """``compiled`` refuses ``pipe`` in one line naming ``missing`` and the host executor, and
  ``auto`` falls back to the host executor."""
  with pytest.raises(compiled.Unsupported) as e:
    compiled.executor(pipe, "compiled")
  message = str(e.value)
  assert "\n" not in message and missing in message and "--config.executor=host" in message
  assert isinstance(compiled.executor(pipe, "auto"), compiled.HostExecutor)


def test_unknown_executor_name():
  pipe = Pipeline(tiny_revnet(), optax.sgd(0.1), jax.devices()[:1])
  with pytest.raises(ValueError, match="choose one of"):
    compiled.executor(pipe, "fast")


def test_auto_is_compiled_on_an_accelerator_and_host_on_the_cpu():
  pipe = Pipeline(tiny_revnet(), optax.sgd(0.1), jax.devices()[:1])
  ex = compiled.executor(pipe, "auto")
  if jax.devices()[0].platform == "cpu":
    assert isinstance(ex, compiled.HostExecutor) and "CPU" in ex.describe()
  else:
    assert isinstance(ex, compiled.CompiledExecutor)
  assert isinstance(compiled.executor(pipe, "compiled"), compiled.CompiledExecutor)


def _held_program(unroll_ticks: int, n: int = 8, order_writes: bool = False) -> tuple:
  """``(optimized HLO, {(HLO element type, shape)} of the rings' leaves)`` of PETRA's
  steady-state call of ``n`` ticks (the tiny RevNet) that takes the ring carry the call before
  it left (compiled once per test process and arguments)."""
  return _compiled_held_program(unroll_ticks, n, order_writes)


@functools.lru_cache(maxsize=None)
def _compiled_held_program(unroll_ticks: int, n: int, order_writes: bool) -> tuple:
  pipe = Pipeline(tiny_revnet(), optax.sgd(0.02), jax.devices()[:1], method="petra")
  batches = _batches()
  state = pipe.init(0, batches(0)[0])
  table = pipe.schedule(40)
  ex = compiled.CompiledExecutor(pipe, n, unroll_ticks, order_writes=order_writes)
  t = 0
  while ex.dispatches < 1:
    state, _, ran = ex.advance(state, table, t, batches)
    t += ran
  periods, s = ex.steady_periods(table, t, len(table))
  assert periods == n
  program, ring_carry = state.claim(ex, s)
  inputs = tuple(tuple(batches(m + s + i)[:2] for m in ex.period.fed) for i in range(n))
  text = program.held.lower(ring_carry, inputs, None).compile().as_text()
  found = []
  rings.views(ring_carry[1], lambda r, key: found.append(r) if isinstance(r, rings.Ring) else None)
  hlo_type = {"float32": "f32", "int32": "s32", "bfloat16": "bf16", "int8": "s8", "uint8": "u8"}
  return text, {(hlo_type[str(x.dtype)], tuple(x.shape))
                for r in found for x in jax.tree.leaves(r.data)}


@pytest.mark.parametrize("n, unroll_ticks", [(4, 1), (8, 4)])
def test_the_scan_keeps_held_messages_in_rings_it_never_copies_whole(n, unroll_ticks):
  """PETRA keeps each non-reversible stage's input for tau_j ticks: those messages stay in one
  ring per box (slot m mod R), which the compiled loop updates in place: no `copy` in the
  optimized program has a ring's shape (re-keyed slots were copied every tick before), with
  one or several ticks per loop iteration."""
  text, shapes = _held_program(unroll_ticks, n)
  assert shapes  # stage 0 keeps its images, and stages keep their inputs, over several ticks
  copied = {(dtype, tuple(int(d) for d in dims.split(",") if d))
            for dtype, dims in re.findall(r"= (\w+)\[([\d,]*)\]\S*\s+copy\(", text)}
  assert not copied & shapes, copied & shapes


def _steady_program_text(unroll_ticks: int, n: int = 8) -> str:
  """The optimized HLO of PETRA's steady-state call of ``n`` ticks (the tiny RevNet)."""
  return _held_program(unroll_ticks, n)[0]


def _loop_body(text: str) -> str:
  """The largest ``while`` body in ``text`` (optimized HLO): the scan's (the loss may hold
  small loops of its own)."""
  bodies = [re.search(r"^%?" + re.escape(body) + r" .*?\n}", text, re.M | re.S).group(0)
            for body in re.findall(r"\bwhile\(.*?body=%?([\w.\-]+)", text)]
  return max(bodies, key=len)


def _loop_body_ops(text: str) -> list:
  """The operations of the scan's loop body (:func:`_loop_body`)."""
  return re.findall(r"= \S+ ([\w-]+)\(", _loop_body(text))


def _copied_shapes(block: str) -> list:
  """``(HLO element type, dims)`` of every ``copy`` in ``block``."""
  return [(dtype, tuple(int(d) for d in dims.split(",") if d))
          for dtype, dims in re.findall(r"= (\w+)\[([\d,]*)\]\S*\s+copy\(", block)]


def test_ordered_writes_update_the_carried_messages_in_place():
  """A message the loop carries is read in an iteration's first ticks and its slot written in
  the last; nothing orders the two, so XLA copies it out of its slot and the new one in.
  Ordered (``order_writes``), the loop body copies at most half as many messages (activations
  ``f32[4, H, W, C]``; measured: 56 to 2 with jax 0.10.2, 56 to 24 with jax 0.12.1, whose
  XLA:CPU wraps convolutions in fusions; docs/performance.md) and still never a ring."""
  copies = {}
  for order in (False, True):
    text, ring_shapes = _held_program(4, 8, order)
    copied = _copied_shapes(_loop_body(text))
    assert not set(copied) & ring_shapes
    copies[order] = sum(dtype == "f32" and len(dims) == 4 for dtype, dims in copied)
  assert copies[False] >= 40 and copies[True] <= copies[False] / 2, copies


def test_several_ticks_per_loop_iteration_copy_fewer_carried_values_per_tick():
  """A value a tick hands to another carry slot costs XLA a copy out of its slot and one into
  the next at every loop iteration; 4 ticks per iteration keep the hand-overs between them
  inside the iteration: per tick at most half the copies of one tick per iteration (the
  RevNet18 program: 111 copies per tick, 38 with 4 ticks, docs/performance.md)."""
  per_tick = {}
  for u in (1, 4):
    ops = _loop_body_ops(_steady_program_text(u))
    per_tick[u] = ops.count("copy") / u
  assert per_tick[1] > 0 and per_tick[4] <= 0.5 * per_tick[1], per_tick


@pytest.mark.long  # two runs through the loop; test_time_to_accuracy and test_loss_log cover it
@pytest.mark.slow
def test_train_loss_lines_do_not_end_a_compiled_call(cifar10_dir, tmp_path, monkeypatch):
  """The training loop with a train_loss line after every update (k = 2, 4 stages, N = 4):
  the compiled calls still run N periods, since a line reads only losses (before, every
  update ended a call, so every call ran one period), and every line equals the host
  executor's as closely as rounding allows: the scan of 4 periods fuses differently (per
  micro-batch 1e-7 relative). The bound is 10 times what moving the learning rate by 1e-6
  relative does to the host executor's own lines, measured here too. At a learning rate of
  0.01 this tiny run does not amplify rounding (one CPU: that nudge moved lines by 2e-7 at most,
  the compiled lines by 1.1e-7); at 0.05 it did, chaotically: there the compiled lines left the
  host's by up to 3.6e-4 while the nudge moved them by 1.9e-5 (docs/performance.md)."""
  from helpers import tiny_config
  from petra_jax import train
  from petra_jax.training import metrics
  ran, advance = [], compiled.CompiledExecutor.advance

  def counted(self, *args, **kwargs):
    state, outputs, n = advance(self, *args, **kwargs)
    ran.append(n)
    return state, outputs, n
  monkeypatch.setattr(compiled.CompiledExecutor, "advance", counted)
  lines = {}
  for name, executor, rate in (("host", "host", 0.01), ("nudged", "host", 0.01 * (1 + 1e-6)),
                               ("compiled", "compiled", 0.01)):
    c = tiny_config(cifar10_dir, max_steps=12, accumulation_steps=2, executor=executor,
                    periods_per_dispatch=4, eval_every=0,
                    **{"model.num_stages": 4, "model.width": 2, "optim.learning_rate": rate})
    train.train_and_evaluate(c, str(tmp_path / name))
    lines[name] = np.array([r["train_loss"] for r in metrics.read_metrics(str(tmp_path / name))
                            if "train_loss" in r])
  assert len(lines["host"]) == 12
  rounding = np.max(np.abs(lines["nudged"] - lines["host"]) / lines["host"])
  np.testing.assert_allclose(lines["compiled"], lines["host"], rtol=max(1e-6, 10 * rounding))
  # 24 micro-batches: filling 6 ticks, steady ticks 6-23 (4 calls of 4, then 2 of one
  # period: the last update ends the steady state), draining 6.
  assert ran == [1] * 6 + [4] * 4 + [1] * 2 + [1] * 6
