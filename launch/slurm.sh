#!/usr/bin/env bash
# PETRA on a SLURM GPU cluster: one jax.distributed process per GPU, the
# pipeline's stages spread over all GPUs in contiguous blocks.
#
# Usage (from the repository root, on the cluster's login node):
#   sbatch --nodes=2 --ntasks-per-node=4 --gpus-per-task=1 launch/slurm.sh \
#     --config=configs/cifar10.py --workdir=/shared/runs/cifar10_8gpu
#
# Every task runs `python -m petra_jax.train --config.distributed.auto_detect=True
# [train args...]`: jax.distributed reads the coordinator (first node), the
# number of processes and this task's rank from SLURM's environment. With
# --gpus-per-task=1 each process sees one GPU (set --config.num_devices to use
# several GPUs per process with --ntasks-per-node=1 instead). Stage 0 runs on
# task 0, which also writes WORKDIR/metrics.jsonl: WORKDIR should be on a
# shared filesystem. Checkpointing is single-process for now: keep
# --config.checkpoint_every=0. If a task dies, srun (--kill-on-bad-exit) stops
# the others and names the failed task; the others also stop on their own
# within --config.distributed.heartbeat_timeout_s (default 20 s).
#
# Environment: PYTHON (default: python on PATH, e.g. an activated venv).
#SBATCH --job-name=petra
#SBATCH --output=petra-%j.out
#SBATCH --time=24:00:00
set -euo pipefail
cd "${SLURM_SUBMIT_DIR:-.}"
PYTHON=${PYTHON:-python}
export PYTHONUNBUFFERED=1
exec srun --kill-on-bad-exit=1 --label \
  "$PYTHON" -m petra_jax.train --config.distributed.auto_detect=True "$@"
