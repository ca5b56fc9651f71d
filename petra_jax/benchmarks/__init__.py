"""Benchmarks: throughput (paper Tables 1, 5), memory (Tables 3, 6), timeline (Fig. 1), scaling.

``python -m petra_jax.benchmarks.{throughput,memory,timeline,scaling,accelerator} --help``;
results and their commands are in ``docs/``.
"""
