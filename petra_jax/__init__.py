"""petra_jax: PETRA (Rivaud et al., ICLR 2025) in JAX/Flax.

Importing the package applies the XLA-CPU work-around in ``_xla_flags`` before
JAX initialises its backend: import ``petra_jax`` before running any JAX
computation.
"""

from petra_jax import _xla_flags

_xla_flags.apply_cpu_workaround()

__version__ = "0.1.0"
