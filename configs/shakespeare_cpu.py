"""A character-level language model on tiny_shakespeare, on a 2-core CPU.

  python -m petra_jax.train --config=configs/shakespeare_cpu.py --workdir=runs/shakespeare
  python -m petra_jax.sample --workdir=runs/shakespeare --prompt="ROMEO:" --length=500

PETRA on ``revgpt_nano`` (4 layers, 4 heads, 128 wide, two streams) in 4 stages, context
64, each update's 32 sequences in k = 8 micro-batches (stage 0 is 0.75 update stale), AdamW
with Nesterov look-ahead whose b1 follows each stage's own delay (``adam_lookahead``,
``lookahead_rule="own_delay"``).
Results and commands: docs/language_model.md.

``:nanogpt``: backprop on the non-reversible twin ``gpt_nano`` at nanoGPT's CPU budget
(its README's laptop command: 4 layers, 4 heads, 128 wide, context 64, batch 12, 2,000
updates, dropout 0; ``config/train_shakespeare_char.py``: AdamW at 1e-3, beta2 0.99,
weight decay 0.1, 100 warm-up updates, cosine to 1e-4). nanoGPT also clips gradients
at norm 1 and ties the embedding to the head; these runs do neither.
``:revprop``: the PETRA recipe's model and budget with reversible backprop (no delays; k = 4:
exact, so k only splits the same update).
``:runlocal``: a smoke test (a tiny model, a few updates).
"""

from petra_jax import config as default

VARIANTS = ("", "nanogpt", "revprop", "runlocal")


def _nanogpt_optimizer(c, steps_per_epoch: int) -> None:
  """nanoGPT's AdamW and schedule (module docstring), in epochs of ``steps_per_epoch``."""
  c.optim.name = "adam"
  c.optim.learning_rate = 1e-3
  c.optim.adam_b2 = 0.99
  c.optim.weight_decay = 0.1
  c.optim.schedule = "cosine"
  c.optim.warmup_epochs = 100 / steps_per_epoch
  c.optim.end_learning_rate = 1e-4


def get_config(variant: str = ""):
  if variant not in VARIANTS:
    raise ValueError(f"Unknown variant {variant!r} of configs/shakespeare_cpu.py; use one of "
                     + ", ".join(f"--config=configs/shakespeare_cpu.py{':' + v if v else ''}"
                                 for v in VARIANTS) + ".")
  c = default.get_config()
  c.dataset = "tiny_shakespeare"
  c.model.name = "revgpt_nano"
  c.model.width = 32          # per head: 4 heads x 32 = 128
  c.model.context = 64
  c.model.stage_sizes = (3, 2, 2, 3)
  c.num_devices = 1
  c.steps_per_epoch = 250     # an "epoch" here: 250 updates between evaluations
  c.num_epochs = 12
  c.batch_size = 32
  c.accumulation_steps = 8
  c.eval_batch_size = 256
  c.log_every = 50
  c.checkpoint_every = 250
  _nanogpt_optimizer(c, c.steps_per_epoch)
  c.compensation.name = "adam_lookahead"
  c.compensation.lookahead_rule = "own_delay"
  if variant == "nanogpt":
    c.method = "backprop"
    c.model.name = "gpt_nano"
    c.model.stage_sizes = ()
    c.batch_size = 12
    c.accumulation_steps = 1
    c.num_epochs = 8        # 2,000 updates
    c.compensation.name = "none"
  elif variant == "revprop":
    c.method = "revprop"
    c.accumulation_steps = 4
    c.compensation.name = "none"
  elif variant == "runlocal":
    c.model.width = 8
    c.model.depth = 1
    c.model.context = 16
    c.model.stage_sizes = (1, 1, 1, 1)
    c.batch_size = 8
    c.accumulation_steps = 2
    c.steps_per_epoch = 3
    c.num_epochs = 2
    c.log_every = 1
    c.checkpoint_every = 3
    c.eval_batch_size = 512
    c.optim.warmup_epochs = 1.0
  return c
