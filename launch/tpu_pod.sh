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
# Checkpointing is single-process for now: keep --config.checkpoint_every=0.
# If a worker dies, the others stop within
# --config.distributed.heartbeat_timeout_s (default 20 s) and gcloud returns
# non-zero; each worker's output is prefixed by gcloud with its name.
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
