"""The training methods: their rows (:mod:`.registry`) and the tasks each row names.

A stage's :class:`~.context.StageContext` (:mod:`.context`) is all a task
builder reads: :mod:`.tasks` (the end-to-end methods), :mod:`.zero_bubble`
(ZB-H1's B and W), :mod:`.local_learning` (``local``: DGL, with the heads of
:mod:`.auxiliary`) and :mod:`.forward_gradient_tasks` (``forward_gradient``,
its guesses in :mod:`.forward_gradient`).
"""

from petra_jax.engine.methods.registry import (ALL_METHODS, DELAYED, LOCAL_METHODS, METHODS,
                                               Method, get, keeps, require_reversible)

__all__ = ["ALL_METHODS", "DELAYED", "LOCAL_METHODS", "METHODS", "Method", "get", "keeps",
           "require_reversible"]
