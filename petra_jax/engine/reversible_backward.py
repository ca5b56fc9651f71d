"""PaReprop: a reversible stage's backward with reconstruction and gradient overlapped.

PaReprop (Zhu, Mangalam et al., "PaReprop: Fast Parallelized Reversible
Backpropagation", 2023) observes that in a reversible backward, block ``i``'s
reconstruction of its input (handed to block ``i - 1``) does not depend on
block ``i``'s gradients. The vanilla backward of a group of ``n`` reversible
blocks (:func:`petra_jax.engine.stage.reverse_vjp`) runs, last block first,
``reconstruct_i -> vjp_i -> reconstruct_{i-1} -> vjp_{i-1} -> ...``. Here it is
software-pipelined over the blocks (:func:`pareprop_vjp`); with ``y_i`` block
``i``'s output and ``dy_i`` its cotangent, the carry into step ``i`` is
``(y_i, x~_i = y_{i-1}, dy_i)``: block ``i``'s output, its already
reconstructed input (the next block's output) and the cotangent. Step ``i``
computes two independent things::

  gradient of block i:          dy_i (vjp recorded at y_i) -> (dtheta_i, dy_{i-1})  (Eq. 5 rows 3-4)
  reconstruction for block i-1: y_{i-1} -> x~_{i-1} = y_{i-2}, its vjp recorded   (Eq. 5 row 2)

and the carry moves on to ``(y_{i-1}, y_{i-2}, dy_{i-1})``. A prologue
reconstructs block ``n - 1``'s input; the last step (block 0) reconstructs
nothing. Every depth ``n >= 1`` is handled by the same loop (the authors'
``len(layers) - 1 % 2 == 0`` parses as ``len(layers) - 1 == 0`` and gives the
last block of an odd depth >= 3 a stale cotangent; there is no parity case
here). The reconstruction of a block records its vjp (``F`` evaluated once,
:func:`petra_jax.engine.stage.reconstruct_with_vjp`), and the carry takes
that pending backward to the next step, where the gradient is taken: the
flops are the vanilla backward's. (PaReprop's PyTorch code re-runs each
block's forward with autograd on for the gradient; written that way here, the
second evaluation was measured to survive XLA's optimisations: 22 % more
flops for a 2-layer RevViT, per XLA's cost analysis, and 0.7-0.9x vanilla's
speed on this CPU.) In one jitted program this is the vanilla backward's
dataflow graph, ordered differently: XLA schedules a graph, not the Python
order, and the two chains were independent in vanilla too.

Streams. The authors run the two chains on two CUDA streams. JAX 0.10
(installed here) offers ``jax.experimental.compute_on.compute_on("gpu_stream:N")``,
which tags a jitted call with ``_xla_stream_annotation`` for XLA:GPU (behind
``--xla_gpu_experimental_stream_annotation``); it is not used here, and not
tried: no GPU was available to this work. On the CPU there is no stream
annotation; both backwards are one jitted computation whose independent
operations XLA schedules as it likes. The measurement (images/s and peak
bytes of backprop, vanilla and PaReprop on one stage holding every reversible
block) is :mod:`petra_jax.benchmarks.reversible_backward`.

Only the backward of :func:`~petra_jax.engine.stage.reverse_vjp` (methods
``petra`` and ``revprop``) is chosen by ``config.model.reversible_backward``;
``approximate_input``'s stashed-weights backward stays block by block.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from petra_jax.engine import stage as stage_lib
from petra_jax.engine.stage import Stage

BACKWARDS = ("vanilla", "pareprop")


def pareprop_vjp(stage: Stage, params, batch_stats, y, dy):
  """Backward of a reversible group, reconstruction one block ahead of the vjp.

  Same contract and results (to float32 round-off) as
  :func:`petra_jax.engine.stage.reverse_vjp` on a group.

  Args:
    stage: a reversible group (:func:`petra_jax.engine.stage.group`) of
      ``n >= 1`` blocks; its variables under ``"block_0"``, ``"block_1"``...
    params, batch_stats: the group's current variables.
    y: the group's output streams ``(y1, y2, *carried)``.
    dy: their cotangent, same structure.

  Returns:
    ``(x_tilde, dx, dparams, new_batch_stats)``: the reconstructed input,
    its cotangent, the parameter gradients and the running statistics of the
    gradient pass, per block.

  Raises:
    ValueError: ``stage`` is not a reversible group.
  """
  if not (stage.reversible and stage.blocks):
    raise ValueError(f"PaReprop's backward needs a group of reversible blocks; stage "
                     f"{stage.name!r} is not one: use model.reversible_backward='vanilla'.")
  blocks, key = stage.blocks, lambda i: f"block_{i}"
  n = len(blocks)
  # Prologue: block n-1's input, reconstructed with its vjp recorded.
  x_next, pending = stage_lib.reconstruct_with_vjp(
      blocks[n - 1], params[key(n - 1)], batch_stats[key(n - 1)], y)
  grads, stats = {}, {}
  for i in reversed(range(n)):
    # Two independent computations: block i's gradient (its recorded vjp at
    # dy), and block i-1's reconstruction (with its vjp) from x_next.
    dy, grads[key(i)], stats[key(i)] = pending(dy)
    y = x_next
    if i > 0:
      x_next, pending = stage_lib.reconstruct_with_vjp(
          blocks[i - 1], params[key(i - 1)], batch_stats[key(i - 1)], y)
  return y, dy, grads, stats


def with_reversible_backward(stages: Sequence[Stage], backward: str) -> list[Stage]:
  """``stages`` with every block (and group) using ``backward``.

  Args:
    stages: a model's stages.
    backward: one of :data:`BACKWARDS` (``config.model.reversible_backward``).

  Raises:
    ValueError: an unknown ``backward``.
  """
  if backward not in BACKWARDS:
    raise ValueError(f"Unknown reversible backward {backward!r}; choose one of {BACKWARDS} "
                     "(--config.model.reversible_backward=...).")
  def one(s: Stage) -> Stage:
    return dataclasses.replace(s, reversible_backward=backward,
                               blocks=tuple(one(b) for b in s.blocks))
  return [one(s) for s in stages]
