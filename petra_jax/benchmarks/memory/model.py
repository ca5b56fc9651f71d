"""The analytic memory model: bytes each stage stores, from shapes only (paper Table 3).

Stage ``j`` of ``J`` keeps ``tau_j = 2(J-1-j)`` micro-batches in flight under
the stream methods (how many a stage holds at most comes from the method's
schedule table, :func:`peak_held`; ``gpipe`` and
``1f1b`` hold up to ``k`` per update). For each one it stores its input if it
buffers inputs (:func:`petra_jax.engine.methods.keeps`: always
for a non-reversible stage) and a copy of its parameters if the method
stashes weights:

================= ============ ============ ==============================
method            input buffer param buffer
================= ============ ============ ==============================
delayed           yes          yes          PipeDream-like delayed gradients
dsp               yes          no           Xu et al. / DSP
approximate_input no           yes
petra             no           no           only non-reversible stages store
================= ============ ============ ==============================

Shapes come from :func:`jax.eval_shape`, so full-size models cost nothing.

A reversible coupling ``(y1, y2) = (x2 + F(x1), x1)`` needs only ``x1`` to
compute its gradients, so a delayed-gradient method can stash one stream of a
reversible stage's input (``rev_stash="x1"``, the default of Table 3) rather
than both (``"both"``, what the authors' code stores: 1911.3 MiB for RevNet18
on CIFAR-10, batch 64).

Table 3's model: model size (parameter bytes) + input buffers (the first
stage's excluded: it re-reads the dataset) + parameter buffers, in GB
(``10^9`` bytes), with savings against the ``delayed`` row.
"""

from __future__ import annotations

from typing import Optional, Sequence

import jax
import jax.numpy as jnp

from petra_jax.engine import methods as methods_lib
from petra_jax.engine.arrays import quantize as quantize_lib
from petra_jax.engine import schedules as schedule
from petra_jax.engine.stages import stage as stage_lib
from petra_jax.engine.stages.stage import Stage

# Table 3's rows, in its order: (input buffer, param buffer) = (Y, Y), (Y, N),
# (N, Y), (N, N).
TABLE3_METHODS = ("delayed", "dsp", "approximate_input", "petra")
# Every method whose stored bytes the report lists.
METHODS = TABLE3_METHODS + tuple(n for n, m in methods_lib.METHODS.items() if m.schedule.flushed)
MIB = 2**20
GB = 1e9
PAPER_TABLE3 = [(44.5, 0.0), (43.6, 2.0), (21.2, 52.3), (20.3, 54.3)]  # GB, saving %


def held(table: schedule.Schedule) -> list[list[int]]:
  """Micro-batches each stage holds after each tick: its family's ``holds`` task run (forward), its ``frees`` task (backward) not.

  Returns:
    ``[tick][stage]`` counts. Multiplied by what a stage keeps per micro-batch
    (its input, its weights), this is the memory the schedule costs. The
    last stage and ``backprop`` tasks keep nothing across ticks.
  """
  J, holds, frees = table.num_stages, table.family.holds, table.family.frees
  count, out = [0] * J, []
  for tick in table:
    for task in tick:
      if task.kind in holds:
        count[task.stage] += 1
      elif task.kind == frees:
        count[task.stage] -= 1
    out.append(list(count))
  return out


def peak_held(table: schedule.Schedule) -> list[int]:
  """``max`` over ticks of :func:`held`, per stage."""
  rows = held(table)
  return [max((row[j] for row in rows), default=0) for j in range(table.num_stages)]


def _buffered(x, j: int, formats: quantize_lib.MessageFormats):
  """Shapes of what stage ``j`` buffers for input ``x``: the buffer format,
  or (``"none"``) the message as received (images at stage 0)."""
  if formats.buffer != "none":
    return formats.spec("buffer", x)
  return formats.spec("forward", x) if j > 0 else x


def first_stream(x):
  """``x1`` of a two-stream input ``(x1, x2)``, else ``x`` itself."""
  return x[0] if isinstance(x, tuple) else x


def stage_bytes(stages: Sequence[Stage], image_shape: Sequence[int], batch_size: int,
                dtype=jnp.float32,
                formats: Optional[quantize_lib.MessageFormats] = None) -> list[dict]:
  """Per-stage input, message and parameter bytes, from shapes only (no compute).

  Args:
    stages: a model from :func:`petra_jax.models.build_model`.
    image_shape: ``(H, W, C)`` of one input image.
    batch_size: micro-batch size ``B``; the images are ``[B, H, W, C]``.
    dtype: the images' dtype.
    formats: the quantisation of messages and buffers (default: none).

  Returns:
    One dict per stage: ``name``, ``reversible``, ``delay`` (``tau_j``),
    ``input_bytes`` (its whole input activation, both streams, as buffered
    under ``formats``), ``input_x1_bytes`` (the first stream of a
    two-stream input, else the whole input), ``param_bytes``,
    ``forward_message_bytes`` (its output sent to stage ``j+1``; 0 for the
    last stage) and ``backward_message_bytes`` (``(x~, delta)`` sent to
    stage ``j-1`` under PETRA, ``x~`` only when that stage is reversible;
    0 for stage 0).
  """
  formats = formats or quantize_lib.MessageFormats()
  x = jax.ShapeDtypeStruct((batch_size, *image_shape), dtype)
  last, size = len(stages) - 1, quantize_lib.nbytes
  rows = []
  for j, (s, (variables, y)) in enumerate(zip(stages, stage_lib.trace(stages, x))):
    buf, back = _buffered(x, j, formats), formats.spec("backward", x)
    rows.append({
        "name": s.name,
        "reversible": s.reversible,
        "delay": schedule.delay(j, len(stages)),
        "input_bytes": size(buf),
        "input_x1_bytes": size(first_stream(buf)),
        "param_bytes": size(variables["params"]),
        "forward_message_bytes": size(formats.spec("forward", y)) if j < last else 0,
        "backward_message_bytes": (size(back) * (2 if stages[j - 1].reversible else 1)
                                   if j > 0 else 0),
    })
    x = y
  return rows


def bytes_per_tick(sizes: Sequence[dict]) -> int:
  """Bytes every stage sends in one steady-state PETRA tick: each stage one
  forward message and one backward message (:func:`stage_bytes` rows)."""
  return sum(r["forward_message_bytes"] + r["backward_message_bytes"] for r in sizes)


def _entry_bytes(r: dict, j: int, m: methods_lib.Method, rev_stash: str,
                 first_input: bool) -> int:
  """Bytes stage ``j`` (row ``r``) stores per micro-batch in flight under ``m``."""
  entry = r["param_bytes"] if m.stashes_weights else 0
  if methods_lib.keeps(m, r["reversible"]).input and (j > 0 or first_input):
    one_stream = r["reversible"] and rev_stash == "x1"
    entry += r["input_x1_bytes"] if one_stream else r["input_bytes"]
  return entry


def stored_bytes(sizes: Sequence[dict], method: str, *, rev_stash: str = "both",
                 first_input: bool = True, accumulation_steps: int = 1) -> list[int]:
  """Peak bytes stage ``j`` holds between forward and backward.

  The method's schedule table gives how many micro-batches each stage holds
  at most (:func:`peak_held`: ``tau_j`` for the stream
  methods); each one costs the stage's input if it buffers it
  (:func:`petra_jax.engine.methods.keeps`) plus its
  parameters if the method stashes weights.

  Args:
    sizes: :func:`stage_bytes` (or :func:`petra_jax.benchmarks.memory.live.measure_live`'s
      ``sizes``).
    method: a name in :data:`METHODS`.
    rev_stash: ``"both"`` streams or only ``"x1"`` of a reversible stage's
      input when the method buffers it.
    first_input: count stage 0's input buffer (Table 3 does not).
    accumulation_steps: ``k`` (the round of ``gpipe`` and ``1f1b``).

  Returns:
    Bytes per stage, stage 0 first.

  Raises:
    ValueError: unknown ``method`` or ``rev_stash``.
  """
  if method not in METHODS:
    raise ValueError(f"Unknown method {method!r}; choose one of {list(METHODS)}.")
  if rev_stash not in ("both", "x1"):
    raise ValueError(f"rev_stash must be 'both' or 'x1', got {rev_stash!r}")
  m = methods_lib.get(method)
  J, k = len(sizes), accumulation_steps
  peaks = peak_held(schedule.Schedule(m.schedule, J, k * 2 * J, k))
  return [peaks[j] * _entry_bytes(r, j, m, rev_stash, first_input) for j, r in enumerate(sizes)]


def table3(sizes: Sequence[dict], rev_stash: str = "x1") -> list[dict]:
  """Paper Table 3's model: model + input buffers + parameter buffers.

  The model size is the parameter bytes; the first stage's input buffer is
  left out. Savings are against the first row (both buffers).

  Returns:
    Four dicts: ``method``, ``input_buffer``, ``param_buffer``,
    ``memory_gb`` (10^9 bytes) and ``saving_pct``.
  """
  model = sum(r["param_bytes"] for r in sizes)
  rows = []
  for method in TABLE3_METHODS:
    m = methods_lib.get(method)
    total = model + sum(stored_bytes(sizes, method, rev_stash=rev_stash, first_input=False))
    rows.append({"method": method, "input_buffer": m.pipelined and methods_lib.keeps(m, True).input,
                 "param_buffer": m.stashes_weights,
                 "memory_gb": total / GB})
  for r in rows:
    r["saving_pct"] = 100.0 * (1.0 - r["memory_gb"] / rows[0]["memory_gb"])
  return rows


def table3_extended(sizes: Sequence[dict], quantized: dict[str, Sequence[dict]],
                    reversible_sizes: Optional[Sequence[dict]] = None,
                    rev_stash: str = "x1") -> list[dict]:
  """Table 3's model with PETRA's rows beyond the paper.

  Args:
    sizes: :func:`stage_bytes` of the model, float buffers.
    quantized: buffer format -> :func:`stage_bytes` with that buffer format.
    reversible_sizes: :func:`stage_bytes` of the model's all-reversible
      (``_inv``) variant, if it has one.
    rev_stash: as :func:`table3`.

  Returns:
    :func:`table3`'s four rows, then ``petra`` with each quantised buffer
    and ``petra`` on the ``_inv`` model (then each quantised buffer), each
    with ``model``, ``buffer_format`` and ``saving_pct`` against the first
    (``delayed``, float) row.
  """
  rows = [dict(r, model="", buffer_format="none") for r in table3(sizes, rev_stash)]
  base = rows[0]["memory_gb"]
  extra = [("", fmt, rows_) for fmt, rows_ in quantized.items()]
  if reversible_sizes is not None:
    extra.insert(0, ("_inv", "none", reversible_sizes))
  for model, fmt, rows_ in extra:
    total = (sum(r["param_bytes"] for r in rows_)
             + sum(stored_bytes(rows_, "petra", rev_stash=rev_stash, first_input=False)))
    rows.append({"method": "petra", "model": model, "buffer_format": fmt,
                 "input_buffer": False, "param_buffer": False, "memory_gb": total / GB,
                 "saving_pct": 100.0 * (1.0 - total / GB / base)})
  return rows


if __name__ == "__main__":
  import sys  # pylint: disable=g-import-not-at-top
  from petra_jax.benchmarks import cli  # pylint: disable=g-import-not-at-top
  sys.exit(cli.library_main("memory.model", "memory"))
