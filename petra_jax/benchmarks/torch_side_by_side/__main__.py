"""``python -m petra_jax.benchmarks.torch_side_by_side``: :func:`petra_jax.benchmarks.torch_side_by_side.main`."""

import sys

from petra_jax.benchmarks.torch_side_by_side import main

sys.exit(main())
