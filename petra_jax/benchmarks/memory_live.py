"""Live checks of the memory model: what a running pipeline holds (paper Table 6).

* :func:`measure_live`: runs PETRA to steady state and reads the bytes each
  stage holds in ``state.buffers[j]`` and the bytes one tick sends, to check
  :mod:`petra_jax.benchmarks.memory_model` against the devices.
* :func:`device_memory`: each stage's peak device memory (state + PETRA
  buffers + the working set of its compiled steps, from XLA's memory
  analysis), compiled at the full size without running anything.
"""

from __future__ import annotations

from typing import Optional, Sequence

import petra_jax  # noqa: F401  (applies the XLA-CPU work-around)
import jax
import jax.numpy as jnp
import numpy as np
import optax

from petra_jax.benchmarks.memory_model import first_stream, stage_bytes, stored_bytes
from petra_jax.engine import quantize as quantize_lib
from petra_jax.engine import schedule
from petra_jax.engine.pipeline import Pipeline
from petra_jax.engine.stage import Stage


def measure_live(stages: Sequence[Stage], image_shape: Sequence[int], batch_size: int,
                 num_classes: int = 10, seed: int = 0,
                 formats: Optional[quantize_lib.MessageFormats] = None) -> dict:
  """Runs PETRA to steady state and reads what each stage holds.

  Feeds ``2(J-1) + 1`` micro-batches (one per tick) of random float32
  images ``[B, H, W, C]`` on one device; after the last tick every stage has
  ``tau_j`` micro-batches between its forward and its backward.

  Args:
    stages: a model from :func:`petra_jax.models.build_model`.
    image_shape: ``(H, W, C)``.
    batch_size: micro-batch size ``B``.
    num_classes: classes of the head (the random labels' range).
    seed: initialisation and data seed.
    formats: the quantisation of messages and buffers (default: none).

  Returns:
    ``{"petra": [bytes per stage], "delayed": [...], "sizes": [...],
    "bytes_per_tick": int}``: ``petra`` sums ``nbytes`` over
    ``state.buffers[j]``; ``delayed`` is what stashing every stage's input
    and parameters ``tau_j`` times would hold, with the sizes read from the
    live arrays (``sizes``, as :func:`petra_jax.benchmarks.memory_model.stage_bytes`);
    ``bytes_per_tick`` sums the messages sent on the last tick (each then
    waits in its receiver's inbox), as held on the devices under ``formats``.
  """
  pipe = Pipeline(stages, optax.sgd(1e-3), jax.devices()[:1], formats=formats)
  rng = np.random.default_rng(seed)
  images = jnp.asarray(rng.normal(size=(batch_size, *image_shape)), jnp.float32)
  labels = jnp.asarray(rng.integers(0, num_classes, batch_size), jnp.int32)
  state = pipe.init(seed, images)
  fill = schedule.drain_ticks(pipe.num_stages) + 1  # then every stage holds tau_j
  table = pipe.schedule(fill)
  state, _ = pipe.run(state, (table[t] for t in range(fill)), lambda m: (images, labels))
  jax.block_until_ready(state.train_states)
  size = quantize_lib.nbytes
  sizes = []
  for j, s in enumerate(stages):
    x = images if j == 0 else next(iter(state.inbox[j].values()))  # its next input
    sizes.append({"name": s.name, "reversible": s.reversible,
                  "delay": schedule.delay(j, pipe.num_stages),
                  "input_bytes": size(x), "input_x1_bytes": size(first_stream(x)),
                  "param_bytes": size(state.train_states[j].params)})
  sent = sum(size(p) for box in state.inbox[1:] + state.grad_inbox for p in box.values())
  return {"petra": state.stored_bytes(), "delayed": stored_bytes(sizes, "delayed"),
          "sizes": sizes, "bytes_per_tick": sent}


def device_memory(stages: Sequence[Stage], image_shape: Sequence[int], batch_size: int,
                  num_classes: int = 10,
                  tx: Optional[optax.GradientTransformation] = None) -> list[dict]:
  """Estimated peak device memory of each stage training with PETRA (Table 6).

  Stage ``j`` on its own device holds its state (parameters, BatchNorm
  statistics, optimizer state), its PETRA buffers (``tau_j`` inputs if it is
  not reversible, none if it is) and, while a step runs, that step's working
  set. The working set comes from XLA's memory analysis of the compiled
  forward and backward steps (``Compiled.memory_analysis()``: arguments other
  than the state + outputs - donated aliases + temporaries), so it is what
  this backend would allocate, without running anything. It counts the
  non-reversible stages' buffered input once more (the one being consumed).

  Args:
    stages: a model from :func:`petra_jax.models.build_model`.
    image_shape: ``(H, W, C)``.
    batch_size: micro-batch size.
    num_classes: classes of the head.
    tx: the optimizer (default SGD with momentum, the paper's: one slot
      per parameter).

  Returns:
    One dict per stage: ``name``, ``state_bytes``, ``buffer_bytes``,
    ``forward_bytes``, ``backward_bytes`` (working sets) and ``total_bytes``
    (state + buffers + the larger working set).

  Raises:
    RuntimeError: the backend gives no memory analysis.
  """
  del num_classes  # the head's width comes from the stages
  pipe = Pipeline(stages, tx or optax.sgd(0.1, momentum=0.9), jax.devices()[:1])
  state = pipe.init(0, jnp.zeros((1, *image_shape), jnp.float32))
  specs = pipe.message_specs(jax.ShapeDtypeStruct((batch_size, *image_shape), jnp.float32))
  labels = jax.ShapeDtypeStruct((batch_size,), jnp.int32)
  buffers = stored_bytes(stage_bytes(stages, image_shape, batch_size), "petra")
  rows = []
  for j, s in enumerate(stages):
    st = state.train_states[j]
    state_bytes = quantize_lib.nbytes(st)
    bwd_args = pipe.steps.backward_args(j, x=specs[j], y=specs[j + 1], dy=specs[j + 1],
                                        labels=labels)
    working = [_working_set(fn, st, args, state_bytes)
               for fn, args in zip(pipe.steps.jitted_steps(j), ((specs[j],), bwd_args))]
    rows.append({"name": s.name, "state_bytes": state_bytes, "buffer_bytes": buffers[j],
                 "forward_bytes": working[0], "backward_bytes": working[1],
                 "total_bytes": state_bytes + buffers[j] + max(working)})
  return rows


def _working_set(fn, train_state, args, state_bytes: int) -> int:
  """Bytes a compiled step allocates beyond the stage's state: arguments
  other than the state + outputs - donated aliases + temporaries.

  Raises:
    RuntimeError: the backend gives no memory analysis.
  """
  ma = fn.lower(train_state, *args).compile().memory_analysis()
  if ma is None:
    raise RuntimeError(f"backend {jax.default_backend()!r} gives no memory analysis.")
  return int(ma.argument_size_in_bytes - state_bytes + ma.output_size_in_bytes
             - ma.alias_size_in_bytes + ma.temp_size_in_bytes)
