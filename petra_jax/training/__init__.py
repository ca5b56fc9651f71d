"""The training run: loop, checkpoints, workdir, preemption and metrics."""
