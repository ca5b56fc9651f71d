"""The depth study's simulated time to accuracy: PETRA, GPipe and 1F1B on J devices, over named links.

For each PETRA row of the depth study with J >= 8:

- **Stage costs**: each stage's forward and backward on this machine's first device, in the
  pipeline a training run of the row builds (:func:`petra_jax.training.assembly.build_pipeline`:
  the row's optimizer, compensation and weight predictor), medians of ``iters`` (default 7) at
  the row's micro-batch; PETRA's steps (``stream``) and the flushed schedules' steps from a
  stored input (``stored``: the method ``1f1b``, plain optimizer). The backward includes the
  optimizer: ``optax.MultiSteps`` computes the inner update on every micro-batch and keeps it
  every k-th, as in training. A weight predictor's cost is added to the forward. Kept in
  ``WORKDIR/stage_ms_<row>.json``.
- **Messages** (:func:`message_bytes`): per stage boundary the forward activation and the
  backward cotangent, shapes from ``jax.eval_shape``; PETRA's backward message to a stage that
  reconstructs its input also carries the output it rebuilds from. Each costs
  :func:`petra_jax.benchmarks.links.message_ms` over a named link.
- **Schedules** (:data:`SCHEDULES`): PETRA's stream; GPipe and 1F1B recomputing (the stored-input
  backward as measured: it re-runs the stage's forward) and storing (that backward minus the
  stage's forward; the last stage, whose backward holds its forward, unchanged), each simulated
  by :func:`petra_jax.benchmarks.simulate.ms_per_update`.
- **Time to accuracy**: per seed, ms per update times the updates to the first evaluation at or
  above each of :data:`petra_jax.studies.time_to_accuracy.TARGETS` and the reference's final
  accuracy; PETRA from its own evaluations, GPipe and 1F1B (the synchronous gradient) from the
  reference's. The resolution is the evaluation interval (:func:`evaluations_per_epoch`).
"""

from __future__ import annotations

import json
import os
from typing import Callable, Optional, Sequence

from petra_jax import data as data_lib
from petra_jax.benchmarks import links, simulate
from petra_jax.studies import common
from petra_jax.studies import time_to_accuracy as tta

# schedule -> (tick table, stage costs of, recomputing): what :func:`schedule_ms` simulates.
SCHEDULES = {"petra": ("stream", "stream", False),
             "gpipe_rc": ("gpipe", "stored", True), "gpipe": ("gpipe", "stored", False),
             "1f1b_rc": ("1f1b", "stored", True), "1f1b": ("1f1b", "stored", False)}
LABELS = {"petra": "PETRA", "gpipe_rc": "GPipe, recomputing", "gpipe": "GPipe, storing",
          "1f1b_rc": "1F1B, recomputing", "1f1b": "1F1B, storing"}
HEADLINE = 0.78  # the accuracy of the ratio and sensitivity tables
SCALES = (0.8, 1.2)  # the sensitivity's stage-cost factors


def row_pipeline(config, method: str, micro_batch: int):
  """``(pipe, state, images float32[micro, H, W, C], labels int32[micro])``: the pipeline a
  training run of ``config`` builds, with ``method``, no observers, on random data.

  Raises:
    ValueError: what ``build_pipeline`` raises (an unknown model, a split that does not fit).
  """
  import numpy as np  # pylint: disable=g-import-not-at-top

  from petra_jax.training import assembly  # pylint: disable=g-import-not-at-top
  config = config.copy_and_resolve_references()
  config.method = method
  config.reconstruction_error_every = config.grad_quality_every = 0
  info = data_lib.DATASETS[config.dataset]
  # updates an epoch (CIFAR-10's 50,000 images): only the rate schedules' horizons read it
  steps = config.steps_per_epoch or 50_000 // config.batch_size
  pipe, _, _ = assembly.build_pipeline(config, "", info, micro_batch, steps)
  rng = np.random.default_rng(0)
  images = rng.normal(size=(micro_batch,) + tuple(info.image_shape)).astype(np.float32)
  labels = rng.integers(0, info.num_classes, micro_batch).astype(np.int32)
  return pipe, pipe.init(config.seed, images), images, labels


def measure_stage_ms(config, micro_batch: int, iters: int = 7) -> dict:
  """Median ms of each stage's forward and backward with ``config``'s own pipeline (module
  docstring): ``{"stream": [F, B], "stored": [F, B], "iters", "micro_batch"}``, ``F`` and
  ``B`` lists of J floats (ms per micro-batch ``[micro_batch, H, W, C]``)."""
  from petra_jax.engine import timing  # pylint: disable=g-import-not-at-top
  out = {"iters": iters, "micro_batch": micro_batch}
  for key, method in (("stream", config.method), ("stored", "1f1b")):
    pipe, state, images, labels = row_pipeline(config, method, micro_batch)
    rows, _ = timing.stage_times(pipe, state, images, labels, iters)
    forward = [r["forward"] for r in rows]
    for j, (steps, st) in enumerate(zip(pipe.steps, state.stage_states)):
      if steps.predicted_params(st) is not None:
        forward[j] += timing.median_ms(lambda s=steps, st=st: s.predicted_params(st), iters)
    out[key] = [forward, [r["backward"] for r in rows]]
  return out


def message_bytes(stages, input_shape: Sequence[int], method: str = "petra") -> dict:
  """Bytes of each stage's messages on a micro-batch ``input_shape`` ``[B, H, W, C]`` (float32
  images; each message in the dtype ``jax.eval_shape`` gives it).

  Returns:
    ``{"forward": [J], "stream_backward": [J], "stored_backward": [J]}``: stage ``j``'s
    output to ``j + 1`` (0 for the last); its ``(x~ or None, delta)`` to ``j - 1`` (0 for
    stage 0): ``delta`` is its input's size, ``x~`` (``method``'s stream only) as large again
    when stage ``j - 1`` reconstructs its input; the flushed schedules send ``delta`` alone.
  """
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top

  from petra_jax.engine import methods as methods_lib  # pylint: disable=g-import-not-at-top
  from petra_jax.engine.stages import stage as stage_lib  # pylint: disable=g-import-not-at-top
  outputs = [out for _, out in stage_lib.trace(
      stages, jax.ShapeDtypeStruct(tuple(input_shape), jnp.float32))]
  size = [sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(o)) for o in outputs]
  m = methods_lib.get(method)
  rebuilt = [m.reconstructs_stage(s.reversible) for s in stages]
  return {"forward": size[:-1] + [0],
          "stream_backward": [0] + [size[j - 1] * (2 if rebuilt[j - 1] else 1)
                                    for j in range(1, len(stages))],
          "stored_backward": [0] + size[:-1]}


def schedule_ms(stage_ms: dict, nbytes: dict, k: int, link: str, petra_scale: float = 1.0,
                sync_scale: float = 1.0) -> dict:
  """Simulated ms per update of each of :data:`SCHEDULES` on ``J`` devices (one a stage).

  Args:
    stage_ms: :func:`measure_stage_ms`'s ``{"stream": [F, B], "stored": [F, B]}`` (ms).
    nbytes: :func:`message_bytes`'s dict.
    k: micro-batches per update.
    link: a name in :data:`petra_jax.benchmarks.links.LINKS`.
    petra_scale, sync_scale: factors on PETRA's and on GPipe's and 1F1B's stage costs (the
      messages keep theirs).

  Returns:
    ``{schedule: ms per update}``.
  """
  forward_send = links.stage_send_ms(nbytes["forward"], link)
  out = {}
  for name, (table, kind, recompute) in SCHEDULES.items():
    f, b = (list(v) for v in stage_ms[kind])
    if kind == "stored" and not recompute:
      b = [bj - fj for bj, fj in zip(b[:-1], f[:-1])] + b[-1:]
    scale = petra_scale if kind == "stream" else sync_scale
    back_send = links.stage_send_ms(nbytes[f"{kind}_backward"], link)
    out[name] = simulate.ms_per_update(
        table, len(f), k, [scale * x for x in f], [scale * x for x in b], forward_send,
        back_send)["simulated_ms_per_update"]
  return out


def evaluations_per_epoch(records: Sequence[dict]) -> float:
  """Evaluations (distinct steps with ``test_accuracy``) per epoch of the run's length (NaN if
  none)."""
  evals = [r for r in records if "test_accuracy" in r]
  epochs = max((r.get("epoch", 0.0) for r in evals), default=0.0)
  return len({r["step"] for r in evals}) / epochs if epochs else float("nan")


def seed_seconds(pair: dict, ms: dict) -> dict:
  """``{schedule: [seconds to each of TARGETS, then to the reference's final accuracy]}`` of
  one seed's ``pair`` (``{"row", "reference": run dicts with "records", "test_accuracy"}``);
  PETRA from the row's evaluations, the others from the reference's (NaN: never reached)."""
  targets = list(tta.TARGETS) + [pair["reference"]["test_accuracy"]]
  out = {}
  for name, value in ms.items():
    run = pair["row"] if name == "petra" else pair["reference"]
    got = tta.seconds_to(tta.sorted_evaluations(run["records"]), value, targets)
    out[name] = [got[a] for a in targets]
  return out


def headline_ratio(pairs: Sequence[dict], ms: dict, other: str) -> float:
  """PETRA's mean seconds to :data:`HEADLINE` over ``other``'s, over the seeds where both reach
  it (NaN if none)."""
  i = list(tta.TARGETS).index(HEADLINE)
  both = [(s["petra"][i], s[other][i]) for s in (seed_seconds(p, ms) for p in pairs)]
  both = [(a, b) for a, b in both if a == a and b == b]
  return tta.ratio(common.mean(a for a, _ in both), common.mean(b for _, b in both))


def row_stages(config):
  """The stages of ``config``'s network, split and precision (no pipeline built)."""
  from petra_jax import models  # pylint: disable=g-import-not-at-top
  from petra_jax.engine.stages import partition  # pylint: disable=g-import-not-at-top
  from petra_jax.engine.stages import stage as stage_lib  # pylint: disable=g-import-not-at-top
  from petra_jax.training import assembly  # pylint: disable=g-import-not-at-top
  m, info = config.model, data_lib.DATASETS[config.dataset]
  blocks = models.build_model(m.name, width=m.width, depth=m.depth or None,
                              num_classes=info.num_classes, patch_size=m.patch_size or None,
                              tokenizer=m.tokenizer)
  blocks = stage_lib.with_precision(blocks, assembly.precision(config))
  return partition.group_stages(blocks, list(m.stage_sizes))


def load_or_measure(args, name: str, config) -> Optional[dict]:
  """``WORKDIR/<name>.json`` if stored; else, unless ``--finished-only`` (then None),
  :func:`measure_stage_ms` of ``config`` at its micro-batch, stored there."""
  path = os.path.join(args.workdir, f"{name}.json")
  if os.path.exists(path):
    with open(path, encoding="utf-8") as f:
      return json.load(f)
  if getattr(args, "finished_only", False):
    return None
  stage_ms = measure_stage_ms(config, config.batch_size // config.accumulation_steps,
                              getattr(args, "stage_iters", 7))
  os.makedirs(args.workdir, exist_ok=True)
  with open(path, "w", encoding="utf-8") as f:
    json.dump(stage_ms, f)
  return stage_ms


def balanced_split(stage_ms: dict, num_stages: int) -> tuple[int, ...]:
  """Blocks per stage of ``num_stages`` minimising the slowest, from ``stage_ms`` measured with
  one block a stage: :func:`petra_jax.engine.stages.partition.balanced_partition` of PETRA's
  per-block cost a tick (:func:`petra_jax.engine.timing.stage_cost`: ``F + B``, the last
  ``B``). Raises ValueError: ``num_stages`` outside ``[1, blocks]``."""
  from petra_jax.engine import timing  # pylint: disable=g-import-not-at-top
  from petra_jax.engine.stages import partition  # pylint: disable=g-import-not-at-top
  groups, _ = partition.balanced_partition(timing.stage_cost(*stage_ms["stream"]), num_stages)
  return tuple(partition.group_sizes(groups))


def balanced_config(args, config, name: str):
  """``config`` with its split balanced on measured costs (:func:`balanced_split`): the
  costs of ``config``'s network one block a stage, ``WORKDIR/block_ms_<name>.json``.

  Raises:
    ValueError: ``--finished-only`` and no such file.
  """
  J = len(config.model.stage_sizes)
  one = config.copy_and_resolve_references()
  one.model.stage_sizes = (1,) * sum(config.model.stage_sizes)
  stage_ms = load_or_measure(args, f"block_ms_{name}", one)
  if stage_ms is None:
    raise ValueError(f"no block costs block_ms_{name}.json under {args.workdir} "
                     "(--finished-only measures nothing): run without it to measure them.")
  config.model.stage_sizes = balanced_split(stage_ms, J)
  return config


def _seconds(x: float) -> str:
  return "never" if x != x else f"{x:.0f}"


def _ratio(x: float) -> str:
  return "-" if x != x else f"{x:.2f}"


def _link(name: str) -> str:
  link = links.LINKS[name]
  return f"`{name}` ({link.bytes_per_s / 1e9:g} GB/s, {link.latency_ms * 1e3:g} us a message)"


def link_table(link: str, entries: Sequence[dict]) -> list[str]:
  """Markdown: per row, seed and schedule, ms per update over ``link`` and seconds to each
  target (``entries``: :func:`simulation_section`'s)."""
  lines = [f"### Over {_link(link)}", "",
           "| row | seed | evaluations per epoch (row / reference) | reference (final %) | "
           "schedule | ms per update | " + " | ".join(f"s to {100 * a:g} %" for a in tta.TARGETS)
           + " | s to the reference's final |", "|---" * (7 + len(tta.TARGETS)) + "|"]
  for e in entries:
    ms = schedule_ms(e["stage_ms"], e["bytes"], e["k"], link)
    for p in e["pairs"]:
      ref = p["reference"]
      res = (f"{evaluations_per_epoch(p['row']['records']):g} / "
             f"{evaluations_per_epoch(ref['records']):g}")
      secs = seed_seconds(p, ms)
      for name in SCHEDULES:
        lines.append(f"| `{e['row']}` | {p['row']['seed']} | {res} | `{ref['row']}` "
                     f"{100 * ref['test_accuracy']:.1f} | {LABELS[name]} | {ms[name]:.1f} | "
                     + " | ".join(_seconds(x) for x in secs[name]) + " |")
  return lines


def ratio_table(entries: Sequence[dict]) -> list[str]:
  """Markdown: per row and link, PETRA's time to :data:`HEADLINE` over each other schedule's."""
  others = [s for s in SCHEDULES if s != "petra"]
  lines = ["| row | link | " + " | ".join(f"PETRA / {LABELS[s]}" for s in others) + " |",
           "|---" * (2 + len(others)) + "|"]
  for e in entries:
    for link in links.LINKS:
      ms = schedule_ms(e["stage_ms"], e["bytes"], e["k"], link)
      lines.append(f"| `{e['row']}` | `{link}` | "
                   + " | ".join(_ratio(headline_ratio(e["pairs"], ms, s)) for s in others) + " |")
  return lines


def sensitivity_table(entries: Sequence[dict]) -> list[str]:
  """Markdown: PETRA / GPipe at :data:`HEADLINE` with every stage cost (PETRA's and GPipe's)
  times each of :data:`SCALES`, then PETRA's alone; messages unchanged."""
  cases = [(1.0, 1.0)] + [(s, s) for s in SCALES] + [(s, 1.0) for s in SCALES]
  lines = ["| row | link | against | nominal | "
           + " | ".join(f"every stage x{s:g}" for s in SCALES) + " | "
           + " | ".join(f"PETRA's stages only x{s:g}" for s in SCALES) + " |",
           "|---" * (3 + len(cases)) + "|"]
  for e in entries:
    for link in links.LINKS:
      for other in ("gpipe_rc", "gpipe"):
        got = [headline_ratio(e["pairs"], schedule_ms(e["stage_ms"], e["bytes"], e["k"], link,
                                                      p, q), other) for p, q in cases]
        lines.append(f"| `{e['row']}` | `{link}` | {LABELS[other]} | "
                     + " | ".join(_ratio(x) for x in got) + " |")
  return lines


def cost_lines(entries: Sequence[dict]) -> list[str]:
  """One line per row: its split, PETRA's and the stored-input cost a tick per stage
  (``F + B``, the last stage ``B``: :func:`petra_jax.engine.timing.stage_cost`), bytes."""
  from petra_jax.engine import timing  # pylint: disable=g-import-not-at-top
  lines = []
  for e in entries:
    s = e["stage_ms"]
    per = {key: ", ".join(f"{c:.1f}" for c in timing.stage_cost(*s[key]))
           for key in ("stream", "stored")}
    lines.append(f"- `{e['row']}`: split {tuple(e['split'])}, k = {e['k']}, medians of "
                 f"{s.get('iters', '?')} at micro-batch {s.get('micro_batch', '?')}; ms a "
                 f"micro-batch per stage, F + B (the last B): PETRA {per['stream']}; stored "
                 f"input (recomputing) {per['stored']}; bytes forward {e['bytes']['forward']}, "
                 "PETRA backward "
                 f"{e['bytes']['stream_backward']}, GPipe/1F1B backward "
                 f"{e['bytes']['stored_backward']}.")
  return lines


def entries_of(args, results: Sequence[dict], reference_of: dict,
               config_of: Callable) -> tuple[list[dict], list[str]]:
  """``(entries, rows without stored costs)``: per PETRA row with J >= 8, its stage costs
  (:func:`load_or_measure`, ``WORKDIR/stage_ms_<row>.json``), message bytes, k, split, and
  ``pairs``: per seed the row's run and the reference's (``reference_of[depth]``) of that seed."""
  rows = sorted({r["row"] for r in results
                 if not r["reference"] and r["method"] == "petra" and r["J"] >= 8})
  entries, missing = [], []
  for row in rows:
    runs = [r for r in results if r["row"] == row]
    base = {r["seed"]: r for r in results if r["row"] == reference_of.get(runs[0]["depth"])}
    config = config_of(row)
    stage_ms = load_or_measure(args, f"stage_ms_{row}", config)
    if stage_ms is None:
      missing.append(row)
      continue
    micro = config.batch_size // config.accumulation_steps
    shape = (micro,) + tuple(data_lib.DATASETS[config.dataset].image_shape)
    entries.append({"row": row, "stage_ms": stage_ms, "k": config.accumulation_steps,
                    "split": tuple(config.model.stage_sizes),
                    "bytes": message_bytes(row_stages(config), shape, config.method),
                    "pairs": [{"row": r, "reference": base[r["seed"]]} for r in runs
                              if r["seed"] in base]})
  return entries, missing


def simulation_section(args, results: Sequence[dict], reference_of: dict,
                       config_of: Callable) -> list[str]:
  """The page's section: the headline ratios, their sensitivity, a table per link, the costs
  (module docstring). ``reference_of``: ``{depth: reference row}``; ``config_of(row)``: its
  config. With ``--finished-only`` only stored costs are read: nothing is measured."""
  entries, missing = entries_of(args, results, reference_of, config_of)
  if not entries and not missing:
    return []
  lines = ["## Simulated time to accuracy on J devices", "",
           "Stage costs measured on this machine with each row's own optimizer step, fed to "
           "`petra_jax.benchmarks.simulate.ms_per_update` with every message's cost over a "
           "named link (`petra_jax.benchmarks.links`); GPipe and 1F1B take the reference's "
           "updates (the synchronous gradient), PETRA its own; `never`: no evaluation reached "
           "it. Resolution: one evaluation interval (evaluations per epoch in each table). "
           "How: `petra_jax/studies/depth_time.py`.", "",
           f"### PETRA / the others at {100 * HEADLINE:g} % (mean seconds over the seeds where "
           "both reach it)", "", *ratio_table(entries), "",
           f"### Sensitivity of PETRA / GPipe at {100 * HEADLINE:g} % to the stage costs", "",
           "Every stage cost (PETRA's and GPipe's) times the factor, then PETRA's alone (GPipe's "
           "as measured); message costs unchanged.", "", *sensitivity_table(entries), ""]
  for link in links.LINKS:
    lines += [*link_table(link, entries), ""]
  lines += ["### Stage costs and messages", "", *cost_lines(entries)]
  if missing:
    lines += ["", f"No stage costs stored for {', '.join(f'`{r}`' for r in missing)} "
              "(`--finished-only` measures nothing: run without it to measure them)."]
  return lines
