"""What a running pipeline holds (paper Table 6): live buffers and XLA's per-stage device memory."""

from __future__ import annotations

from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from petra_jax.benchmarks.memory.model import first_stream, stage_bytes, stored_bytes
from petra_jax.engine.arrays import quantize as quantize_lib
from petra_jax.engine import schedules as schedule
from petra_jax.engine.pipeline import Pipeline
from petra_jax.engine.stages.stage import Stage


def measure_live(stages: Sequence[Stage], image_shape: Sequence[int], batch_size: int,
                 num_classes: int = 10, seed: int = 0,
                 formats: Optional[quantize_lib.MessageFormats] = None) -> dict:
  """Bytes each stage holds after ``2(J-1) + 1`` ticks of PETRA on random float32 ``[B, H, W, C]``.

  Returns:
    ``{"petra": [bytes in state.buffers[j]], "delayed": [bytes if inputs and parameters were
    stashed tau_j times], "sizes": [stage_bytes rows, from live arrays], "bytes_per_tick": int}``.
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
  """Per stage, peak device bytes with PETRA (Table 6), compiled but not run.

  Returns one dict per stage: ``state_bytes``, ``buffer_bytes``, the steps' working sets
  ``forward_bytes``/``backward_bytes`` (XLA's memory analysis) and ``total_bytes``
  (state + buffers + the larger working set). ``tx`` defaults to SGD with momentum.

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
    bwd_args = pipe.steps[j].backward_args(x=specs[j], y=specs[j + 1], dy=specs[j + 1],
                                           labels=labels)
    working = [_working_set(fn, st, args, state_bytes)
               for fn, args in zip(pipe.steps[j].jitted_steps(), ((specs[j],), bwd_args))]
    rows.append({"name": s.name, "state_bytes": state_bytes, "buffer_bytes": buffers[j],
                 "forward_bytes": working[0], "backward_bytes": working[1],
                 "total_bytes": state_bytes + buffers[j] + max(working)})
  return rows


def _working_set(fn, train_state, args, state_bytes: int) -> int:
  """Bytes a compiled step allocates beyond the state: arguments - state + outputs - aliases
  + temporaries. RuntimeError if the backend gives no memory analysis."""
  ma = fn.lower(train_state, *args).compile().memory_analysis()
  if ma is None:
    raise RuntimeError(f"backend {jax.default_backend()!r} gives no memory analysis.")
  return int(ma.argument_size_in_bytes - state_bytes + ma.output_size_in_bytes
             - ma.alias_size_in_bytes + ma.temp_size_in_bytes)


if __name__ == "__main__":
  import sys  # pylint: disable=g-import-not-at-top
  from petra_jax.benchmarks import cli  # pylint: disable=g-import-not-at-top
  sys.exit(cli.library_main("memory.live", "memory"))
