"""``python -m petra_jax.studies NAME``: see :mod:`petra_jax.studies.cli`."""

import sys

from petra_jax.studies.cli import main

sys.exit(main())
