"""Your own model on the 2-core CPU: a first run of a few minutes, well above chance.

The README's own-model command (``docs/examples/my_models.py``'s ``tiny_revnet``: stem,
3 reversible blocks, head; one block per stage, J = 5)::

  PYTHONPATH=docs/examples python -m petra_jax.train --config=configs/own_model_cpu.py \
    --config.model.name=my_models:tiny_revnet --workdir=runs/own_model

Any ``MODULE:FUNCTION`` goes in ``--config.model.name``; the stages are the function's
own (``model.stage_sizes=()``, ``model.num_stages=0``). Results: docs/recipes.md.
"""

from petra_jax import config as default


def get_config():
  c = default.get_config()
  c.model.name = "my_models:tiny_revnet"
  c.model.width = 16
  c.num_epochs = 4
  c.steps_per_epoch = 100
  c.num_devices = 1
  c.optim.learning_rate = 0.1
  c.optim.schedule = "cosine"
  c.optim.warmup_epochs = 0.2
  c.compensation.name = "nesterov_lookahead+weight_prediction"
  return c
