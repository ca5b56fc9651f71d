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
# shared filesystem (every process checkpoints its own stages there). If a
# task dies, srun (--kill-on-bad-exit) stops the others and names the failed
# task; the others also stop on their own within
# --config.distributed.heartbeat_timeout_s (default 20 s).
#
# Placement with data parallelism (--config.data_parallel=D, each stage on D
# devices: state replicated, micro-batch sharded): the data axis stays inside
# a host and the pipeline axis spans the hosts. Every process contributes its
# first num_devices x D devices, cut into groups of D consecutive devices, so
# a stage's group never leaves its host: run one process per node, e.g.
#   sbatch --nodes=2 --ntasks-per-node=1 --gpus-per-task=8 launch/slurm.sh \
#     --config=configs/imagenet.py --config.data_parallel=2 --workdir=...
# (16 GPUs: 8 stages x 2). Why, in bytes (RevNet18-CIFAR, width 64,
# micro-batch 64, float32; docs/benchmarks.md "Data parallelism"): a pipeline boundary carries 4-34 MB forward and 8-67 MB
# backward per tick, but only the boundaries between hosts leave a host
# (one per host pair; cut where messages are small: 4 MB / 8 MB after
# stage 7); a data axis across hosts would all-reduce every stage's
# gradients over the network, 44.7 MB of parameters x 2(D-1)/D per update,
# all stages at once. Within a host the all-reduces ride NVLink / ICI.
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
