"""Per-op-kind profile of one training step on the CPU (``jax.profiler``).

``python -m petra_jax.benchmarks.profile_step --model=revnet18 --dataset=cifar10 --width=64
--batch-size=64 [--iters=3] [--batchnorm=fast|flax] [--json]`` traces ``backprop`` (``jax.grad``
of the model) and PETRA's per-stage forwards and backwards, classifies each XLA kernel from the
compiled HLO (:data:`OP_CATEGORIES`) and reports ms per step per kind, the wall ms and ``untraced``
(wall minus traced kernels; XLA-CPU traces only the launch of its asynchronous convolutions).
"""

from __future__ import annotations

import collections
import contextlib
import functools
import glob
import gzip
import json
import re
import sys
import tempfile
import time
from typing import Optional, Sequence

from petra_jax import data as data_lib
from petra_jax.benchmarks import cli
from petra_jax.engine.stages import stage as stage_lib
from petra_jax.models import layers
import flax.linen as nn
import jax
import jax.numpy as jnp

OP_CATEGORIES = ("convolution", "reduction", "dot", "elementwise", "layout", "other")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*\S+(?:\[[^\]]*\])?\S*\s+([\w\-]+)\(")
_COMP = re.compile(r"^\s*(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_CALLS = re.compile(r"calls=%?([\w.\-]+)")


class FlaxBatchNorm(nn.BatchNorm):
  """``flax.linen.BatchNorm`` with the fast layer's ``relu`` flag (for ``--batchnorm=flax``)."""
  relu: bool = False

  def __call__(self, x, use_running_average=None, **kw):
    y = super().__call__(x, use_running_average, **kw)
    return nn.relu(y) if self.relu else y


@contextlib.contextmanager
def batchnorm_layer(name: str):
  """Within the block the models build ``name``'s BatchNorm; ValueError unless "fast" or "flax"."""
  if name not in ("fast", "flax"):
    raise ValueError(f"--batchnorm={name!r}: use 'fast' or 'flax'.")
  saved = layers.BatchNorm
  if name == "flax":
    layers.BatchNorm = functools.partial(FlaxBatchNorm, momentum=0.9, epsilon=1e-5)
  try:
    yield
  finally:
    layers.BatchNorm = saved


def op_kinds(hlo_text: str) -> dict:
  """Instruction name -> kind (:data:`OP_CATEGORIES`) for a compiled HLO module's text."""
  comps, current, opcode, calls = collections.defaultdict(set), None, {}, {}
  for line in hlo_text.splitlines():
    m = _INSTR.match(line)
    if m and current is not None:
      name, op = m.groups()
      comps[current].add(op)
      opcode[name] = op
      c = _CALLS.search(line)
      if c:
        calls[name] = c.group(1)
      continue
    m = _COMP.match(line)
    if m:
      current = m.group(1)
  kinds = {}
  for name, op in opcode.items():
    ops = comps.get(calls.get(name), set()) | {op}
    if ops & {"convolution"} or "conv" in name:
      kinds[name] = "convolution"
    elif ops & {"dot"}:
      kinds[name] = "dot"
    elif ops & {"reduce", "reduce-window"}:
      kinds[name] = "reduction"
    elif op in ("copy", "transpose") or (op == "fusion" and ops <= {
        "fusion", "copy", "transpose", "bitcast", "reshape", "parameter"}):
      kinds[name] = "layout"
    elif op == "fusion":
      kinds[name] = "elementwise"
    else:
      kinds[name] = "other"
  return kinds


def _parts(stages, batch_size, shape, num_classes):
  """Jitted programs and their arguments: ``{part: [(fn, args), ...]}``."""
  key = jax.random.key(0)
  x = jax.random.normal(key, (batch_size, *shape))
  labels = jnp.arange(batch_size) % num_classes
  variables, acts = [], [x]
  for j, s in enumerate(stages):
    variables.append(s.init(jax.random.fold_in(key, j), acts[-1]))
    acts.append(stage_lib.forward(s, variables[j]["params"], variables[j]["batch_stats"],
                                  acts[-1])[0])
  params = [v["params"] for v in variables]
  stats = [v["batch_stats"] for v in variables]
  grad = jax.jit(jax.grad(lambda p, bs: stage_lib.composed_loss(stages, p, bs, x, labels)[0]))
  parts = {"backprop": [(grad, (params, stats))], "petra_forward": [], "petra_backward": []}
  for j, s in enumerate(stages):
    v, a_in, a_out = (params[j], stats[j]), acts[j], acts[j + 1]
    parts["petra_forward"].append((jax.jit(functools.partial(stage_lib.forward, s)), (*v, a_in)))
    if j == len(stages) - 1:
      fn, args = functools.partial(stage_lib.loss_vjp, s), (*v, a_in, labels)
    elif s.reversible:
      fn, args = functools.partial(stage_lib.reverse_vjp, s), (*v, a_out, a_out)
    else:
      fn = functools.partial(stage_lib.recompute_vjp, s, input_grad=j > 0)
      args = (*v, a_in, a_out)
    parts["petra_backward"].append((jax.jit(fn), args))
  return parts


def _trace_events(run, iters):
  """``(events, wall_s)``: the kernel events (name, dur µs) of ``iters`` calls of ``run``."""
  with tempfile.TemporaryDirectory() as d:
    jax.profiler.start_trace(d, create_perfetto_trace=True)
    t = time.perf_counter()
    for _ in range(iters):
      run()
    wall = time.perf_counter() - t
    jax.profiler.stop_trace()
    path = glob.glob(f"{d}/**/*perfetto_trace.json.gz", recursive=True)[0]
    with gzip.open(path) as f:
      events = json.load(f)
  events = events["traceEvents"] if isinstance(events, dict) else events
  return [(e["name"], e["dur"]) for e in events if e.get("ph") == "X" and "dur" in e], wall


def profile(stages, batch_size: int, shape, num_classes: int, iters: int = 3) -> dict:
  """Per part, ms per step of each kernel kind, ``untraced`` and ``wall``."""
  report = {}
  for part, calls in _parts(stages, batch_size, shape, num_classes).items():
    kinds = {}
    for fn, args in calls:
      jax.block_until_ready(fn(*args))
      kinds.update(op_kinds(fn.lower(*args).compile().as_text()))

    def run(calls=calls):
      for fn, args in calls:
        jax.block_until_ready(fn(*args))
    events, wall = _trace_events(run, iters)
    ms = dict.fromkeys(OP_CATEGORIES, 0.0)
    for name, dur in events:
      if name in kinds:
        ms[kinds[name]] += dur / 1e3 / iters
    wall_ms = 1e3 * wall / iters
    report[part] = {**{k: round(v, 1) for k, v in ms.items()},
                    "untraced": round(max(0.0, wall_ms - sum(ms.values())), 1),
                    "wall": round(wall_ms, 1)}
  return report


def main(argv: Optional[Sequence[str]] = None) -> int:
  """``python -m petra_jax.benchmarks.profile_step``."""
  p = cli.parser("petra_jax.benchmarks.profile_step", __doc__, model="revnet18",
                 dataset="cifar10", width=64, batch_size=64,
                 width_help="base width (paper: 64)", batch_help="micro-batch size")
  p.add_argument("--iters", type=int, default=3, help="traced calls per part")
  p.add_argument("--batchnorm", default="fast", choices=("fast", "flax"),
                 help="BatchNorm layer: the models' fast one or flax.linen.BatchNorm")
  p.add_argument("--image-size", type=int, default=None,
                 help="override the dataset's image side (tiny smoke runs)")
  p.add_argument("--json", action="store_true", help="print JSON")
  args = p.parse_args(argv)
  with batchnorm_layer(args.batchnorm):
    stages = cli.build(args.model, args.dataset, args.width)
    report = profile(stages, args.batch_size, cli.image_shape(args.dataset, args.image_size),
                     data_lib.DATASETS[args.dataset].num_classes, args.iters)
  if args.json:
    print(json.dumps({"batchnorm": args.batchnorm, "parts": report}))
    return 0
  print(f"{args.model} width {args.width} batch {args.batch_size}, "
        f"{args.batchnorm} BatchNorm: ms per step")
  print(f"{'part':16s}" + "".join(f"{k:>12s}" for k in (*OP_CATEGORIES, "untraced", "wall")))
  for part, row in report.items():
    print(f"{part:16s}" + "".join(f"{row[k]:12.1f}" for k in (*OP_CATEGORIES, "untraced", "wall")))
  return 0


if __name__ == "__main__":
  sys.exit(main())
