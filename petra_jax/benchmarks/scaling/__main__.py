"""``python -m petra_jax.benchmarks.scaling``: :func:`petra_jax.benchmarks.scaling.main`."""

import sys

from petra_jax.benchmarks.scaling import main

sys.exit(main())
