"""Multi-process PETRA (jax.distributed on loopback, gloo): same losses, clean failure.

Each test starts ``launch/local.sh N`` running ``tests/multiprocess_worker.py``
(a 5-stage RevNet of width 4, 8 micro-batches of 8 real CIFAR-10 images, then
``train.evaluate`` on 40 test images). Stages are spread over the processes in
contiguous blocks, so every kind of message crosses a process boundary: 2
processes split [0 1 2 | 3 4], 4 processes [0 1 | 2 | 3 | 4] (activations,
``(x~, delta)`` to a reversible stage, ``(None, delta)`` to a non-reversible
one, the loss, the evaluation sums and the gradient probes' weights and
gradients). The runs share a persistent
compilation cache, so only the first one compiles the stages. About 100 s
together on a loaded 2-core machine. Select them with ``-k multiprocess``.
"""

import glob
import json
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from helpers import REPO, without_virtual_devices
from petra_jax.engine.stages import diagnostics

LAUNCH = os.path.join(REPO, "launch", "local.sh")
TIMEOUT_S = 240  # per run; a hang fails the test instead of blocking the suite


@pytest.fixture(scope="module")
def worker_env(tmp_path_factory):
  env = without_virtual_devices(os.environ)  # these processes choose their own device count
  env.update(PYTHON=sys.executable, PETRA_MODULE="tests.multiprocess_worker",
             JAX_PLATFORMS="cpu",
             JAX_COMPILATION_CACHE_DIR=str(tmp_path_factory.mktemp("jax_cache")),
             JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
             JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
  for k in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
    env.pop(k, None)
  return env


def _run(cmd, env, timeout=TIMEOUT_S):
  """``(returncode, output)``; kills the whole process group on timeout."""
  proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, start_new_session=True)
  try:
    out, _ = proc.communicate(timeout=timeout)
  except subprocess.TimeoutExpired:
    os.killpg(proc.pid, signal.SIGKILL)
    out, _ = proc.communicate()
    pytest.fail(f"{cmd} did not finish in {timeout} s:\n{out[-3000:]}")
  return proc.returncode, out


def _result(out: str) -> dict:
  lines = [l for l in out.splitlines() if "RESULT " in l]
  assert len(lines) == 1, out[-3000:]
  return json.loads(lines[0].split("RESULT ", 1)[1])


@pytest.fixture(scope="module")
def single_process(worker_env, cifar10_dir):
  rc, out = _run([sys.executable, "-m", "tests.multiprocess_worker",
                  f"--data_dir={cifar10_dir}"], worker_env)
  assert rc == 0, out[-3000:]
  return _result(out)


@pytest.mark.parametrize("num_processes", [  # 4 cross every boundary 2 do (and more); 2: long
    pytest.param(2, marks=pytest.mark.long), 4])
def test_multiprocess_losses_equal_single_process(num_processes, single_process, worker_env,
                                                  cifar10_dir):
  rc, out = _run([LAUNCH, str(num_processes), f"--data_dir={cifar10_dir}"], worker_env)
  assert rc == 0, out[-3000:]
  result = _result(out)
  assert result["num_processes"] == num_processes
  assert len(single_process["losses"]) == 8
  # Bit for bit: the same jitted stage steps on the same inputs; only the
  # route of the messages differs.
  assert result["losses"] == single_process["losses"]
  assert result["test"] == single_process["test"]
  # Gradient quality (App. B): every stage's weights and gradient gathered to
  # process 0 give the single process's figures, bit for bit.
  quality = single_process["grad_quality"]
  assert sorted(quality, key=int) == ["0", "3", "6"]
  assert all(set(q) == set(diagnostics.METRICS) and all(len(v) == 5 for v in q.values())
             for q in quality.values())
  assert result["grad_quality"] == quality
  # Time-balanced stage grouping: every process takes process 0's timings.
  balance = re.findall(r"BALANCE (\[.*\])", out)
  assert balance == ["[1, 4]"] * num_processes, out[-3000:]


def test_two_processes_of_four_devices_with_data_parallel_equal_single_process(
    single_process, worker_env, cifar10_dir):
  # 2 processes x 4 devices, data_parallel=2: 4 groups of 2 devices, the
  # stages' micro-batches sharded over each group and moved across the
  # process boundary shard by shard. Equal to one device up to float32
  # reduction order (batch sums over 2 shards).
  env = dict(worker_env, LOCAL_DEVICES="4")
  rc, out = _run([LAUNCH, "2", f"--data_dir={cifar10_dir}", "--data_parallel=2"], env)
  assert rc == 0, out[-3000:]
  result = _result(out)
  got, want = ([float.fromhex(v) for v in r["losses"]] for r in (result, single_process))
  assert len(got) == 8
  np.testing.assert_allclose(got, want, rtol=1e-5)
  assert result["test"]["test_accuracy"] == single_process["test"]["test_accuracy"]


@pytest.mark.long  # CI time; int8 on the stage devices: test_quantize_engine, crossing: [4] above
def test_int8_messages_cross_processes_as_int8(worker_env, cifar10_dir):
  # The int8 messages travel as int8 (plus float32 scales) through the
  # cross-process transfer, and the run equals the single-process int8 run.
  runs = {}
  for n in (1, 2):
    cmd = ([sys.executable, "-m", "tests.multiprocess_worker"] if n == 1 else [LAUNCH, "2"])
    rc, out = _run(cmd + [f"--data_dir={cifar10_dir}", "--quantize=int8"], worker_env)
    assert rc == 0, out[-3000:]
    runs[n] = (_result(out), out)
  assert runs[2][0]["losses"] == runs[1][0]["losses"]
  received = re.findall(r"\[process (\d)\] RECEIVED (\[.*\])", runs[2][1])
  assert sorted(received) == [("0", "['float32', 'int8']"), ("1", "['float32', 'int8']")], \
      runs[2][1][-3000:]


def test_multiprocess_killed_peer_exits_with_clear_error(worker_env, cifar10_dir):
  # Process 1 dies at tick 6, once the pair's transfers are set up: the next
  # transfer fails at once (gloo). A peer that dies before a pair's first
  # transfer is caught by the jax.distributed heartbeat instead (20 s,
  # "Terminating process because the JAX distributed service detected fatal
  # errors. This most likely indicates that another task died").
  rc, out = _run([LAUNCH, "2", f"--data_dir={cifar10_dir}", "--die_after=6"], worker_env)
  end = time.time()
  assert rc != 0, out[-3000:]
  died = re.search(r"\[process 1\] DYING at ([0-9.]+)", out)
  assert died, out[-3000:]
  # The survivor names itself and the dead peer, then exits well within 60 s.
  assert re.search(r"\[process 0\] error: process 0: .*process 1 has probably died", out), \
      out[-3000:]
  assert end - float(died.group(1)) < 60, out[-3000:]
  # The launcher says which process died first, and that both failed.
  assert "launch/local.sh: process 1 was killed by signal 9 (status 137), first to fail" in out, \
      out[-3000:]
  assert "launch/local.sh: process 0 of 2 failed" in out, out[-3000:]


@pytest.mark.long  # about a minute; logic covered by faster tests (CI time)
@pytest.mark.slow
def test_multiprocess_train_writes_the_single_process_grad_quality(worker_env, cifar10_dir,
                                                                   tmp_path):
  # The CLI with the CPU recipe's weight prediction (a forward's weights
  # differ from the current ones) on a 4-block RevNet of width 4 (stem, 2
  # reversible blocks, head), one block per stage: [0 1 | 2 3] over 2 processes.
  env = {k: v for k, v in worker_env.items() if k != "PETRA_MODULE"}
  args = ["--config=configs/cifar10_cpu.py", "--config.model.name=revnet_fixed",
          "--config.model.depth=2", "--config.model.stage_sizes=()", "--config.model.width=4",
          "--config.steps_per_epoch=4", "--config.num_epochs=1",
          "--config.grad_quality_every=2", "--config.log_every=1",
          f"--config.data_dir={cifar10_dir}"]
  rc, out = _run([sys.executable, "-m", "petra_jax.train", *args,
                  f"--workdir={tmp_path / 'one'}"], env)
  assert rc == 0, out[-3000:]
  rc, out = _run([LAUNCH, "2", *args, f"--workdir={tmp_path / 'two'}"], env)
  assert rc == 0, out[-3000:]

  def grad_quality(workdir):
    with open(workdir / "metrics.jsonl") as f:
      records = [json.loads(line) for line in f]
    return [r for r in records if any(k.startswith(diagnostics.PREFIX) for k in r)]

  one = grad_quality(tmp_path / "one")
  # k = 2: micro-batches 0 and 4 are probed, at steps 1 and 3; 4 stages.
  assert [r["step"] for r in one] == [1, 3]
  assert all(len(r) == 2 + 4 * len(diagnostics.METRICS) for r in one), one[0].keys()
  assert grad_quality(tmp_path / "two") == one  # bit for bit


@pytest.mark.long  # two processes through the CLI (CI time); one process: test_profile_window
@pytest.mark.slow
def test_each_process_traces_the_window_into_its_own_folder(worker_env, cifar10_dir, tmp_path):
  # 2 stages over 2 processes, k = 1, the host executor (one tick a call): the window 2:4 holds
  # the calls of ticks 2 and 3 in each process, as in one process (test_profile_window).
  import jax  # pylint: disable=g-import-not-at-top
  from petra_jax.training import profile_window  # pylint: disable=g-import-not-at-top
  env = {k: v for k, v in worker_env.items() if k != "PETRA_MODULE"}
  rc, out = _run([LAUNCH, "2", "--config=configs/cifar10_cpu.py", "--config.model.width=2",
                  "--config.model.num_stages=2", "--config.model.stage_sizes=()",
                  "--config.accumulation_steps=1",
                  "--config.batch_size=32", "--config.executor=host",
                  "--config.profile_steps=2:4", "--config.max_steps=8", "--config.eval_every=0",
                  "--config.checkpoint_minutes=0", "--config.checkpoint_every=0",
                  f"--config.data_dir={cifar10_dir}", f"--workdir={tmp_path}"], env)
  assert rc == 0, out[-3000:]
  for i in range(2):
    found = glob.glob(str(tmp_path / "profile" / f"process_{i}" / "**" / "*.xplane.pb"),
                      recursive=True)
    assert len(found) == 1, (i, found)
    data = jax.profiler.ProfileData.from_file(found[0])
    names = [e.name for p in data.planes for line in p.lines for e in line.events]
    assert names.count(profile_window.CALL_EVENT) == 2, (i, names.count(profile_window.CALL_EVENT))
  assert not glob.glob(str(tmp_path / "profile" / "*.xplane.pb"))
