"""PETRA on a reversible ViT (revvit_tiny, CCT tokenizer), CIFAR-10, 6 epochs on a 2-core CPU.

  python -m petra_jax.train --config=configs/cifar10_vit_cpu.py --workdir=runs/vit_petra

AdamW with Nesterov look-ahead grown with each stage's delay (``adam_lookahead``) and k = 8
micro-batches per update (delays of at most 0.75 update), the best setting of docs/transformers.md. Results and the backprop baseline: docs/recipes.md.
``:runlocal``: a smoke test. ``:depth8``: the same network in 8 stages (stage 0 3.5 updates
stale at k = 4) with Muon and weight prediction, the best 8-stage row of the depth study
(``petra_J8_k4_muon_prediction``): docs/depth.md says what was measured.
"""

from petra_jax import config as default


def get_config(variant: str = ""):
  if variant not in ("", "runlocal", "depth8"):
    raise ValueError(f"Unknown variant {variant!r} of configs/cifar10_vit_cpu.py; use "
                     "--config=configs/cifar10_vit_cpu.py or "
                     "--config=configs/cifar10_vit_cpu.py:runlocal or :depth8.")
  c = default.get_config()
  c.model.name = "revvit_tiny"
  c.model.width = 32
  c.model.depth = 4
  c.model.patch_size = 8
  c.model.tokenizer = "conv"
  c.model.stage_sizes = (3, 2, 2, 3)
  c.num_epochs = 6
  c.num_devices = 1
  c.reconstruction_error_every = 50
  c.optim.name = "adam"
  c.optim.learning_rate = 1e-3
  c.optim.weight_decay = 0.05
  c.optim.schedule = "cosine"
  c.optim.warmup_epochs = 0.5
  c.compensation.name = "adam_lookahead"
  c.accumulation_steps = 8
  if variant == "depth8":  # petra_jax/studies/depth.py's row petra_J8_k4_muon_prediction
    c.model.stage_sizes = (2, 1, 1, 1, 1, 1, 1, 2)
    c.accumulation_steps = 4
    c.optim.name = "muon"
    c.optim.muon_learning_rate = 0.02
    c.compensation.name = "update_prediction"
  if variant == "runlocal":
    c.model.width = 8
    c.model.depth = 1
    c.model.stage_sizes = (1, 1, 1, 1)
    c.batch_size = 32
    c.num_epochs = 1
    c.steps_per_epoch = 10
    c.log_every = 1
    c.reconstruction_error_every = 5
    c.optim.warmup_epochs = 0.0
  return c
