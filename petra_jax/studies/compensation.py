"""The ``compensation`` study: PETRA with each delay compensation against backprop.

``python -m petra_jax.studies compensation [--stages=10,4] [--ks=1,2,4,8]
[--compensations=none,spike,...]``: RevNet18 on CIFAR-10; test accuracy at equal epochs,
backprop's at the row's wall time (one device) and the mean reconstruction error.
"""

from __future__ import annotations

import os

from petra_jax.studies.common import (STAGE_SPLITS, at_wall_time, mean_reconstruction_error,
                                      plot_accuracy, run, write_page)


def compensation_study(args):
  """Per k: ``backprop``, then ``petra`` per stage count with each of ``--compensations``.

  Table: test accuracy at equal epochs, and backprop's at the row's wall time (one device).
  """
  rows = []
  for k in args.ks:
    base = run(args, f"backprop_k{k}", "backprop", k)
    rows.append(dict(base, stages=1, compensation="-", gap=0.0, backprop_same_time=float("nan")))
    for J in args.stages:
      for comp in args.compensations:
        r = run(args, f"petra_J{J}_k{k}_{comp}", "petra", k,
                **{"model.stage_sizes": STAGE_SPLITS[J], "compensation.name": comp})
        rows.append(dict(r, stages=J, compensation=comp,
                         gap=100 * (base["test_accuracy"] - r["test_accuracy"]),
                         backprop_same_time=at_wall_time(base["records"], r["wall_time"])))
  table = ["| run | stages J | k | compensation | test acc. (%) | gap to backprop, same epochs "
           "(points) | backprop at the same wall time (%) | wall (s) | mean rel. "
           "reconstruction error |", "|---|---|---|---|---|---|---|---|---|"]
  for r in rows:
    table.append(f"| `{r['name']}` | {r['stages']} | {r['k']} | {r['compensation']} | "
                 f"{100 * r['test_accuracy']:.1f} | {r['gap']:+.1f} | "
                 f"{100 * r['backprop_same_time']:.1f} | {r['wall_time']:.0f} | "
                 f"{mean_reconstruction_error(r['records']):.2e} |")
  os.makedirs(args.out, exist_ok=True)
  write_page(args, "compensation", "Delay compensation for PETRA against backprop", table,
             rows, "One seed: differences of about 1 point are within run-to-run noise. Gap = backprop "
             "minus the row at the same number of epochs (positive: the row is worse).")
  plot_accuracy(rows, os.path.join(args.out, "compensation_accuracy.png"),
                "PETRA with delay compensation: test accuracy")
