"""The ``ksweep`` study: PETRA with k accumulation steps against backprop (paper Fig. 4).

``python -m petra_jax.studies ksweep [--ks=1,2,4,8] [--width=8] [--epochs=1]``: every run
updates on ``--batch-size`` images, split into k micro-batches, so the delay of stage j in
updates is about tau_j / k.
"""

from __future__ import annotations

from petra_jax.studies.common import run, write_page


def ksweep(args):
  """Trains ``backprop`` then ``petra`` per k; writes ``OUT/ksweep.md`` and ``OUT/ksweep.png``."""
  rows = [run(args, "backprop", "backprop", 1)]
  rows += [run(args, f"petra_k{k}", "petra", k) for k in args.ks]
  table = ["| run | k | micro-batch | test acc. (%) | final train loss | wall (s) |",
           "|---|---|---|---|---|---|"]
  for r in rows:
    table.append(f"| `{r['name']}` | {r['k']} | {args.batch_size // r['k']} | "
                 f"{100 * r['test_accuracy']:.1f} | {r['final_train_loss']:.3f} | "
                 f"{r['wall_time']:.0f} |")
  write_page(args, "ksweep", "Fig. 4 at small scale: PETRA with k accumulation steps", table,
             rows, "Every run updates on the same batch of images; k splits it into "
             "micro-batches, so the delay in updates of stage j is about tau_j / k.")
