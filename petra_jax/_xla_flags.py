"""Work-around for wrong results from XLA's experimental YNN fusion on CPU.

With jaxlib 0.10.2 on x86 CPUs, XLA's experimental YNN fusion silently returns
wrong values (0, inf or NaN) for some jitted matmul graphs with constant
operands, e.g. ``jit(lambda a: relu(a @ jnp.ones((256, 256))).sum())`` gives 0.
Turning the fusion off (an empty ``--xla_cpu_experimental_ynn_fusion_type=``)
fixes it and is also about 25 % faster for the conv nets here.

The flag must be in ``XLA_FLAGS`` before JAX initialises its backend, so this
module runs when ``petra_jax`` is imported. It only appends to the user's
flags, never overrides a value the user set, and is a no-op for GPU/TPU
backends (XLA ignores CPU flags there).
"""

import os

YNN_FLAG = "--xla_cpu_experimental_ynn_fusion_type"


def apply_cpu_workaround(environ=os.environ) -> str:
  """Appends ``--xla_cpu_experimental_ynn_fusion_type=`` to ``XLA_FLAGS``.

  Args:
    environ: the environment mapping to edit (``os.environ`` by default).

  Returns:
    The resulting value of ``XLA_FLAGS``. A flag the user already set (with
    any value) is left as it is.
  """
  flags = environ.get("XLA_FLAGS", "")
  if YNN_FLAG not in flags:
    flags = f"{flags} {YNN_FLAG}=".strip()
    environ["XLA_FLAGS"] = flags
  return flags
