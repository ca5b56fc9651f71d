"""Benchmarks: throughput (paper Tables 1, 5), memory (Tables 3, 6), timeline (Fig. 1).

Run as modules::

  python -m petra_jax.benchmarks.throughput --model=revnet18 --dataset=cifar10
  python -m petra_jax.benchmarks.memory --model=revnet50 --dataset=imagenet
  python -m petra_jax.benchmarks.timeline --model=revnet18 --width=4

See ``docs/benchmarks.md`` for the measured numbers.
"""
