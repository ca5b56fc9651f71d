"""The ``table4`` study: paper Table 4's five gradient approximations at small scale, k = 1.

``python -m petra_jax.studies table4 [--width=8] [--epochs=1] [--compensation=none]``: RevNet18
on CIFAR-10 with ``backprop``, ``delayed``, ``dsp``, ``approximate_input`` and ``petra``. The
paper's Table 4 is CIFAR-100 at width 64 for 300 epochs: compare the ordering, not the numbers.
"""

from __future__ import annotations

from petra_jax.engine import methods as methods_lib
from petra_jax.studies.common import run, write_page

# Paper Table 4 (CIFAR-100, RevNet18, k = 1): method -> accuracy (%).
TABLE4_PAPER_ACCURACY = {"backprop": 77.5, "delayed": 76.5, "dsp": 76.4,
                         "approximate_input": 75.4, "petra": 75.9}


def _yes(flag: bool) -> str:
  return "yes" if flag else "no"


def table4_columns(method: str) -> tuple[str, str, str]:
  """Table 4's ``(delayed, input buffer, param. buffer)`` of ``method``."""
  m = methods_lib.get(method)
  if not m.pipelined:
    return "no", "-", "-"
  keeps = methods_lib.keeps(m, reversible=True)
  return _yes(m.delayed), _yes(keeps.input), _yes(keeps.weights)


def table4(args):
  """Trains Table 4's five rows with k = 1; writes ``OUT/table4.md`` and ``OUT/table4.png``."""
  rows = [run(args, m, m, 1) for m in TABLE4_PAPER_ACCURACY]
  table = ["| method | delayed | input buffer | param. buffer | test acc. (%) | final train "
           "loss | wall (s) | paper (CIFAR-100, %) |", "|---|---|---|---|---|---|---|---|"]
  for r in rows:
    (delayed, inp, par), paper = table4_columns(r["method"]), TABLE4_PAPER_ACCURACY[r["method"]]
    table.append(f"| `{r['method']}` | {delayed} | {inp} | {par} | "
                 f"{100 * r['test_accuracy']:.1f} | {r['final_train_loss']:.3f} | "
                 f"{r['wall_time']:.0f} | {paper} |")
  write_page(args, "table4", "Table 4 at small scale: gradient approximations, k = 1", table,
             rows, "`backprop` is exact (no delay); the other rows run the pipeline with "
             "delays tau_j = 2(J-1-j) ticks over J = 10 stages.")
