"""PETRA (Rivaud et al., ICLR 2025) in JAX/Flax; importing it applies the XLA-CPU work-around."""

from petra_jax import _xla_flags

_xla_flags.apply_cpu_workaround()

__version__ = "0.1.0"
