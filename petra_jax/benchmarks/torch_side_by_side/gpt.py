"""A plain PyTorch decoder in nanoGPT's layout, timed: the other side of ``torch_side_by_side``.

``PY petra_jax/benchmarks/torch_gpt.py --layers=L --heads=H --dim=D --context=T --vocab=V
--batch-size=B [--iters=N] [--warmup=W] [--threads=N]`` (``PY``: a Python with torch) prints one
JSON line: the median ms of one AdamW step (forward, backward, update) on random int tokens
``[B, T]``, the parameter count, torch's version. Run as a file: imports torch and the standard
library only (no JAX, no petra_jax).

The model (nanoGPT's ``model.py`` layout, written here): token + learned position embeddings,
``L`` pre-LayerNorm blocks ``x + attn(LN(x))``, ``x + mlp(LN(x))`` (causal multi-head
attention with a fused q, k, v projection; MLP ``D -> 4D -> D`` with exact GELU), a final
LayerNorm and a Dense over the vocabulary with a bias; biases everywhere, no dropout, no
weight tying (as ``gpt_*`` in petra_jax/models/gpt.py). Loss: mean cross-entropy over
``[B, T]`` next tokens. AdamW(lr 1e-3, betas (0.9, 0.99), weight decay 0.1 on every
parameter, as optax.adamw on our side).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time


def _modules():
  """``(Block, Decoder)`` classes; torch imported here (only the torch Python has it)."""
  import torch  # noqa: PLC0415
  from torch import nn  # noqa: PLC0415
  from torch.nn import functional as F  # noqa: PLC0415,N812

  class Block(nn.Module):
    """``[B, T, D] -> [B, T, D]``: causal self-attention then MLP, each pre-LayerNorm."""

    def __init__(self, dim: int, heads: int):
      super().__init__()
      self.heads = heads
      self.ln_attn, self.ln_mlp = nn.LayerNorm(dim), nn.LayerNorm(dim)
      self.qkv, self.attn_out = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
      self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def attention(self, x):
      b, t, d = x.shape
      q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2)
                 for z in self.qkv(x).split(d, dim=2))
      y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
      return self.attn_out(y.transpose(1, 2).reshape(b, t, d))

    def forward(self, x):
      x = x + self.attention(self.ln_attn(x))
      return x + self.mlp(self.ln_mlp(x))

  class Decoder(nn.Module):
    """ids ``int64[B, T]`` -> mean next-token cross-entropy against ``targets [B, T]``."""

    def __init__(self, layers: int, heads: int, dim: int, context: int, vocab: int):
      super().__init__()
      self.tokens, self.positions = nn.Embedding(vocab, dim), nn.Embedding(context, dim)
      self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
      self.ln_f, self.head = nn.LayerNorm(dim), nn.Linear(dim, vocab)
      for p in self.parameters():
        if p.dim() == 2:
          nn.init.normal_(p, std=0.02)

    def forward(self, ids, targets):
      x = self.tokens(ids) + self.positions(torch.arange(ids.shape[1]))
      for block in self.blocks:
        x = block(x)
      logits = self.head(self.ln_f(x))
      return F.cross_entropy(logits.flatten(0, 1), targets.flatten())

  return Block, Decoder


def run(layers: int, heads: int, dim: int, context: int, vocab: int, batch: int, iters: int,
        warmup: int, threads: int) -> dict:
  """``{"ms_per_step": {"backprop": median ms}, "params": int, "torch": str, "threads": int}``."""
  import torch  # noqa: PLC0415
  torch.set_num_threads(threads)
  torch.manual_seed(0)
  model = _modules()[1](layers, heads, dim, context, vocab)
  opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.99), weight_decay=0.1)
  ids = torch.randint(0, vocab, (batch, context + 1))
  x, y = ids[:, :-1], ids[:, 1:]

  def step() -> float:
    t = time.perf_counter()
    opt.zero_grad(set_to_none=True)
    model(x, y).backward()
    opt.step()
    return 1e3 * (time.perf_counter() - t)

  times = [step() for _ in range(warmup + iters)][warmup:]
  return {"ms_per_step": {"backprop": statistics.median(times)},
          "params": sum(p.numel() for p in model.parameters()),
          "torch": torch.__version__, "threads": threads}


def _parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  for name, what in (("layers", "decoder blocks"), ("heads", "attention heads"),
                     ("dim", "features D"), ("context", "tokens T"),
                     ("vocab", "vocabulary V"), ("batch-size", "sequences B")):
    p.add_argument(f"--{name}", type=int, required=True, help=what)
  p.add_argument("--iters", type=int, default=5, help="measured steps")
  p.add_argument("--warmup", type=int, default=1, help="unmeasured steps first")
  p.add_argument("--threads", type=int, default=2, help="torch threads")
  return p


def main(argv=None) -> int:
  a = _parser().parse_args(argv)
  print(json.dumps(run(a.layers, a.heads, a.dim, a.context, a.vocab, a.batch_size, a.iters,
                       a.warmup, a.threads)))
  return 0


if __name__ == "__main__":
  sys.exit(main())
