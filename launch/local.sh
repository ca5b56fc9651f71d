#!/usr/bin/env bash
# Runs PETRA as N jax.distributed processes on this machine (CPU, gloo).
#
# Usage:
#   launch/local.sh N [train args...]
# e.g.
#   launch/local.sh 2 --config=configs/cifar10_cpu.py --config.steps_per_epoch=20 \
#     --config.num_epochs=1 --workdir=runs/mp2
#
# Starts N processes of `python -m petra_jax.train [train args...]` with a
# loopback coordinator on a free port; the pipeline's stages are spread over
# the N processes in contiguous blocks (stage 0 on process 0), and process 0
# writes the metrics. Each process's output is prefixed with "[process i]".
# Waits for all of them and exits with status 0 only if every process
# succeeded; otherwise it names the first process to fail (and whether it was
# killed by a signal) and each process that failed. If a process dies, the
# others exit on their own (a failed transfer, or the jax.distributed
# heartbeat); any still running LOCAL_GRACE_S seconds after the first failure
# are killed. SIGTERM or SIGINT to this script is passed on to every process
# (each checkpoints the same step and exits 75); a process exiting with 75
# and none failing otherwise is reported as preemption, with exit status 75.
# With LOCAL_RESTARTS=R, a failed job (not a preempted one) is started again,
# whole, up to R times: with checkpoints on (--config.checkpoint_every) it
# resumes from the last checkpoint every process completed. Needs bash >= 5.1.
#
# Environment:
#   PYTHON            interpreter (default: .venv/bin/python if present, else python)
#   LOCAL_DEVICES     CPU devices per process (default 1)
#   LOCAL_GRACE_S     seconds to wait for the others after a failure (default 90)
#   LOCAL_RESTARTS    restarts of the whole job after a failure (default 0)
#   COORDINATOR_PORT  coordinator port (default: a free one, new at each start)
#   PETRA_MODULE      the module to run (default petra_jax.train; the tests run
#                     tests.multiprocess_worker)
set -u -o pipefail
if ((BASH_VERSINFO[0] * 100 + BASH_VERSINFO[1] < 501)); then
  echo "launch/local.sh needs bash >= 5.1 (wait -n -p)" >&2
  exit 2
fi

if [[ $# -lt 1 || ! "$1" =~ ^[1-9][0-9]*$ ]]; then
  sed -n '2,32p' "$0" | sed 's/^# \{0,1\}//' >&2
  exit 2
fi
N=$1
shift
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-$([[ -x .venv/bin/python ]] && echo .venv/bin/python || echo python)}
GRACE=${LOCAL_GRACE_S:-90}
RESTARTS=${LOCAL_RESTARTS:-0}
PREEMPTED=75

pids=()
signalled=""
forward() {  # SIGTERM/SIGINT: every process checkpoints and exits 75
  signalled=1
  echo "launch/local.sh: $1 received; passing SIGTERM to every process" >&2
  for pid in "${pids[@]}"; do kill -TERM "$pid" 2>/dev/null; done
}
trap 'forward SIGTERM' TERM
trap 'forward SIGINT' INT

# Starts the N processes; sets pids.
start() {
  local port=${COORDINATOR_PORT:-$("$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}
  pids=()
  for ((i = 0; i < N; i++)); do
    JAX_PLATFORMS=cpu \
    JAX_COORDINATOR_ADDRESS="127.0.0.1:${port}" \
    JAX_NUM_PROCESSES="$N" \
    JAX_PROCESS_ID="$i" \
    XLA_FLAGS="${XLA_FLAGS:-} --xla_force_host_platform_device_count=${LOCAL_DEVICES:-1}" \
    PYTHONUNBUFFERED=1 \
      "$PYTHON" -m "${PETRA_MODULE:-petra_jax.train}" "$@" > >(sed -u "s/^/[process $i] /") 2>&1 &
    pids+=($!)
  done
}

# Waits for every process; sets status[i]; kills the stragglers GRACE s
# after the first failure.
wait_all() {
  local -A index
  local running=("${pids[@]}") timer="" done_pid rc i how
  for ((i = 0; i < N; i++)); do index[${pids[$i]}]=$i; done
  while ((${#running[@]} > 0)); do
    done_pid=""
    wait -n -p done_pid "${running[@]}" 2>/dev/null
    rc=$?
    if [[ -z "${done_pid:-}" ]]; then
      # A trapped signal interrupted the wait, or bash already reaped a
      # process ("no such job"): take the first one that is gone.
      for pid in "${running[@]}"; do
        if ! kill -0 "$pid" 2>/dev/null; then
          done_pid=$pid
          wait "$pid" 2>/dev/null
          rc=$?
          break
        fi
      done
      [[ -z "${done_pid:-}" ]] && continue
    fi
    i=${index[$done_pid]}
    status[$i]=$rc
    local rest=() pid
    for pid in "${running[@]}"; do [[ "$pid" != "$done_pid" ]] && rest+=("$pid"); done
    running=("${rest[@]}")
    if ((rc != 0 && rc != PREEMPTED)) && [[ -z "$timer" ]]; then
      if ((rc > 128)); then how="was killed by signal $((rc - 128))"; else how="exited with an error"; fi
      echo "launch/local.sh: process $i $how (status $rc), first to fail" >&2
      # The others should stop on their own (failed transfer or heartbeat);
      # kill whatever still runs after the grace period.
      (
        sleep "$GRACE"
        for pid in "${pids[@]}"; do
          if kill -0 "$pid" 2>/dev/null; then
            echo "launch/local.sh: process ${index[$pid]} still running ${GRACE} s after the failure; killing it" >&2
            kill -KILL "$pid" 2>/dev/null
          fi
        done
      ) &
      timer=$!
    fi
  done
  if [[ -n "$timer" ]]; then  # the timer and its sleep
    pkill -P "$timer" 2>/dev/null
    kill "$timer" 2>/dev/null
  fi
}

# 0: every process succeeded; 75: preempted; 1: failed (names the processes).
outcome() {
  local failed=0 preempted=0 i
  for ((i = 0; i < N; i++)); do
    if ((status[$i] == PREEMPTED)); then
      preempted=1
    elif ((status[$i] != 0)); then
      echo "launch/local.sh: process $i of $N failed (status ${status[$i]})" >&2
      failed=1
    fi
  done
  if ((failed)); then return 1; fi
  if ((preempted)); then
    echo "launch/local.sh: preempted (exit $PREEMPTED); re-run the same command to resume" >&2
    return $PREEMPTED
  fi
  return 0
}

for ((attempt = 0; ; attempt++)); do
  declare -A status=()
  start "$@"
  wait_all
  outcome
  rc=$?
  if ((rc != 1)) || [[ -n "$signalled" ]] || ((attempt >= RESTARTS)); then
    wait  # (the output filters)
    exit $rc
  fi
  echo "launch/local.sh: restarting the job ($((attempt + 1)) of $RESTARTS)" >&2
done
