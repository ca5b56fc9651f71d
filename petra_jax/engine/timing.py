"""Wall-clock timing of pipeline steps (ms, each result waited for) and per-stage costs."""

from __future__ import annotations

import statistics
import time
from typing import Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from petra_jax.engine.pipeline import Pipeline
from petra_jax.engine.stages.stage import Stage
from petra_jax.engine.methods.tasks import copy_tree


def median_ms(step: Callable[[], object], iters: int, warmup: int = 1,
              setup: Optional[Callable[[], None]] = None) -> float:
  """Median wall time (ms) of ``step()``, ``iters`` calls after ``warmup``; ``setup`` untimed."""
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
  """Median ms of each stage's jitted forward and backward, on one micro-batch.

  Returns ``(rows, activations)``: per stage ``{"forward", "backward"}`` ms, and
  the stage inputs ``[images, x_1, ..., x_{J-1}]``.
  """
  J = pipe.num_stages
  acts = [images]
  for j in range(J - 1):
    acts.append(pipe.steps[j].forward(state.stage_states[j], acts[j])[0])
  rows = []
  for j in range(J):
    y = acts[j + 1] if j < J - 1 else None
    rows.append(one_stage_times(pipe, state, j, acts[j], y, labels, iters, warmup))
  return rows, acts


def one_stage_times(pipe: Pipeline, state, j: int, x, y, labels, iters: int,
                    warmup: int = 1) -> dict:
  """Median ms of stage ``j``'s forward and backward (cotangent ones; ``y`` None for the last).

  Returns ``{"name", "reversible", "forward": ms, "backward": ms}``; donates
  ``state.stage_states[j]``.
  """
  stage, box = pipe.stages[j], {"args": None}
  fwd = median_ms(lambda: pipe.steps[j].forward(state.stage_states[j], x), iters, warmup)

  def setup():
    box["args"] = copy_tree(pipe.steps[j].backward_args(
        x=x, y=y, dy=None if y is None else jax.tree.map(jnp.ones_like, y),
        labels=labels, stashed=state.train_states[j].params))
    return box["args"]

  def bwd():
    out = pipe.steps[j].backward(state.stage_states[j], *box["args"])
    state.stage_states[j] = out[0]
    return out
  return {"name": stage.name, "reversible": stage.reversible, "forward": fwd,
          "backward": median_ms(bwd, iters, warmup, setup=setup)}


def stage_cost(forward_ms: Sequence[float], backward_ms: Sequence[float]) -> list[float]:
  """Compute (ms) per tick: ``F_j + B_j``; the last stage ``B_j`` (it holds its forward)."""
  costs = [f + b for f, b in zip(forward_ms, backward_ms)]
  costs[-1] = backward_ms[-1]
  return costs


def measure_stage_costs(stages: Sequence[Stage], input_shape: Sequence[int],
                        num_classes: int, device: Optional[jax.Device] = None,
                        iters: int = 3, warmup: int = 1, seed: int = 0,
                        method: str = "petra") -> list[float]:
  """Measured ms per tick of each stage on ``device`` (:func:`stage_cost`).

  ``input_shape``: a micro-batch ``[B, H, W, C]``; ``method``: a name in
  :data:`petra_jax.engine.methods.METHODS`.
  """
  device = device or jax.local_devices()[0]
  pipe = Pipeline(stages, optax.sgd(1e-3), [device], method=method)
  rng = np.random.default_rng(seed)
  images = jax.device_put(rng.normal(size=tuple(input_shape)).astype(np.float32), device)
  labels = jax.device_put(rng.integers(0, num_classes, input_shape[0]).astype(np.int32), device)
  rows, _ = stage_times(pipe, pipe.init(seed, images), images, labels, iters, warmup)
  return stage_cost([r["forward"] for r in rows], [r["backward"] for r in rows])
