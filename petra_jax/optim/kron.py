"""PSGD Kron (``optim.name="kron"``): a Kronecker-factored, Shampoo-style preconditioner.

Li (2018), "Preconditioner on matrix Lie group for SGD", the Kron form of lixilinx/psgd_torch,
from the ``psgdax`` package (``pip install -e '.[kron]'``). Per leaf ``G`` ([m, n], or any
rank), momentum ``mu_t = b_t mu_{t-1} + (1 - b_t) g_t`` with ``b_t = min(t / (1 + t), b1)``
(``t`` counted from 0), preconditioner factors ``Q = Q_1 x ... x Q_r`` fitted to whiten the
gradient and updated with probability ``p_t`` (annealed 1 -> 0.03 after 500 updates by the
package's default), step ``P mu = Q^T Q mu`` in the factors' rotated basis, its RMS clipped to
1, then decoupled decay ``wd w`` on ``decay_mask`` and the rate::

  w <- w - eta_t (clip(Q^T Q mu_t) + wd w)
"""

from __future__ import annotations

import contextlib
import io
from typing import Callable, Optional, Union

import optax


def _psgdax():
  """The ``psgdax`` module; ImportError naming the install command when it is missing."""
  try:
    import psgdax  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise ImportError("optim.name='kron' needs the psgdax package: "
                      "pip install -e '.[kron]'") from e
  return psgdax


def kron(learning_rate: optax.ScalarOrSchedule, b1: float = 0.9, weight_decay: float = 0.0,
         decay_mask=None, update_probability: Optional[Union[float, Callable]] = None,
         init_scale: Optional[float] = None) -> optax.GradientTransformation:
  """PSGD Kron, one update per call (the module's equation).

  Args:
    learning_rate: eta_t, a float or a schedule of the update count.
    b1: the momentum's beta.
    weight_decay: wd, decoupled, on the leaves where ``decay_mask`` is True.
    decay_mask: a pytree of bools or a function of the params (``kernel_mask``).
    update_probability: p_t, a float or a schedule; None: the package's annealing.
    init_scale: the factors' initial scale; None: set from the first gradient.

  Raises:
    ImportError: ``psgdax`` is not installed (the message names the command).
  """
  psgdax = _psgdax()
  kwargs = {} if update_probability is None else {
      "preconditioner_update_probability": update_probability}
  tx = psgdax.kron(learning_rate=learning_rate, b1=b1, weight_decay=weight_decay,
                   weight_decay_mask=decay_mask, preconditioner_init_scale=init_scale,
                   **kwargs)

  def init_fn(params):
    with contextlib.redirect_stdout(io.StringIO()):  # the package prints its state's size
      return tx.init(params)

  def update_fn(updates, state, params=None):
    return tx.update(updates, state, params)

  return optax.GradientTransformation(init_fn, update_fn)
