"""The host-overhead benchmark's no-op pipeline runs the real engine's tasks."""

import types

import jax
import numpy as np
import optax
import pytest

from petra_jax.benchmarks import host
from petra_jax.engine.pipeline import Pipeline
from petra_jax.engine.transport.pipeline_state import PipelineState

from helpers import tiny_revnet

IMAGE = (8, 8, 3)


_tiny_revnet = tiny_revnet


def _batch(m):
  rng = np.random.default_rng(m)
  return (rng.normal(size=(2, *IMAGE)).astype(np.float32),
          rng.integers(0, 10, 2).astype(np.int32))


def _record(pipe, calls):
  """Wraps every jitted step of ``pipe`` (in place) to log ``(kind, stage)``;
  a fused forward+backward call logs both, in that order."""
  for j, steps in enumerate(pipe.steps):
    for kinds, name in ((("forward",), "_forward"), (("backward",), "_backward"),
                        (("forward", "backward"), "_fused")):
      fn = getattr(steps, name)
      if fn is None:  # (the last stage has no fused step)
        continue
      def logged(*args, fn=fn, kinds=kinds, j=j):
        calls.extend((kind, j) for kind in kinds)
        return fn(*args)
      setattr(steps, name, logged)


@pytest.mark.parametrize("method", ["petra", "delayed"])
def test_hollow_pipeline_runs_the_same_steps_as_the_real_one(method):
  tx = optax.sgd(0.1, momentum=0.9)
  device = jax.devices()[0]
  real = Pipeline(_tiny_revnet(), tx, [device], method=method)
  hollow = host.hollow_pipeline(_tiny_revnet(), tx, device, method=method)
  logs = {"real": [], "hollow": []}
  outputs = {}
  for name, pipe in (("real", real), ("hollow", hollow)):
    _record(pipe, logs[name])
    state = pipe.init(0, _batch(0)[0])
    state, outputs[name] = pipe.run(state, pipe.schedule(6), _batch)
    assert state.in_flight() == 0
    jax.block_until_ready(state.train_states)
  assert logs["real"] == logs["hollow"]
  J, M = 5, 6  # independent count: J-1 forwards, J-1 backwards, 1 loss step per micro-batch
  assert logs["real"].count(("forward", 0)) == M
  assert sum(k == "forward" for k, _ in logs["real"]) == (J - 1) * M
  assert sum(k == "backward" for k, _ in logs["real"]) == J * M
  assert [o.micro_batch for o in outputs["real"]] == [o.micro_batch for o in outputs["hollow"]]
  # the no-op steps compute nothing: zeros where the real loss is positive
  assert all(float(o.loss) > 0 for o in outputs["real"])
  assert all(float(o.loss) == 0 for o in outputs["hollow"])


def test_hollow_steps_keep_shapes_and_donation():
  pipe = host.hollow_pipeline(_tiny_revnet(), optax.sgd(0.1), jax.devices()[0])
  state = pipe.init(0, _batch(0)[0])
  x = jax.numpy.asarray(_batch(0)[0])
  real = Pipeline(_tiny_revnet(), optax.sgd(0.1), jax.devices()[:1])
  want = jax.eval_shape(real.steps[0]._forward, state.train_states[0], x)
  got = pipe.steps[0].forward(state.train_states[0], x)
  assert jax.tree.structure(got) == jax.tree.structure(want)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    assert g.shape == w.shape and g.dtype == w.dtype
    np.testing.assert_array_equal(np.asarray(g), 0)


class _ScriptedPipeline:
  """A pipeline that computes nothing and compiles nothing (the report's
  arithmetic is under test; the hollow pipeline's steps are checked above):
  counts its ticks, records how it was built."""

  built = []

  def __init__(self, stages, tx, devices, method="petra", step_wrap=None):
    del tx
    self.ticks = 0
    self.built.append((len(stages), len(devices), method, step_wrap is host.noop_step))

  def init(self, seed, images):
    del seed, images
    return PipelineState.empty([])

  def schedule(self, num_micro_batches):
    return list(range(num_micro_batches))

  def run_tick(self, state, tick, batches):
    del tick, batches
    self.ticks += 1
    return state, []


def test_host_report_from_a_scripted_clock(monkeypatch):
  """The report's figures from round times set by a fake clock, worked by
  hand: 5 stages, rounds of 4 ticks, the medians of 3 rounds."""
  durations = iter([1.0] * 5 +  # warm-up: hollow fill and round, petra fill and round, backprop
                   [0.004, 0.040, 0.020,  # round 1: hollow, petra, backprop (s per 4 ticks)
                    0.002, 0.080, 0.020,
                    0.008, 0.060, 0.100])
  clock = {"now": 0.0, "start": True}

  def perf_counter():
    if not clock["start"]:
      clock["now"] += next(durations)
    clock["start"] = not clock["start"]
    return clock["now"]
  monkeypatch.setattr(host, "time", types.SimpleNamespace(perf_counter=perf_counter))
  monkeypatch.setattr(host, "Pipeline", _ScriptedPipeline)
  monkeypatch.setattr(_ScriptedPipeline, "built", [])
  r = host.benchmark(_tiny_revnet(), IMAGE, 10, batch_size=2, ticks=4, repeats=3,
                     executors=("host",))
  # hollow per tick 1, 0.5, 2 ms: median 1 ms over 5 stages; petra 10, 20, 15
  # ms: 15; backprop 5, 5, 25 ms: 5.
  assert r["rounds_hollow_ms"] == pytest.approx([1.0, 0.5, 2.0])
  assert r["host_us_per_stage_tick"] == pytest.approx(200.0)
  assert r["ticks_per_second"] == pytest.approx(1000.0)
  assert r["petra_ms_per_tick"] == pytest.approx(15.0)
  assert r["backprop_ms_per_step"] == pytest.approx(5.0)
  assert r["ratio_petra_backprop"] == pytest.approx(3.0)
  assert (r["num_stages"], r["ticks"], r["repeats"], r["batch_size"]) == (5, 4, 3, 2)
  assert next(durations, None) is None  # every interval timed was read
  # hollow (no-op steps), petra, backprop: 5 stages on one device each.
  assert _ScriptedPipeline.built == [(5, 1, "petra", True), (5, 1, "petra", False),
                                     (5, 1, "backprop", False)]


def test_a_tick_moves_its_messages_in_one_batched_device_put(monkeypatch):
  # 5 stages on 4 devices: a steady-state tick's forward and backward
  # messages across the 3 device boundaries (6 payloads) leave in one
  # jax.device_put, after the tick's computation.
  from petra_jax.engine.transport import messages
  from petra_jax.engine.transport import transfers as transport
  from petra_jax.engine.transport.messages import Deferred
  calls = []
  real_send = transport.send

  def counting_send(x, where):
    calls.append(len(x) if isinstance(x, list) else 1)
    return real_send(x, where)
  pipe = Pipeline(_tiny_revnet(), optax.sgd(0.1), jax.devices()[:4])
  state = pipe.init(0, np.zeros((2, *IMAGE), np.float32))
  table = pipe.schedule(12)
  state, _ = pipe.run(state, (table[t] for t in range(10)), _batch)  # steady state from here
  monkeypatch.setattr(messages.transport, "send", counting_send)
  moved_before = len(calls)
  state, _ = pipe.run_tick(state, table[10], _batch)
  # the feed's images (stage 0) and labels (last stage), then the 6 messages at once
  assert calls[moved_before:] == [1, 1, 6]
  waiting = [v for box in state.inbox + state.grad_inbox for v in box.values()]
  assert waiting and not any(isinstance(v, Deferred) for v in waiting)


def test_python_m_host_runs_the_benchmark_with_its_flags(monkeypatch, capsys):
  """``python -m petra_jax.benchmarks.host`` (the issue's command) hands its flags to
  :func:`host.benchmark` and prints its report as one JSON line."""
  import json
  calls = []

  def fake_benchmark(stages, shape, num_classes, batch_size, ticks, repeats, periods,
                     unroll_ticks, order_writes):
    calls.append((len(stages), tuple(shape), num_classes, batch_size, ticks, repeats, periods,
                  unroll_ticks, order_writes))
    return {"host_us_per_stage_tick": 1.0}
  monkeypatch.setattr(host, "benchmark", fake_benchmark)
  assert host.main(["--ticks=7", "--iters=2", "--periods-per-dispatch=4", "--unroll-ticks=1,4",
                    "--order-writes=1", "--json"]) == 0
  # revnet18 at width 2 on CIFAR-10: stem, 8 reversible blocks, head = 10 stages.
  assert calls == [(10, (32, 32, 3), 10, 2, 7, 2, 4, [1, 4], True)]
  out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
  assert out == {"host_us_per_stage_tick": 1.0, "model": "revnet18", "dataset": "cifar10",
                 "width": 2}
