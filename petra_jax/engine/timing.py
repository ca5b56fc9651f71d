"""Wall-clock timing of pipeline steps, and measured per-stage costs.

Used by the throughput benchmark (:mod:`petra_jax.benchmarks.throughput`) and
by stage balancing on measured costs (``config.model.balance_by="time"``,
:func:`measure_stage_costs`). Every timing waits for its result
(``jax.block_until_ready``) and reports milliseconds of wall time.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from petra_jax.engine.pipeline import Pipeline
from petra_jax.engine.stage import Stage
from petra_jax.engine.tasks import copy_tree


def median_ms(step: Callable[[], object], iters: int, warmup: int = 1,
              setup: Optional[Callable[[], None]] = None) -> float:
  """Median wall time (ms) of ``step()``, each call waited for.

  Args:
    step: runs one measured call and returns what to wait for.
    iters: measured calls.
    warmup: unmeasured calls first (compilation, caches).
    setup: run (and waited for) before every call, outside the timer.
  """
  times = []
  for i in range(warmup + iters):
    if setup is not None:
      jax.block_until_ready(setup())
    start = time.perf_counter()
    jax.block_until_ready(step())
    if i >= warmup:
      times.append(1e3 * (time.perf_counter() - start))
  return statistics.median(times)


def stage_times(pipe: Pipeline, state, images, labels, iters: int, warmup: int = 1):
  """Median ms of each stage's jitted forward and backward, called directly.

  Inputs are the activations of a forward through the model; cotangents are
  ones; the backward takes the arguments
  :meth:`petra_jax.engine.steps.StageSteps.backward_args` gives for the
  pipeline's method. The last stage's ``backward`` is its whole
  tick (forward, loss and backward at once), so its cost per tick is
  ``backward`` alone.

  Args:
    pipe, state: a pipeline on one device and its state (stage states are
      advanced by the backward steps, which donate them).
    images, labels: one micro-batch.

  Returns:
    ``(rows, activations)``: one dict per stage with ``forward`` and
    ``backward`` (ms), and the stage inputs ``[images, x_1, ..., x_{J-1}]``.
  """
  J = pipe.num_stages
  acts = [images]
  for j in range(J - 1):
    acts.append(pipe.steps.forward(j, state.stage_states[j], acts[j])[0])
  rows = []
  for j in range(J):
    y = acts[j + 1] if j < J - 1 else None
    rows.append(one_stage_times(pipe, state, j, acts[j], y, labels, iters, warmup))
  return rows, acts


def one_stage_times(pipe: Pipeline, state, j: int, x, y, labels, iters: int,
                    warmup: int = 1) -> dict:
  """Median ms of stage ``j``'s jitted forward and backward on given inputs.

  Args:
    pipe, state: a pipeline whose stage ``j`` runs in this process, and its
      state (``state.stage_states[j]`` is advanced by the backward steps,
      which donate it).
    j: the stage.
    x: its input pytree (on its device); y: its output (None for the last
      stage), whose cotangent is taken as ones; labels: ``int32[B]`` (used by
      the last stage).

  Returns:
    ``{"name", "reversible", "forward": ms, "backward": ms}``.
  """
  stage, box = pipe.stages[j], {"args": None}
  fwd = median_ms(lambda: pipe.steps.forward(j, state.stage_states[j], x), iters, warmup)

  def setup():  # fresh copies: a backward may donate its arguments
    box["args"] = copy_tree(pipe.steps.backward_args(
        j, x=x, y=y, dy=None if y is None else jax.tree.map(jnp.ones_like, y),
        labels=labels, stashed=state.stage_states[j].params))
    return box["args"]

  def bwd():
    out = pipe.steps.backward(j, state.stage_states[j], *box["args"])
    state.stage_states[j] = out[0]
    return out
  return {"name": stage.name, "reversible": stage.reversible, "forward": fwd,
          "backward": median_ms(bwd, iters, warmup, setup=setup)}


def stage_cost(forward_ms: Sequence[float], backward_ms: Sequence[float]) -> list[float]:
  """Compute (ms) of each stage per tick: ``F_j + B_j``, the last stage ``B_j``.

  The last stage's backward step already contains its forward.
  """
  costs = [f + b for f, b in zip(forward_ms, backward_ms)]
  costs[-1] = backward_ms[-1]
  return costs


def measure_stage_costs(stages: Sequence[Stage], input_shape: Sequence[int],
                        num_classes: int, device: Optional[jax.Device] = None,
                        iters: int = 3, warmup: int = 1, seed: int = 0,
                        method: str = "petra") -> list[float]:
  """Measured compute per tick (ms) of each stage on one device.

  Builds a throw-away pipeline of ``stages`` on ``device``, times each
  stage's jitted forward and backward (:func:`stage_times`, random inputs) and
  returns :func:`stage_cost`. Compiles every stage once more than training
  does (about 1-2 s per block for the CPU recipe's models).

  Args:
    stages: the stages (typically one block each, from
      :func:`petra_jax.models.build_model`).
    input_shape: a micro-batch's shape ``[B, H, W, C]``.
    num_classes: classes of the head (labels are drawn below it).
    device: where to time (default ``jax.local_devices()[0]``).
    iters, warmup: measured and unmeasured calls per step.
    seed: initialisation and data seed.
    method: the method whose steps are timed (a name in
      :data:`petra_jax.engine.methods.METHODS`: ``"petra"`` reconstructs in
      reversible stages, ``"dsp"``, ``"delayed"``, ``"1f1b"``... recompute
      from buffered inputs, the only choice for a ResNet).

  Returns:
    ``len(stages)`` floats, ms per tick (forward plus backward; the last
    stage's backward alone, which contains its forward).
  """
  device = device or jax.local_devices()[0]
  pipe = Pipeline(stages, optax.sgd(1e-3), [device], method=method)
  rng = np.random.default_rng(seed)
  images = jax.device_put(rng.normal(size=tuple(input_shape)).astype(np.float32), device)
  labels = jax.device_put(rng.integers(0, num_classes, input_shape[0]).astype(np.int32), device)
  rows, _ = stage_times(pipe, pipe.init(seed, images), images, labels, iters, warmup)
  return stage_cost([r["forward"] for r in rows], [r["backward"] for r in rows])
