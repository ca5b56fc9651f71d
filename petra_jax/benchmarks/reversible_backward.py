"""PaReprop's benchmark: one stage of reversible blocks, three backwards side by side.

On the longest run of consecutive reversible blocks, grouped into one stage, times one
micro-batch's backward as ``backprop`` (``jax.vjp`` from the input), ``vanilla`` (reconstruct
then vjp, block by block, from the output) and ``pareprop`` (reconstruction one block ahead),
in interleaved rounds, with XLA's peak and temporary bytes of each compiled call.
"""

from __future__ import annotations

import statistics
import time
from typing import Sequence

import jax
import numpy as np

from petra_jax.engine.stages import stage as stage_lib
from petra_jax.engine.stages.stage import Stage

BACKWARDS = ("backprop", "vanilla", "pareprop")


def reversible_run(stages: Sequence[Stage]) -> tuple[int, int]:
  """``(start, stop)`` of the longest run of consecutive reversible blocks; ValueError if none."""
  best, start = (0, 0), None
  for i, s in enumerate(list(stages) + [None]):
    if s is not None and s.reversible and not s.blocks:
      start = i if start is None else start
      continue
    if start is not None and i - start > best[1] - best[0]:
      best = (start, i)
    start = None
  if best == (0, 0):
    raise ValueError("the model has no reversible block; use a RevNet or RevViT.")
  return best


def _inputs(stages, start, stop, input_shape, batch_size, seed):
  """Variables of the reversible group, its input ``x``, output ``y`` and a cotangent ``dy``."""
  rng = np.random.default_rng(seed)
  h = rng.normal(size=(batch_size, *input_shape)).astype(np.float32)
  key = jax.random.key(seed)
  for j, s in enumerate(stages[:start]):
    v = s.init(jax.random.fold_in(key, j), h)
    h = stage_lib.forward(s, v["params"], v["batch_stats"], h)[0]
  body = stage_lib.group(stages[start:stop], name="reversible_body")
  if not body.blocks:  # one block: a group of one, so both backwards apply
    body = Stage(body.name, None, True, (body,))
  v = body.init(jax.random.fold_in(key, start), h)
  y = stage_lib.forward(body, v["params"], v["batch_stats"], h)[0]
  dy = jax.tree.map(lambda a: rng.normal(size=a.shape).astype(np.float32), y)
  return body, v["params"], v["batch_stats"], h, y, dy


def _functions(body: Stage, stats):
  """``{backward: jitted fn(params, x_or_y, dy)}``."""
  def backprop(p, x, dy):
    return jax.vjp(lambda p, x: stage_lib.forward(body, p, stats, x)[0], p, x)[1](dy)

  def reversible(kind):
    group = Stage(body.name, None, True, body.blocks, reversible_backward=kind)
    return lambda p, y, dy: stage_lib.reverse_vjp(group, p, stats, y, dy)[:3]
  return {"backprop": jax.jit(backprop), "vanilla": jax.jit(reversible("vanilla")),
          "pareprop": jax.jit(reversible("pareprop"))}


def measure(stages: Sequence[Stage], input_shape: Sequence[int], batch_size: int,
            iters: int = 5, warmup: int = 1, seed: int = 0) -> dict:
  """The throughput benchmark's ``reversible_backward`` report (``stages``: one block each).

  Raises:
    ValueError: no reversible block in ``stages``.
  """
  start, stop = reversible_run(stages)
  body, params, stats, x, y, dy = _inputs(stages, start, stop, input_shape, batch_size, seed)
  fns = _functions(body, stats)
  args = {"backprop": (params, x, dy), "vanilla": (params, y, dy), "pareprop": (params, y, dy)}
  peak, temp = {}, {}
  for name, fn in fns.items():
    ma = fn.lower(*args[name]).compile().memory_analysis()
    temp[name] = int(ma.temp_size_in_bytes) if ma is not None else -1
    peak[name] = (int(ma.argument_size_in_bytes + ma.output_size_in_bytes
                      - ma.alias_size_in_bytes + ma.temp_size_in_bytes)
                  if ma is not None else -1)
  times = {name: [] for name in fns}
  for r in range(warmup + iters):
    for name, fn in fns.items():
      t0 = time.perf_counter()
      jax.block_until_ready(fn(*args[name]))
      if r >= warmup:
        times[name].append(1e3 * (time.perf_counter() - t0))
  ms = {name: statistics.median(t) for name, t in times.items()}
  return {
      "blocks": [b.name for b in body.blocks], "batch_size": batch_size,
      "images_per_s": {n: 1e3 * batch_size / m for n, m in ms.items()}, "ms": ms,
      "peak_bytes": peak, "temp_bytes": temp,
      "pareprop_speedup_over_vanilla": ms["vanilla"] / ms["pareprop"],
      "backend": jax.default_backend(),
  }


def print_report(r: dict) -> None:
  """The table printed by the throughput CLI for the ``reversible_backward`` key."""
  print(f"one stage of {len(r['blocks'])} reversible blocks ({r['blocks'][0]} .. "
        f"{r['blocks'][-1]}), batch {r['batch_size']}, backward only:")
  for name in BACKWARDS:
    print(f"  {name:<9} {r['images_per_s'][name]:9.1f} images/s  {r['ms'][name]:9.1f} ms  "
          f"peak {r['peak_bytes'][name] / 2**20:8.1f} MiB  (temporaries "
          f"{r['temp_bytes'][name] / 2**20:.1f} MiB)")
  print(f"  PaReprop over vanilla: {r['pareprop_speedup_over_vanilla']:.3f}x")


if __name__ == "__main__":
  import sys  # pylint: disable=g-import-not-at-top
  from petra_jax.benchmarks import cli  # pylint: disable=g-import-not-at-top
  sys.exit(cli.library_main("reversible_backward", "throughput"))
