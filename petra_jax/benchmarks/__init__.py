"""Benchmarks: throughput (paper Tables 1, 5), memory (Tables 3, 6), timeline (Fig. 1), scaling.

Run as modules::

  python -m petra_jax.benchmarks.throughput --model=revnet18 --dataset=cifar10
  python -m petra_jax.benchmarks.memory --model=revnet50 --dataset=imagenet
  python -m petra_jax.benchmarks.timeline --model=revnet18 --width=4
  python -m petra_jax.benchmarks.scaling --processes=2
  python -m petra_jax.benchmarks.accelerator --micro-batches=64,256 --dtypes=float32,bfloat16

Modules:

* ``cli``: the flags, model and image shape every command shares.
* ``throughput``: time per step, the J-device simulation, stage balancing.
* ``memory_model``: bytes each stage stores, from shapes (Table 3's model);
  ``memory_live``: the same read from a running pipeline, and device memory
  per stage (Table 6); ``memory``: the report and its command.
* ``timeline``: a recorded schedule drawn as in Fig. 1.
* ``scaling_processes``: core pinning and the child processes;
  ``scaling_roles``: what each child measures; ``scaling``: the report and
  its command.
* ``accelerator``: images/s of backprop, petra and 1f1b on one device, the
  device's busy fraction per tick, and the reconstruction error under the
  default vs highest matmul precision.

See ``docs/benchmarks.md`` for the measured numbers.
"""
