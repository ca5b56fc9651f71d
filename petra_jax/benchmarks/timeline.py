"""A schedule as run: a Fig. 1-style chart of a recorded timeline.

``python -m petra_jax.benchmarks.timeline --model=revnet18 --width=4 --ticks=30
[--method=petra|gpipe|1f1b|zb_h1|...] [--accumulation-steps=K] --out=docs/timeline.png`` records
the first ticks of a tiny pipeline, checks them against the schedule table, draws them and
prints the fill ticks and idle F/B slots (bubbles).
"""

from __future__ import annotations

import collections
import os
import sys
from typing import Optional, Sequence

from petra_jax import data as data_lib
from petra_jax.benchmarks import cli
from petra_jax.engine import observers
from petra_jax.engine.methods import METHODS, get
from petra_jax.engine.pipeline import Pipeline
import jax
import jax.numpy as jnp
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Patch, Rectangle  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

Event = tuple  # (tick, stage, "F" | "B" | "W", micro_batch)
COLORS = {"F": "#4C72B0", "B": "#DD8452", "W": "#55A868", "idle": "#EEEEEE"}


def timeline_stats(timeline: Sequence[Event], num_stages: int,
                   num_ticks: Optional[int] = None) -> dict:
  """``ticks``, ``slots`` (``2 J ticks``), ``busy``, ``bubbles``, ``first_loss_tick`` and
  ``fill_ticks`` (None if never full) of ``(tick, stage, kind, micro_batch)`` events."""
  if num_ticks is None:
    num_ticks = 1 + max((e[0] for e in timeline), default=-1)
  per_tick = collections.Counter(e[0] for e in timeline)
  full = [t for t in range(num_ticks) if per_tick[t] == 2 * num_stages]
  last = [e[0] for e in timeline if e[1] == num_stages - 1]
  slots = 2 * num_stages * num_ticks
  return {"ticks": num_ticks, "slots": slots, "busy": len(timeline),
          "bubbles": slots - len(timeline),
          "first_loss_tick": min(last) if last else None,
          "fill_ticks": full[0] if full else None}


def plot_timeline(timeline: Sequence[Event], num_stages: int, path: str,
                  title: Optional[str] = None, num_ticks: Optional[int] = None) -> str:
  """Draws ``(tick, stage, "F" | "B" | "W", micro_batch)`` events as in paper Fig. 1 to ``path``
  (F in a tick's left half, B or W in its right half)."""
  stats = timeline_stats(timeline, num_stages, num_ticks)
  ticks = stats["ticks"]
  fig, ax = plt.subplots(figsize=(max(6.0, 0.42 * ticks + 1.5), 0.45 * num_stages + 1.6))
  small = 6 if ticks <= 40 else 4
  for t in range(ticks):
    for j in range(num_stages):
      ax.add_patch(Rectangle((t, j - 0.45), 1.0, 0.9, facecolor=COLORS["idle"],
                             edgecolor="white", linewidth=0.5))
  for t, j, kind, m in timeline:
    x = t + (0.0 if kind == "F" else 0.5)
    ax.add_patch(Rectangle((x, j - 0.45), 0.5, 0.9, facecolor=COLORS[kind],
                           edgecolor="white", linewidth=0.5))
    ax.text(x + 0.25, j, str(m), ha="center", va="center", fontsize=small, color="white")
  ax.set_xlim(0, ticks)
  ax.set_ylim(num_stages - 0.5, -0.5)
  ax.set_xticks(np.arange(ticks) + 0.5, [str(t) for t in range(ticks)], fontsize=small + 1)
  ax.set_yticks(range(num_stages))
  ax.set_xlabel("tick")
  ax.set_ylabel("stage")
  ax.set_title(title or (f"PETRA schedule, {num_stages} stages: F then B per tick, "
                         f"labels = micro-batch; {stats['bubbles']} idle of "
                         f"{stats['slots']} slots"), fontsize=9)
  letters = sorted({e[2] for e in timeline}, key="FBW".index)
  names = {"F": "forward (F)", "B": "backward (B)", "W": "weight gradient (W)"}
  ax.legend(handles=[Patch(color=COLORS[c], label=names[c]) for c in letters]
            + [Patch(color=COLORS["idle"], label="idle (bubble)")],
            loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
  fig.tight_layout()
  os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return path


def table_events(table, num_ticks: Optional[int] = None) -> list[Event]:
  """The events a schedule table prescribes (a ``loss`` task is an F and a B)."""
  events = []
  for t, tick in enumerate(table):
    if num_ticks is not None and t >= num_ticks:
      break
    for task in tick:
      for kind in table.family.letters.get(task.kind, ""):
        events.append((t, task.stage, kind, task.micro_batch))
  return events


def run_timeline(stages, image_shape: Sequence[int], num_ticks: int,
                 batch_size: int = 8, num_classes: int = 10, seed: int = 0,
                 method: str = "petra", accumulation_steps: int = 1):
  """``(recorded events, schedule table)`` of the first ``num_ticks`` ticks of ``method``."""
  recorder = observers.TimelineRecorder()
  pipe = Pipeline(stages, optax.sgd(1e-3), jax.devices()[:1], method=method,
                  accumulation_steps=accumulation_steps, observers=[recorder])
  key = jax.random.key(seed)
  images = jax.random.normal(key, (batch_size, *image_shape), jnp.float32)
  labels = jax.random.randint(key, (batch_size,), 0, num_classes, jnp.int32)
  state = pipe.init(seed, images)
  table = pipe.schedule(accumulation_steps * num_ticks)  # at least num_ticks ticks
  state, _ = pipe.run(state, (table[t] for t in range(num_ticks)),
                      lambda m: (images, labels))
  jax.block_until_ready(state.train_states)
  return recorder.events, table


def main(argv: Optional[Sequence[str]] = None) -> int:
  """``python -m petra_jax.benchmarks.timeline``."""
  p = cli.parser("petra_jax.benchmarks.timeline", __doc__, model="revnet18", dataset="cifar10",
                 width=4, batch_size=8)
  p.add_argument("--image-size", type=int, default=None,
                 help="override the dataset's image side (the schedule does not depend on it)")
  p.add_argument("--ticks", type=int, default=30, help="ticks drawn (default 30)")
  p.add_argument("--method", default="petra", choices=[m for m in METHODS if m != "backprop"],
                 help="whose schedule is drawn (default petra)")
  p.add_argument("--accumulation-steps", type=int, default=1, help="k (gpipe, 1f1b rounds)")
  p.add_argument("--out", default="runs/timeline.png",
                 help="the figure's path (default runs/timeline.png; --out=docs/timeline.png "
                 "updates the committed figure)")
  args = p.parse_args(argv)
  shape = cli.image_shape(args.dataset, args.image_size)
  stages = cli.build(args.model, args.dataset, args.width)
  num_classes = data_lib.DATASETS[args.dataset].num_classes
  timeline, table = run_timeline(stages, shape, args.ticks, args.batch_size, num_classes,
                                 method=args.method, accumulation_steps=args.accumulation_steps)
  if sorted(timeline) != sorted(table_events(table, args.ticks)):
    raise SystemExit("error: the engine ran other tasks than its schedule table prescribes.")
  J = len(stages)
  s = timeline_stats(timeline, J, args.ticks)
  k = f", k = {args.accumulation_steps}" if get(args.method).schedule.flushed else ""
  plot_timeline(timeline, J, args.out, num_ticks=args.ticks, title=(
      f"{args.method} schedule, {J} stages{k}: labels = micro-batch; {s['bubbles']} idle "
      f"of {s['slots']} F/B slots"))
  print(f"{args.model}, {args.method}: {J} stages, {s['ticks']} ticks -> {args.out} (the "
        "recorded tasks equal the schedule table's)")
  print(f"first loss on tick {s['first_loss_tick']} (J-1 = {J - 1}); pipeline full from "
        f"tick {s['fill_ticks']} (2(J-1) = {2 * (J - 1)}); bubbles: {s['bubbles']} idle of "
        f"{s['slots']} F/B slots ({s['busy']} busy)")
  return 0


if __name__ == "__main__":
  sys.exit(main())
