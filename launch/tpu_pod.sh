#!/usr/bin/env bash
# PETRA on a Cloud TPU VM pod slice: one jax.distributed process per TPU VM
# host, the pipeline's stages spread over all TPU chips in contiguous blocks.
#
# Usage (from a workstation with gcloud; the repository and its venv must
# already be at REPO_DIR on every worker, e.g. via
# `gcloud compute tpus tpu-vm scp --worker=all`):
#   TPU_NAME=my-v4-32 ZONE=us-central2-b REPO_DIR=~/petra_jax \
#     launch/tpu_pod.sh --config=configs/imagenet.py --workdir=/mnt/shared/runs/imagenet
#
# Runs `python -m petra_jax.train --config.distributed.auto_detect=True
# [train args...]` on every worker at once (gcloud ... ssh --worker=all);
# jax.distributed finds the coordinator, the number of processes and each
# worker's id from the TPU metadata. Worker 0 runs stage 0 and writes
# WORKDIR/metrics.jsonl (a local path on worker 0, or a shared mount).
# Checkpoints are written by every process (each its own stages).
# If a worker dies, the others stop within
# --config.distributed.heartbeat_timeout_s (default 20 s) and gcloud returns
# non-zero; each worker's output is prefixed by gcloud with its name.
#
# Placement with data parallelism (--config.data_parallel=D, each stage on D
# devices: state replicated, micro-batch sharded): the data axis stays inside
# a host and the pipeline axis spans the hosts. Every process contributes its
# first num_devices x D devices, cut into groups of D consecutive devices, so
# a stage's group never leaves its host. Why, in bytes (RevNet18-CIFAR,
# width 64, micro-batch 64, float32; docs/benchmarks.md "Data parallelism"):
# a pipeline boundary carries 4-34 MB forward and 8-67 MB
# backward per tick, but only the boundaries between hosts leave a host
# (one per host pair; cut where messages are small: 4 MB / 8 MB after
# stage 7); a data axis across hosts would all-reduce every stage's
# gradients over the network, 44.7 MB of parameters x 2(D-1)/D per update,
# all stages at once. Within a host the all-reduces ride NVLink / ICI.
#
# Environment: TPU_NAME, ZONE (required); PROJECT (optional); REPO_DIR
# (default ~/petra_jax); PYTHON (default .venv/bin/python in REPO_DIR).
set -euo pipefail
: "${TPU_NAME:?set TPU_NAME to the TPU VM name}"
: "${ZONE:?set ZONE to the TPU zone}"
REPO_DIR=${REPO_DIR:-"~/petra_jax"}
PYTHON=${PYTHON:-.venv/bin/python}
args=$(printf ' %q' "$@")
exec gcloud compute tpus tpu-vm ssh "$TPU_NAME" --zone="$ZONE" ${PROJECT:+--project="$PROJECT"} \
  --worker=all --command="cd $REPO_DIR && PYTHONUNBUFFERED=1 $PYTHON -m petra_jax.train \
--config.distributed.auto_detect=True${args}"
