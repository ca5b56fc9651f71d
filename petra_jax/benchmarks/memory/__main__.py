"""``python -m petra_jax.benchmarks.memory``: :func:`petra_jax.benchmarks.memory.main`."""

import sys

from petra_jax.benchmarks.memory import main

sys.exit(main())
