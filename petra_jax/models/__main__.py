"""``python -m petra_jax.models NAME``: every stage of a model and its parameter count (Table 2)."""

import os
import sys

from petra_jax.models.summary import main

if __name__ == "__main__":
  try:
    sys.exit(main())
  except BrokenPipeError:  # e.g. `| head`: stop quietly (Python docs' recipe).
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    sys.exit(1)
