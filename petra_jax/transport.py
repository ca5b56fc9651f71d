"""Moving activations between stages' devices.

The one place that knows how an array travels from stage ``j``'s device to
stage ``j +- 1``'s. Within a process it is ``jax.device_put`` (asynchronous; a
no-op when source and destination are the same device).
"""

import jax


def send(x, device: jax.Device):
  """Places the pytree ``x`` on ``device`` (``jax.device_put``, asynchronous)."""
  return jax.device_put(x, device)
