"""Training entry point: ``python -m petra_jax.train --config=configs/cifar10.py``.

``main`` only parses flags; the work is in :func:`train_and_evaluate`, which
tests import. Errors in the configuration or the data end the run with one
line naming the fix, never a JAX traceback.
"""

from __future__ import annotations

import math
import os
import sys
import time

import petra_jax  # noqa: F401  (applies the XLA-CPU work-around first)

from absl import app, flags, logging
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from ml_collections import config_flags
from tqdm import tqdm

from petra_jax import checkpoint as checkpoint_lib
from petra_jax import config as config_lib
from petra_jax import data as data_lib
from petra_jax import diagnostics
from petra_jax import metrics as metrics_lib
from petra_jax import models, optim
from petra_jax import timing
from petra_jax import transport
from petra_jax.pipeline import Pipeline


class ConfigError(ValueError):
  """A configuration value that cannot work; the message names the fix."""


def validate_config(config: ml_collections.ConfigDict, num_local_devices: int) -> None:
  """Checks the config before anything is built.

  Raises:
    ConfigError: unknown method, model, dataset, optimizer or schedule; a
      method the model does not support; more stages than blocks;
      ``accumulation_steps < 1``; a batch
      that does not split into k micro-batches, more devices than exist.
  """
  for what, value, choices, flag in (
      ("method", config.method, config_lib.METHODS, "method"),
      ("model", config.model.name, sorted(models.MODEL_SPECS), "model.name"),
      ("dataset", config.dataset, sorted(data_lib.DATASETS), "dataset"),
      ("optimizer", config.optim.name, optim.OPTIMIZERS, "optim.name"),
      ("schedule", config.optim.schedule, optim.SCHEDULES, "optim.schedule"),
      ("stage-balancing cost", config.model.balance_by, config_lib.BALANCE_BY,
       "model.balance_by")):
    if value not in choices:
      raise ConfigError(f"Unknown {what} {value!r}; choose one of {tuple(choices)} "
                        f"(--config.{flag}=...).")
  if (config.method in config_lib.RECONSTRUCTING_METHODS
      and models.MODEL_FAMILY[config.model.name] != "revnet"):
    supported = [m for m in config_lib.METHODS if m not in config_lib.RECONSTRUCTING_METHODS]
    raise ConfigError(
        f"method {config.method!r} needs a reversible model, and {config.model.name!r} is not; "
        f"{config.model.name} supports {supported}, or use a RevNet "
        f"({sorted(n for n, f in models.MODEL_FAMILY.items() if f == 'revnet')}).")
  k = config.accumulation_steps
  if k < 1:
    raise ConfigError(f"accumulation_steps must be >= 1, got {k}.")
  if config.batch_size < 1 or config.batch_size % k:
    raise ConfigError(
        f"batch_size={config.batch_size} does not split into accumulation_steps={k} "
        f"micro-batches; use a batch_size that is a multiple of {k}.")
  if config.grad_quality_every and config.method == "backprop":
    raise ConfigError("grad_quality_every compares a pipeline's gradients with exact ones; "
                      "method 'backprop' computes only exact ones: use another method or "
                      "--config.grad_quality_every=0.")
  num_blocks = len(models.build_model(config.model.name, width=1))
  num_stages = len(config.model.stage_sizes) or config.model.num_stages
  if num_stages > num_blocks:
    raise ConfigError(
        f"model.num_stages={num_stages} but {config.model.name} has only {num_blocks} blocks "
        f"(one per stage at most); use --config.model.num_stages <= {num_blocks}.")
  if config.model.stage_sizes and (sum(config.model.stage_sizes) != num_blocks
                                   or min(config.model.stage_sizes) < 1
                                   or len(config.model.stage_sizes) < 2):
    raise ConfigError(
        f"model.stage_sizes={tuple(config.model.stage_sizes)} must be at least 2 positive "
        f"block counts summing to {config.model.name}'s {num_blocks} blocks.")
  if num_stages == 1:
    raise ConfigError("model.num_stages=1: a pipeline needs at least 2 stages; use 0 for one "
                      "block per stage.")
  if config.num_devices > num_local_devices:
    raise ConfigError(
        f"num_devices={config.num_devices} but only {num_local_devices} devices exist; "
        "use --config.num_devices=0 for all of them.")


def _stage_sizes(config: ml_collections.ConfigDict, blocks, micro_shape, num_classes: int,
                 checkpoint_dir: str):
  """Blocks per stage from ``config.model``, or None for one block per stage.

  ``stage_sizes`` if set; else, with ``num_stages``, the grouping that
  minimises the slowest stage's cost (:func:`models.balanced_stage_sizes`):
  forward FLOPs, or with ``balance_by="time"`` each block's forward and
  backward timed on this process's first device. Timings vary from run to
  run, so a resumed run reuses the grouping saved in its checkpoint, and in a
  multi-process run every process takes process 0's timings.
  """
  m = config.model
  if m.stage_sizes:
    return [int(n) for n in m.stage_sizes]
  if not m.num_stages:
    return None
  costs = None
  if m.balance_by == "time":
    saved = None if jax.process_count() > 1 else checkpoint_lib.saved_fingerprint(checkpoint_dir)
    if saved and saved.get("stage_sizes") and len(saved["stage_sizes"]) == m.num_stages:
      logging.info("stage grouping from the checkpoint: %s", saved["stage_sizes"])
      return list(saved["stage_sizes"])
    logging.info("timing the forward and backward of each of %d blocks for model.balance_by="
                 "'time' (compiles each block once)", len(blocks))
    costs = timing.measure_stage_costs(blocks, micro_shape, num_classes, jax.local_devices()[0],
                                       method=_pipeline_method(config.method, blocks))
    if jax.process_count() > 1:
      from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
      costs = multihost_utils.broadcast_one_to_all(np.asarray(costs, np.float32)).tolist()
    logging.info("measured ms per tick of each block: %s", [round(c, 2) for c in costs])
  return models.balanced_stage_sizes(blocks, m.num_stages, micro_shape, costs=costs)


def _pipeline_method(method: str, stages) -> str:
  """The engine's method: revprop is petra drained after every micro-batch;
  backprop only uses the engine for evaluation."""
  if method in ("revprop", "backprop"):
    return "petra" if models.supports_reversible(stages) else "dsp"
  return method


def _devices(config) -> list:
  """The stages' devices: the first ``num_devices`` (0: all) of each
  process, in process order (stage 0 on process 0)."""
  n = config.num_devices
  if jax.process_count() == 1:
    devices = jax.local_devices()
    return devices[:n] if n else devices
  by_process = {}
  for d in jax.devices():
    by_process.setdefault(d.process_index, []).append(d)
  return [d for p in sorted(by_process) for d in (by_process[p][:n] if n else by_process[p])]


def _validate_multiprocess(config) -> None:
  """Raises ConfigError for what a multi-process run does not support."""
  if jax.process_count() == 1:
    return
  if config.method == "backprop":
    raise ConfigError("method 'backprop' runs on one device; run it in a single process "
                      "(without launch/*.sh or jax.distributed).")
  if config.checkpoint_every:
    raise ConfigError("checkpointing is single-process for now: use "
                      "--config.checkpoint_every=0 in multi-process runs.")


def initialize_distributed(config: ml_collections.ConfigDict) -> bool:
  """Starts ``jax.distributed`` when ``config.distributed`` or the
  environment asks for it; call before any JAX computation.

  ``coordinator_address``, ``num_processes`` and ``process_id`` fall back to
  ``$JAX_COORDINATOR_ADDRESS``, ``$JAX_NUM_PROCESSES`` and ``$JAX_PROCESS_ID``;
  with ``auto_detect`` jax fills what is unset from SLURM, a TPU pod or MPI.
  CPU collectives use gloo. A peer that stops sending heartbeats for
  ``heartbeat_timeout_s`` makes the others terminate.

  Returns:
    True if ``jax.distributed`` was initialised, False for a single process.

  Raises:
    ConfigError: the processes did not all join within
      ``initialization_timeout_s`` (or the coordinator is unreachable).
  """
  d = config.distributed
  address = d.coordinator_address or os.environ.get("JAX_COORDINATOR_ADDRESS", "")
  if not address and not d.auto_detect:
    return False
  num = d.num_processes or int(os.environ.get("JAX_NUM_PROCESSES", "0")) or None
  pid = d.process_id if d.process_id >= 0 else os.environ.get("JAX_PROCESS_ID")
  pid = int(pid) if pid is not None else None
  transport.enable_cpu_collectives()
  try:
    jax.distributed.initialize(
        coordinator_address=address or None, num_processes=num, process_id=pid,
        initialization_timeout=d.initialization_timeout_s,
        heartbeat_timeout_seconds=d.heartbeat_timeout_s,
        shutdown_timeout_seconds=d.shutdown_timeout_s)
  except Exception as e:  # pylint: disable=broad-except  (jaxlib's runtime errors)
    raise ConfigError(
        f"process {pid} could not join the {num}-process run at {address!r} within "
        f"{d.initialization_timeout_s} s: {str(e).splitlines()[0]}. Start every process "
        "with the same coordinator address (process 0's host:port) and num_processes.") from None
  logging.info("jax.distributed: process %d of %d, %d local / %d global devices",
               jax.process_index(), jax.process_count(), jax.local_device_count(),
               jax.device_count())
  return True


def evaluate(pipe: Pipeline, state, split, info, batch_size: int):
  """Test loss and accuracy over the whole split (the last batch is padded).

  Args:
    split: from ``data.open_split`` (in memory, or lazy for ImageNet).

  Multi-process: every process calls it; stage 0's process reads the images,
  the last stage's process the labels and sums the loss and the hits, which
  it sends to process 0 (as float64 bits: the same numbers as one process).

  Returns:
    ``{"test_loss": float, "test_accuracy": float}`` (accuracy in [0, 1]);
    ``{}`` on processes other than 0 in a multi-process run.
  """
  n = len(split)
  loss_sum, correct = 0.0, 0
  if pipe.local[0]:
    batches = data_lib.eval_batches(split, info, batch_size, pipe.devices[0])
  else:  # another process feeds stage 0: predict only needs the shape
    like = jax.ShapeDtypeStruct((batch_size,) + info.image_shape, jnp.float32)
    batches = ((like, data_lib.read_labels(split, np.arange(s, min(s + batch_size, n))),
                min(batch_size, n - s)) for s in range(0, n, batch_size))
  for images, labels, valid in batches:
    logits = pipe.predict(state, images)
    if logits is None:  # the last stage is another process's
      continue
    logits = np.asarray(logits)[:valid]
    logp = logits - np.log(np.exp(logits - logits.max(1, keepdims=True)).sum(1, keepdims=True)) \
        - logits.max(1, keepdims=True)
    loss_sum += float(-logp[np.arange(valid), labels].sum())
    correct += int((logits.argmax(1) == labels).sum())
  if pipe.multiprocess:
    sums = _to_process_0(pipe, np.array([loss_sum, correct], np.float64))
    if sums is None:
      return {}
    loss_sum, correct = sums
  return {"test_loss": loss_sum / n, "test_accuracy": correct / n}


def _to_process_0(pipe: Pipeline, values: np.ndarray):
  """float64 ``values`` computed by the last stage's process, on process 0
  (sent as their uint32 bits, exactly); None on other processes."""
  first, last = pipe.devices[0], pipe.devices[-1]
  bits = values.view(np.uint32)
  if pipe.local[0] and pipe.local[-1]:
    return values
  if pipe.local[-1]:
    transport.transfer(jax.device_put(bits, last), last, first,
                       jax.ShapeDtypeStruct(bits.shape, bits.dtype))
  elif pipe.local[0]:
    received = transport.transfer(None, last, first, jax.ShapeDtypeStruct(bits.shape, bits.dtype))
    return np.asarray(received).view(np.float64)
  return None


class _LossLog:
  """Collects per-micro-batch losses (device scalars) and writes train lines.

  A batch's line is written once its k losses exist; PETRA's arrive ``J-1``
  ticks after their micro-batch entered. Converting them to floats then costs
  no wait: those ticks have been dispatched long since.
  """

  def __init__(self, writer, k, log_every, steps_per_epoch, schedule):
    self.writer, self.k, self.log_every = writer, k, log_every
    self.steps_per_epoch, self.schedule = steps_per_epoch, schedule
    self.losses: dict[int, jax.Array] = {}
    self.next_step = 0
    self.window: list = []
    self.last_loss = float("nan")

  def add(self, micro_batch: int, loss: jax.Array):
    self.losses[micro_batch] = loss
    self._flush()

  def _flush(self, final_step: int | None = None):
    while all(self.next_step * self.k + i in self.losses for i in range(self.k)):
      s = self.next_step
      self.window.extend(self.losses.pop(s * self.k + i) for i in range(self.k))
      self.next_step += 1
      if self.next_step % self.log_every == 0 or self.next_step == final_step:
        self._write(s + 1)

  def _write(self, step):
    value = float(np.mean(jax.device_get(self.window)))
    self.window = []
    if not math.isfinite(value):
      raise FloatingPointError(
          f"train_loss is {value} at step {step}: training diverged; lower "
          "--config.optim.learning_rate or raise --config.optim.warmup_epochs.")
    self.last_loss = value
    self.writer.write(step, epoch=step / self.steps_per_epoch, train_loss=value,
                      learning_rate=float(self.schedule(step - 1)))

  def finish(self, final_step):
    self._flush(final_step)
    if self.window:
      self._write(self.next_step)

  def check_finite(self, k: int):
    """Raises FloatingPointError if a pending loss is NaN/Inf (a host sync)."""
    for m, loss in sorted(self.losses.items()):
      if not math.isfinite(float(loss)):
        raise FloatingPointError(
            f"train_loss is {float(loss)} at step {m // k + 1}: training diverged; lower "
            "--config.optim.learning_rate or raise --config.optim.warmup_epochs.")
    if self.window and not np.all(np.isfinite(jax.device_get(self.window))):
      raise FloatingPointError(
          f"train_loss is not finite before step {self.next_step}: training diverged; lower "
          "--config.optim.learning_rate or raise --config.optim.warmup_epochs.")

  def state(self):
    """``(json, arrays)``: what a checkpoint needs to resume the log exactly."""
    arrays = dict(self.losses)
    arrays.update({-(i + 1): v for i, v in enumerate(self.window)})
    return {"next_step": self.next_step, "window": len(self.window),
            "last_loss": self.last_loss}, arrays

  def restore(self, meta, arrays):
    self.next_step, self.last_loss = meta["next_step"], meta["last_loss"]
    self.window = [arrays[-(i + 1)] for i in range(meta["window"])]
    self.losses = {m: v for m, v in arrays.items() if m >= 0}


def _write_grad_quality(writer, state, k: int, steps_per_epoch: int, wait: bool = False):
  """Writes the gradient-quality results (paper App. B) that are computed.

  One line per probed micro-batch ``m`` at step ``m // k + 1``, keys
  ``grad_quality/<cos|norm_ratio>_<a>_<b>/stage_<j>`` (see
  :mod:`petra_jax.diagnostics`). Results still being computed stay in
  ``state.grad_quality`` for the next call (no wait on the hot path), unless
  ``wait``.
  """
  pending = []
  for m, quality in state.grad_quality:
    if not wait and not all(v.is_ready() for v in quality.values()):
      pending.append((m, quality))
      continue
    values = jax.device_get(quality)
    step = m // k + 1
    writer.write(step, epoch=step / steps_per_epoch, **{
        diagnostics.metric_key(name, j): float(v[j])
        for name, v in values.items() for j in range(len(v))})
  state.grad_quality[:] = pending


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str) -> dict:
  """Trains ``config.model`` with ``config.method`` and evaluates it.

  Writes ``WORKDIR/metrics.jsonl`` (``step``, ``epoch``, ``train_loss``,
  ``learning_rate`` every ``log_every`` updates; ``test_loss``,
  ``test_accuracy`` at each evaluation) and TensorBoard events; with
  ``grad_quality_every``, per-stage gradient cosines and norm ratios
  (``grad_quality/cos_petra_e2e/stage_3``, ...; :mod:`petra_jax.diagnostics`)
  at the step of each probed micro-batch.

  Returns:
    The last evaluation's metrics plus ``wall_time`` (seconds since start).

  Raises:
    ConfigError, data.DataError: bad config or missing data.
    FloatingPointError: a NaN or Inf training loss.
  """
  start = time.time()
  devices = _devices(config)
  validate_config(config, len(jax.local_devices()))
  _validate_multiprocess(config)
  info = data_lib.get_dataset_info(config.dataset)
  data_dir = config.data_dir or None
  # Multi-process: only stage 0's process (the one owning devices[0]) reads images.
  open_fn = data_lib.open_split if transport.is_local(devices[0]) else data_lib.open_labels
  train = open_fn(config.dataset, info.train_split, data_dir)
  test = open_fn(config.dataset, info.test_split, data_dir)
  logging.info("data: %d train / %d test images, %.1f s", len(train),
               len(test), time.time() - start)

  k = config.accumulation_steps
  micro = config.batch_size // k
  steps_per_epoch = config.steps_per_epoch or len(train) // config.batch_size
  total_steps = steps_per_epoch * config.num_epochs
  if config.max_steps:
    total_steps = min(total_steps, config.max_steps)
  num_epochs = -(-total_steps // steps_per_epoch)
  tx = optim.make_optimizer(config, steps_per_epoch)
  schedule = optim.learning_rate_schedule(config, steps_per_epoch)

  stages = models.build_model(config.model.name, width=config.model.width,
                              num_classes=info.num_classes,
                              imagenet_stem=models.DATASETS[config.dataset].imagenet_stem)
  sizes = _stage_sizes(config, stages, (micro,) + info.image_shape, info.num_classes,
                       os.path.join(workdir, "checkpoints"))
  if sizes:
    stages = models.group_stages(stages, sizes)
    logging.info("stages of %s blocks each", sizes)
  if config.method == "backprop":
    devices = devices[:1]
  pipe = Pipeline(stages, tx, devices, bn_stats=config.model.bn_stats,
                  method=_pipeline_method(config.method, stages),
                  probe_every=config.reconstruction_error_every * k,
                  grad_probe_every=config.grad_quality_every * k)
  state = pipe.init(config.seed, jnp.zeros((micro,) + info.image_shape))
  logging.info("%s %s: %d stages on %s", config.method, config.model.name, len(stages),
               [d.id for d in pipe.devices])

  # Augmentation keys are fold_in(data_key, micro_batch) and the epoch's
  # permutation is a function of (seed, epoch): the data position is
  # (epoch, step, micro_batch), all saved in checkpoints.
  batch_fn = data_lib.make_train_batch_fn(info, pipe.devices[0])
  data_key = jax.random.key(config.seed + 1)
  micro_batch = step = 0
  ckpt = restored = None
  if not pipe.multiprocess:  # (checkpointing is single-process for now)
    ckpt = checkpoint_lib.Checkpointer(
        os.path.join(workdir, "checkpoints"), config.keep_checkpoints, fingerprint=dict(
            model=config.model.name, width=config.model.width, method=config.method,
            dataset=config.dataset, num_stages=len(stages), stage_sizes=sizes,
            batch_size=config.batch_size,
            accumulation_steps=k, seed=config.seed))
    restored = ckpt.restore(state, pipe.devices)
  metrics_offset = None
  if restored is not None:
    step, state, extra, extra_arrays = restored
    micro_batch, metrics_offset = extra["micro_batch"], extra["metrics_offset"]
    logging.info("resumed from %s/%d", ckpt.directory, step)
  writer = metrics_lib.MetricWriter(workdir, enabled=jax.process_index() == 0,
                                    truncate_to=metrics_offset)
  loss_log = _LossLog(writer, k, config.log_every, steps_per_epoch, schedule)
  if restored is not None:
    loss_log.restore(extra["loss_log"], extra_arrays)

  def save_checkpoint():
    loss_log.check_finite(k)  # never save a diverged state over a good one
    _write_grad_quality(writer, state, k, steps_per_epoch, wait=True)  # (not checkpointed)
    log_meta, log_arrays = loss_log.state()
    ckpt.save(step, state, extra={"micro_batch": micro_batch, "loss_log": log_meta,
                                  "metrics_offset": writer.offset()},
              extra_arrays=log_arrays)

  result = {}
  bar = tqdm(total=total_steps * config.batch_size, initial=step * config.batch_size,
             unit="img", unit_scale=True, desc=config.method,
             disable=None if jax.process_index() == 0 else True, mininterval=2.0)
  for epoch in range(step // steps_per_epoch, num_epochs):
    offset = step - epoch * steps_per_epoch
    for idx in data_lib.batch_indices(len(train), config.batch_size, config.seed,
                                      epoch, steps_per_epoch)[offset:total_steps - step + offset]:
      for i in range(k):
        sl = idx[i * micro:(i + 1) * micro]
        if pipe.local[0]:
          images, labels = batch_fn(train, sl, jax.random.fold_in(data_key, micro_batch))
        else:  # another process feeds stage 0 (multi-process)
          images, labels = None, data_lib.read_labels(train, sl)
        if config.method not in ("revprop", "backprop"):  # the asynchronous methods
          state, out = pipe.tick(state, images, labels)
          if out is not None and out.loss is not None:  # (None off process 0)
            loss_log.add(out.micro_batch, out.loss)
        else:
          step_fn = pipe.revprop_step if config.method == "revprop" else pipe.backprop_step
          state, loss = step_fn(state, images, labels)
          if loss is not None:
            loss_log.add(micro_batch, loss)
        micro_batch += 1
      step += 1
      bar.update(config.batch_size)
      if state.reconstruction_errors and step % config.log_every == 0:
        for m, j, err in state.reconstruction_errors:  # computed ticks ago: no wait
          writer.write(m // k + 1, **{f"reconstruction_error/stage_{j}": float(err)})
        state.reconstruction_errors.clear()
      if state.grad_quality and step % config.log_every == 0:
        _write_grad_quality(writer, state, k, steps_per_epoch)
      if (config.checkpoint_every and step % config.checkpoint_every == 0
          and step % steps_per_epoch and step < total_steps):
        save_checkpoint()  # (at an epoch's end, after its evaluation below)
    last_epoch = step == total_steps
    if last_epoch:  # finish the in-flight micro-batches (their updates count)
      state, outs = pipe.drain(state)
      for out in outs:
        if out.loss is not None:
          loss_log.add(out.micro_batch, out.loss)
      loss_log.finish(total_steps)
      _write_grad_quality(writer, state, k, steps_per_epoch, wait=True)
    if last_epoch or (config.eval_every and (epoch + 1) % config.eval_every == 0):
      result = evaluate(pipe, state, test, info, config.eval_batch_size)
      result["wall_time"] = time.time() - start
      writer.write(step, epoch=step / steps_per_epoch, **result)
      if "test_loss" in result:  # (process 0 only in multi-process runs)
        bar.write(f"epoch {epoch + 1}: train_loss {loss_log.last_loss:.4f} "
                  f"test_loss {result['test_loss']:.4f} test_accuracy "
                  f"{result['test_accuracy']:.4f} ({result['wall_time']:.0f} s)")
    if config.checkpoint_every and step % config.checkpoint_every == 0 and step < total_steps:
      save_checkpoint()
  if config.checkpoint_every and (restored is None or restored[0] < total_steps):
    save_checkpoint()
  if ckpt is not None:
    ckpt.wait()
    ckpt.close()
  bar.close()
  writer.close()
  return result


_CONFIG = config_flags.DEFINE_config_file("config", None, "Path to a config file.",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", "runs/default", "Directory for metrics and checkpoints.")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  try:
    distributed = initialize_distributed(_CONFIG.value)
  except ConfigError as e:
    _exit_now(f"error: {e}")
  try:
    train_and_evaluate(_CONFIG.value, _WORKDIR.value)
  except transport.PeerError as e:
    _exit_now(f"error: process {jax.process_index()}: {e}")
  except (ConfigError, data_lib.DataError, checkpoint_lib.CheckpointError, FloatingPointError,
          ValueError) as e:
    if distributed:
      _exit_now(f"error: process {jax.process_index()}: {e}")
    sys.exit(f"error: {e}")
  except Exception as e:  # pylint: disable=broad-except
    if not distributed:
      raise
    # e.g. a runtime error surfacing after a peer died: name this process and
    # exit now rather than wait at jax.distributed's shutdown barrier.
    logging.exception("process %d failed", jax.process_index())
    _exit_now(f"error: process {jax.process_index()}: {type(e).__name__}: {e}")


def _exit_now(message: str):
  """Prints ``message`` and exits with status 1 at once, skipping
  ``jax.distributed``'s shutdown barrier (whose peers may be dead)."""
  print(message, file=sys.stderr, flush=True)
  sys.stdout.flush()
  os._exit(1)


def _parse_flags(argv):
  """absl's flag parsing, with a bad ``--config.*`` override as one line."""
  try:
    return flags.FLAGS(argv)
  except (KeyError, AttributeError, TypeError, ValueError) as e:
    # ml_collections raises these (not flags.Error) for an unknown field or a
    # value of the wrong type; its message has a "did you mean" hint.
    message = str(e.args[0] if e.args else e).replace("\n", " ")
    sys.exit(f"error: bad config override: {message}. See petra_jax/config.py for the "
             "fields and their types.")
  except flags.Error as e:
    sys.exit(f"error: {e}\nPass --helpfull to list the flags.")


if __name__ == "__main__":
  flags.mark_flags_as_required(["config"])
  app.run(main, flags_parser=_parse_flags)
