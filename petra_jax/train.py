"""Training entry point: ``python -m petra_jax.train --config=configs/cifar10.py``.

``main`` only parses flags; the work is in :func:`train_and_evaluate`, which
tests import. Errors in the configuration or the data end the run with one
line naming the fix, never a JAX traceback.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import os
import sys
import time
from typing import Any, Callable, Optional

import petra_jax  # noqa: F401  (applies the XLA-CPU work-around first)

from absl import app, flags, logging
import jax
from jax.experimental import multihost_utils
import jax.numpy as jnp
import ml_collections
import numpy as np
from ml_collections import config_flags
from tqdm import tqdm

from petra_jax.training import checkpoint as checkpoint_lib
from petra_jax.optim import compensation
from petra_jax import config as config_lib
from petra_jax import data as data_lib
from petra_jax.engine import diagnostics
from petra_jax.engine import methods as methods_lib
from petra_jax.training import metrics as metrics_lib
from petra_jax import models, optim
from petra_jax.engine import observers
from petra_jax.training import preemption
from petra_jax.engine import quantize as quantize_lib
from petra_jax.engine import schedule as schedule_lib
from petra_jax.engine import stage as stage_lib
from petra_jax.engine import timing
from petra_jax.engine import transport
from petra_jax.training import workdir as workdir_lib
from petra_jax.engine.pipeline import Pipeline


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
  _check_choices(config)
  _check_batch(config)
  _check_stages(config)
  if config.num_devices > num_local_devices:
    raise ConfigError(
        f"num_devices={config.num_devices} but only {num_local_devices} devices exist; "
        "use --config.num_devices=0 for all of them.")


def _check_choices(config) -> None:
  """Names that must be in a registry; methods the model supports."""
  for what, value, choices, flag in (
      ("method", config.method, tuple(methods_lib.METHODS), "method"),
      ("model", config.model.name, sorted(models.MODEL_SPECS), "model.name"),
      ("dataset", config.dataset, sorted(data_lib.DATASETS), "dataset"),
      ("optimizer", config.optim.name, optim.OPTIMIZERS, "optim.name"),
      ("schedule", config.optim.schedule, optim.SCHEDULES, "optim.schedule"),
      ("stage-balancing cost", config.model.balance_by, config_lib.BALANCE_BY,
       "model.balance_by")):
    if value not in choices:
      raise ConfigError(f"Unknown {what} {value!r}; choose one of {tuple(choices)} "
                        f"(--config.{flag}=...).")
  if (methods_lib.get(config.method).needs_reversible
      and models.MODEL_FAMILY[config.model.name] != "revnet"):
    supported = [n for n, m in methods_lib.METHODS.items() if not m.needs_reversible]
    raise ConfigError(
        f"method {config.method!r} needs a reversible model, and {config.model.name!r} is not; "
        f"{config.model.name} supports {supported}, or use a RevNet "
        f"({sorted(n for n, f in models.MODEL_FAMILY.items() if f == 'revnet')}).")
  try:
    compensation.parse_name(config.compensation.name)
  except ValueError as e:
    raise ConfigError(f"{e} (--config.compensation.name=...)") from None
  _check_numerics(config)


def _check_numerics(config) -> None:
  """``dtype``, ``stream_dtype`` and the ``quantize`` formats."""
  for flag, value, choices in (
      ("dtype", config.dtype, stage_lib.DTYPES),
      ("stream_dtype", config.stream_dtype, ("",) + stage_lib.DTYPES),
      *((f"quantize.{k}", config.quantize[k], quantize_lib.FORMATS)
        for k in quantize_lib.KINDS)):
    if value not in choices:
      raise ConfigError(f"Unknown {flag} {value!r}; choose one of {tuple(choices)} "
                        f"(--config.{flag}=...).")


def precision(config) -> stage_lib.Precision:
  """The stages' :class:`~petra_jax.engine.stage.Precision` from ``config.dtype``
  and ``config.stream_dtype``."""
  return stage_lib.Precision(config.dtype, config.stream_dtype or config.dtype)


def message_formats(config) -> quantize_lib.MessageFormats:
  """The engine's :class:`~petra_jax.engine.quantize.MessageFormats` from ``config.quantize``."""
  q = config.quantize
  return quantize_lib.MessageFormats(q.forward, q.backward, q.buffer, q.per_channel,
                                     q.stochastic)


def _check_batch(config) -> None:
  """Batch, k micro-batches, gradient-quality probes."""
  k = config.accumulation_steps
  if k < 1:
    raise ConfigError(f"accumulation_steps must be >= 1, got {k}.")
  if config.batch_size < 1:
    raise ConfigError(f"batch_size must be positive, got {config.batch_size} "
                      "(--config.batch_size=...).")
  if config.batch_size % k:
    raise ConfigError(
        f"batch_size={config.batch_size} does not split into accumulation_steps={k} "
        f"micro-batches; use a batch_size that is a multiple of {k}.")
  if config.grad_quality_every and config.method == "backprop":
    raise ConfigError("grad_quality_every compares a pipeline's gradients with exact ones; "
                      "method 'backprop' computes only exact ones: use another method or "
                      "--config.grad_quality_every=0.")


def _check_stages(config) -> None:
  """Stage counts and sizes against the model's blocks."""
  try:
    num_blocks = len(models.build_model(config.model.name, width=1, depth=_depth(config)))
  except ValueError as e:  # e.g. a depth for a model whose block counts are fixed
    raise ConfigError(str(e)) from None
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

def _depth(config):
  """``config.model.depth``, None for the model's own (0)."""
  return config.model.depth or None


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
                                       method=config.method)
    if jax.process_count() > 1:
      from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
      costs = multihost_utils.broadcast_one_to_all(np.asarray(costs, np.float32)).tolist()
    logging.info("measured ms per tick of each block: %s", [round(c, 2) for c in costs])
  return models.balanced_stage_sizes(blocks, m.num_stages, micro_shape, costs=costs)


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
  if pipe.owns_input:
    batches = data_lib.eval_batches(split, info, batch_size, pipe.input_device)
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
  first, last = pipe.input_device, pipe.output_device
  bits = values.view(np.uint32)
  if pipe.owns_input and pipe.owns_output:
    return values
  if pipe.owns_output:
    transport.transfer(jax.device_put(bits, last), last, first,
                       jax.ShapeDtypeStruct(bits.shape, bits.dtype))
  elif pipe.owns_input:
    received = transport.transfer(None, last, first, jax.ShapeDtypeStruct(bits.shape, bits.dtype))
    return np.asarray(received).view(np.float64)
  return None


class Diverged(FloatingPointError):
  """A NaN or Inf training loss; ``step`` is the first update it affects."""

  def __init__(self, value, step: int):
    super().__init__(f"train_loss is {value} at step {step}: training diverged; lower "
                     "--config.optim.learning_rate or raise --config.optim.warmup_epochs.")
    self.step = step


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
    first = step - len(self.window) // self.k + 1  # the window's first update
    self.window = []
    if not math.isfinite(value):
      raise Diverged(value, first)
    self.last_loss = value
    self.writer.write(step, epoch=step / self.steps_per_epoch, train_loss=value,
                      learning_rate=float(self.schedule(step - 1)))

  def finish(self, final_step):
    self._flush(final_step)
    if self.window:
      self._write(self.next_step)

  def check_finite(self):
    """Raises :class:`Diverged` if a loss received but not yet written is
    NaN/Inf (a host sync). After it, every update before ``next_step`` is
    known finite."""
    window = np.asarray(jax.device_get(self.window))
    if window.size and not np.all(np.isfinite(window)):
      bad = int(np.argmin(np.isfinite(window)))
      raise Diverged(window[bad], self.next_step - len(window) // self.k + bad // self.k + 1)
    for m, loss in sorted(self.losses.items()):
      if not math.isfinite(float(loss)):
        raise Diverged(float(loss), m // self.k + 1)

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


def _write_grad_quality(writer, results, k: int, steps_per_epoch: int):
  """Writes gradient-quality results (paper App. B): one line per probed
  micro-batch ``m`` at step ``m // k + 1``, keys
  ``grad_quality/<cos|norm_ratio>_<a>_<b>/stage_<j>``
  (:mod:`petra_jax.engine.diagnostics`)."""
  for m, quality in results:
    values = jax.device_get(quality)
    step = m // k + 1
    writer.write(step, epoch=step / steps_per_epoch, **{
        diagnostics.metric_key(name, j): float(v[j])
        for name, v in values.items() for j in range(len(v))})


@dataclasses.dataclass
class Run:
  """A training run between updates: what the loop and its hooks share.

  Built by :func:`setup`; ``step`` counts the updates whose micro-batches
  have all entered the pipeline (their gradients may still be in flight).
  """
  config: ml_collections.ConfigDict
  workdir: str
  info: Any
  train: Any
  test: Any
  pipe: Pipeline
  state: Any
  schedule: schedule_lib.Chained
  batches: Callable
  writer: Any
  loss_log: "_LossLog"
  checkpointer: checkpoint_lib.Checkpointer
  steps_per_epoch: int
  total_steps: int
  step: int = 0
  restored_step: Optional[int] = None
  reconstruction: Optional[observers.ReconstructionProbe] = None
  grad_quality: Optional[observers.GradientProbe] = None
  start: float = dataclasses.field(default_factory=time.time)
  result: dict = dataclasses.field(default_factory=dict)
  drain_points: dict = dataclasses.field(default_factory=dict)


def _build_pipeline(config, workdir: str, info, micro: int, steps_per_epoch: int):
  """The stages (grouped as configured), their pipeline and observers."""
  k = config.accumulation_steps
  stages = models.build_model(config.model.name, width=config.model.width, depth=_depth(config),
                              num_classes=info.num_classes, imagenet_stem=info.imagenet_stem)
  stages = stage_lib.with_precision(stages, precision(config))
  sizes = _stage_sizes(config, stages, (micro,) + info.image_shape, info.num_classes,
                       os.path.join(workdir, "checkpoints"))
  if sizes:
    stages = models.group_stages(stages, sizes)
    logging.info("stages of %s blocks each", sizes)
  devices = _devices(config)
  if not methods_lib.get(config.method).pipelined:
    devices = devices[:1]
  probes = {}
  if config.reconstruction_error_every:
    probes["reconstruction"] = observers.ReconstructionProbe(config.reconstruction_error_every, k)
  if config.grad_quality_every:
    probes["grad_quality"] = observers.GradientProbe(config.grad_quality_every, k)
  # Each stage's optimizer (and forward weights) compensate its own delay
  # tau_j in the grouped pipeline; methods without delay get the plain ones.
  delays = None if methods_lib.get(config.method).delayed else [0] * len(stages)
  pipe = Pipeline(stages, compensation.stage_optimizers(config, steps_per_epoch, len(stages),
                                                        delays), devices,
                  method=config.method, accumulation_steps=k, bn_stats=config.model.bn_stats,
                  observers=list(probes.values()),
                  predictors=compensation.stage_predictors(config, steps_per_epoch, len(stages),
                                                           delays),
                  formats=message_formats(config))
  return pipe, sizes, probes


def _batch_source(config, info, train, pipe: Pipeline, steps_per_epoch: int) -> Callable:
  """``m -> (images, labels)`` of micro-batch ``m``.

  Update ``s = m // k`` is row ``s % steps_per_epoch`` of epoch ``s //
  steps_per_epoch``'s permutation (a function of the seed and the epoch), cut
  into ``k`` micro-batches; augmentation draws from ``fold_in(key(seed + 1),
  m)``. So the data position is the micro-batch index alone, which the
  schedule gives: a resumed run reads the same batches. Processes that do
  not own stage 0 read only labels (images None).
  """
  k, micro = config.accumulation_steps, config.batch_size // config.accumulation_steps
  batch_fn = data_lib.make_train_batch_fn(info, pipe.input_device) if pipe.owns_input else None
  data_key = jax.random.key(config.seed + 1)
  epoch_rows = functools.lru_cache(maxsize=2)(lambda epoch: data_lib.batch_indices(
      len(train), config.batch_size, config.seed, epoch, steps_per_epoch))

  def batches(m: int):
    epoch, row = divmod(m // k, steps_per_epoch)
    sl = epoch_rows(epoch)[row][(m % k) * micro:(m % k + 1) * micro]
    if batch_fn is None:
      return None, data_lib.read_labels(train, sl)
    return batch_fn(train, sl, jax.random.fold_in(data_key, m))
  return batches


def setup(config: ml_collections.ConfigDict, workdir: str) -> Run:
  """Validates the config, opens the data, builds the pipeline, restores.

  Raises:
    ConfigError, data.DataError, checkpoint.CheckpointError.
  """
  start = time.time()
  validate_config(config, len(jax.local_devices()))
  _validate_multiprocess(config)
  info = data_lib.get_dataset_info(config.dataset)
  _prepare_data(config)
  # Multi-process: only stage 0's process (the one owning devices[0]) reads images.
  open_fn = (data_lib.open_split if transport.is_local(_devices(config)[0])
             else data_lib.open_labels)
  train = open_fn(config.dataset, info.train_split, config.data_dir or None, download=False)
  test = open_fn(config.dataset, info.test_split, config.data_dir or None, download=False)
  logging.info("data: %d train / %d test images, %.1f s", len(train), len(test),
               time.time() - start)
  k = config.accumulation_steps
  steps_per_epoch = _steps_per_epoch(config, len(train))
  total_steps = steps_per_epoch * config.num_epochs
  if config.max_steps:
    total_steps = min(total_steps, config.max_steps)
  pipe, sizes, probes = _build_pipeline(config, workdir, info, config.batch_size // k,
                                        steps_per_epoch)
  state = pipe.init(config.seed, jnp.zeros((config.batch_size // k,) + info.image_shape))
  logging.info("%s %s: %d stages on %s", config.method, config.model.name, pipe.num_stages,
               [d.id for d in pipe.devices])
  ckpt = _checkpointer(config, workdir, pipe, sizes)
  restored = ckpt.restore(state, pipe.devices)
  step, extra, extra_arrays, start_step = 0, {}, {}, 0
  if restored is not None:
    step, state, extra, extra_arrays = restored
    if not state.in_flight():  # drained: the stream restarts at this step
      start_step, state.tick = step, 0
    logging.info("resumed from %s/%d", ckpt.directory, step)
  writer = metrics_lib.MetricWriter(workdir, enabled=jax.process_index() == 0,
                                    truncate_to=extra.get("metrics_offset"))
  loss_log = _LossLog(writer, k, config.log_every, steps_per_epoch,
                      optim.learning_rate_schedule(config, steps_per_epoch))
  if restored is not None and jax.process_index() == 0:  # (the losses live on process 0)
    loss_log.restore(extra["loss_log"], extra_arrays)
  schedule, drain_points = _schedule(config, pipe, start_step, total_steps)
  return Run(config, workdir, info, train, test, pipe, state, schedule,
             _batch_source(config, info, train, pipe, steps_per_epoch), writer, loss_log, ckpt,
             steps_per_epoch, total_steps, step=step,
             restored_step=None if restored is None else step,
             reconstruction=probes.get("reconstruction"),
             grad_quality=probes.get("grad_quality"), start=start, drain_points=drain_points)


def _checkpointer(config, workdir: str, pipe: Pipeline, sizes) -> checkpoint_lib.Checkpointer:
  """This process's :class:`checkpoint.Checkpointer`; the fingerprint names
  what a resumed run must share (the grouping may change: resharding)."""
  return checkpoint_lib.Checkpointer(
      os.path.join(workdir, "checkpoints"), config.keep_checkpoints, fingerprint=dict(
          model=config.model.name, width=config.model.width, depth=config.model.depth,
          method=config.method, compensation=config.compensation.name,
          dataset=config.dataset, num_stages=pipe.num_stages, stage_sizes=sizes,
          batch_size=config.batch_size, accumulation_steps=config.accumulation_steps,
          seed=config.seed, dtype=config.dtype, stream_dtype=config.stream_dtype,
          quantize=[config.quantize[k] for k in quantize_lib.KINDS]
          + [config.quantize.per_channel, config.quantize.stochastic]),
      block_counts=[len(s.blocks) or 1 for s in pipe.stages])


def _schedule(config, pipe: Pipeline, start_step: int, total_steps: int):
  """The tick table from update ``start_step`` (0, or a drained checkpoint's)
  to ``total_steps``, and ``{tick: step}`` after which to checkpoint a drained
  pipeline.

  Without ``checkpoint_drain`` one stream (or the method's schedule) runs
  every update and drains once, at the end. With it the table drains every
  ``checkpoint_every`` updates (:class:`schedule.Chained`): the stream stops
  feeding until every in-flight micro-batch has finished, the checkpoint is
  taken there (reshardable), and a new stream starts; the updates' gradients
  then differ from an undrained run's (fewer stale ones).
  """
  k, every = config.accumulation_steps, config.checkpoint_every
  bounds = [start_step]
  if config.checkpoint_drain and every:
    bounds += [s for s in range(start_step + 1, total_steps) if s % every == 0]
  bounds.append(total_steps)
  parts = [pipe.schedule((b - a) * k) for a, b in zip(bounds, bounds[1:])]
  chained = schedule_lib.Chained(tuple(parts), tuple(a * k for a in bounds[:-1]))
  points = dict(zip(chained.ends()[:-1], bounds[1:-1])) if config.checkpoint_drain else {}
  return chained, points


def _prepare_data(config) -> None:
  """Checks the data set, downloads and prepares it if missing as
  ``config.download`` says (None: CIFAR only; True: any; False: never):
  process 0 only, the others wait for it."""
  if config.download is False:
    return  # never download: opening the data checks it, in every process
  if jax.process_index() == 0:
    data_lib.ensure_prepared(config.dataset, config.data_dir or None, download=config.download)
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
    multihost_utils.sync_global_devices("petra_jax data prepared")


def _steps_per_epoch(config, num_examples: int) -> int:
  full = num_examples // config.batch_size
  if config.steps_per_epoch > full:
    raise ConfigError(f"steps_per_epoch={config.steps_per_epoch} but the training split holds "
                      f"only {full} batches of {config.batch_size}; use "
                      f"--config.steps_per_epoch <= {full} (0: the whole split).")
  return config.steps_per_epoch or full


def _log_diagnostics(run: Run, wait: bool = False) -> None:
  """Writes the reconstruction errors and gradient qualities measured so far
  (computed ticks ago: reading them does not wait, unless ``wait``)."""
  k = run.config.accumulation_steps
  if run.reconstruction is not None:
    for m, j, err in run.reconstruction.pop_results():
      run.writer.write(m // k + 1, **{f"reconstruction_error/stage_{j}": float(err)})
  if run.grad_quality is not None:
    _write_grad_quality(run.writer, run.grad_quality.pop_results(wait), k, run.steps_per_epoch)


def save_checkpoint(run: Run) -> None:
  """Saves the whole pipeline at ``run.step`` (never a diverged state).

  Multi-process: every process calls it at the same step and saves its part.
  """
  # Checkpoints up to the last update whose losses are all known finite are
  # good; older good ones beyond keep_checkpoints can go. Newer ones still
  # have micro-batches in flight whose loss may yet be NaN: kept until then.
  run.checkpointer.prune(verified_through=_verified_through(run))
  _log_diagnostics(run, wait=True)  # (not checkpointed)
  log_meta, log_arrays = run.loss_log.state()
  run.checkpointer.save(run.step, run.state, extra={
      "loss_log": log_meta, "metrics_offset": run.writer.offset()}, extra_arrays=log_arrays)


def _verified_through(run: Run) -> int:
  """The updates whose losses are all known finite (process 0's count, on
  every process).

  Raises:
    Diverged: a received loss is NaN/Inf (on every process of the run).
  """
  try:
    run.loss_log.check_finite()
    verified = run.loss_log.next_step
  except Diverged as e:
    if not run.pipe.multiprocess:
      raise
    verified = -e.step  # (steps count from 1)
  if run.pipe.multiprocess:
    verified = int(multihost_utils.broadcast_one_to_all(np.int32(verified)))
  if verified < 0:
    raise Diverged(float("nan"), -verified)
  return verified


def evaluate_and_log(run: Run) -> None:
  """Test metrics with the current weights, written at ``run.step``."""
  result = evaluate(run.pipe, run.state, run.test, run.info, run.config.eval_batch_size)
  result["wall_time"] = time.time() - run.start
  run.writer.write(run.step, epoch=run.step / run.steps_per_epoch, **result)
  if "test_loss" in result:  # (process 0 only in multi-process runs)
    tqdm.write(f"epoch {math.ceil(run.step / run.steps_per_epoch)}: train_loss "
               f"{run.loss_log.last_loss:.4f} test_loss {result['test_loss']:.4f} "
               f"test_accuracy {result['test_accuracy']:.4f} ({result['wall_time']:.0f} s)")
  run.result = result


def on_update(run: Run) -> None:
  """Periodic hooks after update ``run.step`` entered the pipeline: logs,
  mid-epoch checkpoints, and at an epoch's end evaluation and checkpoint.
  The last update's are in :func:`finish`."""
  c, step = run.config, run.step
  if step == run.total_steps:
    return
  if step % c.log_every == 0:
    _log_diagnostics(run)
  epoch_end = step % run.steps_per_epoch == 0
  if epoch_end and c.eval_every and (step // run.steps_per_epoch) % c.eval_every == 0:
    evaluate_and_log(run)
  if c.checkpoint_every and step % c.checkpoint_every == 0 and not c.checkpoint_drain:
    save_checkpoint(run)


def finish(run: Run) -> dict:
  """After the last tick: the last losses, evaluation and checkpoint."""
  run.loss_log.finish(run.total_steps)
  _log_diagnostics(run, wait=True)
  evaluate_and_log(run)
  if run.config.checkpoint_every and (run.restored_step or 0) < run.total_steps:
    save_checkpoint(run)
  run.checkpointer.prune(verified_through=run.total_steps)  # every loss is in
  run.checkpointer.wait()
  run.checkpointer.close()
  run.writer.close()
  return run.result


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str) -> dict:
  """Trains ``config.model`` with ``config.method`` and evaluates it.

  Runs the method's schedule (:mod:`petra_jax.engine.schedule`) tick by tick over
  ``total_steps * k`` micro-batches. Writes ``WORKDIR/metrics.jsonl``
  (``step``, ``epoch``, ``train_loss``, ``learning_rate`` every ``log_every``
  updates; ``test_loss``, ``test_accuracy`` at each evaluation) and
  TensorBoard events; with ``reconstruction_error_every``,
  ``reconstruction_error/stage_<j>``; with ``grad_quality_every``, per-stage
  gradient cosines and norm ratios (``grad_quality/cos_applied_e2e/stage_3``,
  ...; :mod:`petra_jax.engine.diagnostics`).

  Returns:
    The last evaluation's metrics plus ``wall_time`` (seconds since start).

  Raises:
    ConfigError, data.DataError: bad config or missing data.
    FloatingPointError: a NaN or Inf training loss.
  """
  run = setup(config, workdir)
  bar = tqdm(total=run.total_steps * config.batch_size, initial=run.step * config.batch_size,
             unit="img", unit_scale=True, desc=config.method,
             disable=None if jax.process_index() == 0 else True, mininterval=2.0)
  with preemption.StopOnSignal(announce=False) as stop, _discard_diverged(run):
    for t in range(run.state.tick, len(run.schedule)):
      tick = run.schedule[t]
      run.state, outputs = run.pipe.run_tick(run.state, tick, run.batches)
      for out in outputs:
        if out.loss is not None:  # (None off process 0)
          run.loss_log.add(out.micro_batch, out.loss)
      if t + 1 in run.drain_points:  # (checkpoint_drain) the pipeline is empty
        save_checkpoint(run)
      if _update_fed(run, tick):
        bar.update(config.batch_size)
        on_update(run)
        if _stop_requested(run, stop) and run.step < run.total_steps:
          preempt(run, stop.signal_name or "a signal to another process")
  bar.close()
  with _discard_diverged(run):
    return finish(run)


@contextlib.contextmanager
def _discard_diverged(run: Run):
  """On :class:`Diverged` at step N, deletes the checkpoints at steps >= N
  (they hold the diverging micro-batch in flight), so the newest one left
  is good."""
  try:
    yield
  except Diverged as e:
    run.checkpointer.discard_from(e.step)
    raise


def _update_fed(run: Run, tick) -> bool:
  """Whether ``tick`` fed the last micro-batch of an update; sets ``run.step``."""
  m = schedule_lib.fed(tick)
  if m is None or (m + 1) % run.config.accumulation_steps:
    return False
  run.step = (m + 1) // run.config.accumulation_steps
  return True


def _stop_requested(run: Run, stop: preemption.StopOnSignal) -> bool:
  """Whether to stop at this update: a signal here, or (multi-process) on
  any process. Every process of the run gets the same answer at the same
  update (a small collective at every update boundary), so all of them save
  the same step."""
  if not run.pipe.multiprocess:
    return stop.requested
  flags_ = multihost_utils.process_allgather(np.int32(stop.requested))
  return bool(np.any(flags_))


def preempt(run: Run, signal_name: str) -> None:
  """SIGTERM/SIGINT: checkpoint at this update, one line, exit 75.

  The signal is acted on at the first update boundary after it (at most k
  ticks); a run re-started with the same command resumes there with the
  losses of an uninterrupted run. Multi-process: every process saves its
  part of the same step and exits 75; process 0 prints the line.
  """
  if run.checkpointer.latest_step() != run.step:
    save_checkpoint(run)
  run.checkpointer.wait()
  run.checkpointer.close()
  run.writer.close()
  message = (f"preempted by {signal_name} at step {run.step}: checkpoint saved in "
             f"{run.checkpointer.directory}; re-run the same command to resume.")
  if run.pipe.multiprocess:  # skip jax.distributed's shutdown barrier
    _exit_now(message if jax.process_index() == 0 else "", preemption.PREEMPTED_EXIT_CODE)
  preemption.exit_preempted(message)


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
    with _workdir_lock(_WORKDIR.value):
      train_and_evaluate(_CONFIG.value, _WORKDIR.value)
  except transport.PeerError as e:
    _exit_now(f"error: process {jax.process_index()}: {e}")
  except (ConfigError, data_lib.DataError, checkpoint_lib.CheckpointError, FloatingPointError,
          ValueError, workdir_lib.WorkdirBusyError) as e:
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


def _workdir_lock(workdir: str):
  """Held for the run's lifetime by process 0: a second run on the same
  ``--workdir`` is refused (:class:`petra_jax.training.workdir.WorkdirLock`)."""
  if jax.process_index() == 0:
    return workdir_lib.WorkdirLock(workdir)
  return contextlib.nullcontext()


def _exit_now(message: str, status: int = 1):
  """Prints ``message`` and exits with ``status`` at once, skipping
  ``jax.distributed``'s shutdown barrier (whose peers may be dead)."""
  if message:
    print(message, file=sys.stderr, flush=True)
  sys.stdout.flush()
  os._exit(status)


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
