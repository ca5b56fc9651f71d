"""A training run put together: data, stages, pipeline, schedule, checkpoint.

:func:`setup` turns a config and a workdir into a :class:`Setup`, what the
loop (:mod:`petra_jax.training.loop`) and its hooks read and never change, and
the run's :class:`Progress` (its state, step, last checkpoint, last evaluation).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
import types
from typing import Any, Callable, Mapping, NamedTuple, Optional

from absl import logging
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

from petra_jax import data as data_lib
from petra_jax import models, optim
from petra_jax.models import auxiliary
from petra_jax.engine import compiled
from petra_jax.engine.methods import forward_gradient as fg_lib
from petra_jax.engine import methods as methods_lib
from petra_jax.engine.stages import objective
from petra_jax.engine import observers
from petra_jax.engine.stages import partition
from petra_jax.engine.arrays import quantize as quantize_lib
from petra_jax.engine import schedules as schedule_lib
from petra_jax.engine.stages import stage as stage_lib
from petra_jax.engine import timing
from petra_jax.engine.transport import transfers as transport
from petra_jax.engine.pipeline import Pipeline
from petra_jax.optim import compensation
from petra_jax.data import batch_source
from petra_jax.training import checkpoint as checkpoint_lib
from petra_jax.training import distributed
from petra_jax.training import metrics as metrics_lib
from petra_jax.training import profile_window
from petra_jax.training import validation
from petra_jax.training.loss_log import LossLog, LossRelay


@dataclasses.dataclass(frozen=True, eq=False)
class Setup:
  """A training run as set up: what stays the same from its first update to its last.

  Built by :func:`setup` (with the run's :class:`Progress`); the loop
  (:mod:`petra_jax.training.loop`) and its hooks read it and never reassign a
  field. Some fields are stateful objects (the writer, the loss log and its
  relay, the checkpointer, the executor, the batch source, the probes): the
  same object for the whole run.

  Attributes:
    config, workdir: the validated config and the run's directory.
    info, train, test: the data set's ``DatasetInfo`` and its opened splits.
    pipe: the :class:`Pipeline` of the stages.
    schedule: the tick table from the restored update (or 0) to ``total_steps``.
    batches: ``m -> micro-batch m`` (:func:`batch_source.batch_source`).
    writer, loss_log, relay: the metrics writer, the ``train_loss`` log and the
      losses' way to it (multi-process: to process 0).
    checkpointer: this process's :class:`checkpoint.Checkpointer`.
    executor: runs the ticks (:mod:`petra_jax.engine.compiled`).
    steps_per_epoch, total_steps: updates per epoch and in the whole run.
    restored_step: the update of the checkpoint the run resumed from (None: a new run).
    start: the wall-clock origin of the metrics' ``wall_time`` (a resumed run's
      goes on from its checkpoint's).
    began: ``time.time()`` when this process set the run up (the checkpoint timer's origin
      before its first save).
    drain_points: ``{tick: update}`` after which the pipeline is drained and
      checkpointed (``checkpoint_drain``; else empty).
    reconstruction, grad_quality: the observers of ``reconstruction_error_every``
      and ``grad_quality_every`` (None when off).
  """
  config: ml_collections.ConfigDict
  workdir: str
  info: Any
  train: Any
  test: Any
  pipe: Pipeline
  schedule: schedule_lib.Chained
  batches: Callable
  writer: Any
  loss_log: LossLog
  relay: LossRelay
  checkpointer: checkpoint_lib.Checkpointer
  executor: Any
  steps_per_epoch: int
  total_steps: int
  restored_step: Optional[int] = None
  start: float = 0.0
  began: float = dataclasses.field(default_factory=time.time)
  drain_points: Mapping[int, int] = dataclasses.field(
      default_factory=lambda: types.MappingProxyType({}))
  reconstruction: Optional[observers.ReconstructionProbe] = None
  grad_quality: Optional[observers.GradientProbe] = None


@dataclasses.dataclass
class Progress:
  """How far a run has come: what changes between updates.

  Only the loop (:func:`petra_jax.training.loop.train_and_evaluate`) assigns
  its fields; the hooks read it and return the new values.

  Attributes:
    state: the pipeline's state (its TrainStates, in-flight buffers, tick).
    step: the updates whose micro-batches have all entered the pipeline
      (their gradients may still be in flight).
    last_save: ``time.time()`` of this run's last checkpoint; None before its first.
    result: the last evaluation's metrics plus ``wall_time`` (empty before one).
  """
  state: Any
  step: int = 0
  last_save: Optional[float] = None
  result: dict = dataclasses.field(default_factory=dict)


def setup(config: ml_collections.ConfigDict, workdir: str) -> tuple[Setup, Progress]:
  """Validates the config, opens the data, builds the pipeline, restores.

  Args:
    config: the run's config (:mod:`petra_jax.config`).
    workdir: the run's directory; its newest checkpoint, if any, is restored.

  Returns:
    ``(setup, progress)``: the run's :class:`Setup` and its :class:`Progress` at
    the restored update (a new run: update 0, the initial state).

  Raises:
    ConfigError, data.DataError, checkpoint.CheckpointError.
  """
  start = time.time()
  validation.validate_config(config, len(jax.local_devices()))
  validation.validate_multiprocess(config)
  info, train, test = _open_data(config)
  if isinstance(train, data_lib.TextSplit) and jax.process_index() == 0:
    data_lib.save_vocabulary(workdir, train.vocabulary)  # sampling reads it
  k = config.accumulation_steps
  steps_per_epoch = validation.steps_per_epoch(config, len(train))
  total_steps = steps_per_epoch * config.num_epochs
  if config.max_steps:
    total_steps = min(total_steps, config.max_steps)
  lr = optim.learning_rate_schedule(config, steps_per_epoch)  # built once per run
  pipe, sizes, probes = build_pipeline(config, workdir, info, config.batch_size // k,
                                       steps_per_epoch, lr_schedule=lr)
  state = pipe.init(config.seed, jnp.zeros((config.batch_size // k,) + info.image_shape))
  logging.info("%s %s: %d stages on %s", config.method, config.model.name, pipe.num_stages,
               [d.id for d in pipe.devices])
  ckpt = checkpointer(config, workdir, pipe, sizes)
  restored = _restore(ckpt, pipe, state)
  writer = metrics_lib.MetricWriter(workdir, enabled=jax.process_index() == 0,
                                    truncate_to=restored.extra.get("metrics_offset"))
  loss_log = LossLog(writer, k, config.log_every, steps_per_epoch, lr)
  if restored.step is not None and jax.process_index() == 0:  # (the losses live on process 0)
    loss_log.restore(restored.extra["loss_log"], restored.extra_arrays)
  schedule, drain_points = _schedule(config, pipe, restored.start_step, total_steps)
  try:
    executor = compiled.executor(pipe, config.executor, config.periods_per_dispatch,
                                 config.unroll_ticks, config.order_writes)
  except compiled.Unsupported as e:
    raise validation.ConfigError(str(e)) from None
  batches = profile_window.traced(  # (a trace shows the loop's waits for data)
      batch_source.batch_source(config, info, train, pipe, steps_per_epoch),
      profile_window.BATCHES_EVENT)
  run = Setup(config, workdir, info, train, test, pipe, schedule, batches, writer, loss_log,
              _loss_relay(pipe, loss_log), ckpt, executor, steps_per_epoch,
              total_steps, restored_step=restored.step,
              start=start - restored.extra.get("wall_time", 0.0),  # wall_time goes on
              drain_points=types.MappingProxyType(drain_points),
              reconstruction=probes.get("reconstruction"), grad_quality=probes.get("grad_quality"))
  return run, Progress(restored.state, step=restored.step or 0)


class _Restored(NamedTuple):
  """What :func:`setup` takes from the newest checkpoint (a new run: ``step`` None)."""
  step: Optional[int]
  state: Any
  extra: dict
  extra_arrays: dict
  start_step: int  # the schedule's first update: 0, or a drained checkpoint's step


def _restore(ckpt: checkpoint_lib.Checkpointer, pipe: Pipeline, state) -> _Restored:
  """The newest checkpoint's state, or ``state`` itself with nothing restored."""
  restored = ckpt.restore(state, [p.state_sharding for p in pipe.placements])
  if restored is None:
    return _Restored(None, state, {}, {}, 0)
  step, state, extra, extra_arrays = restored
  start_step = 0
  if not state.in_flight():  # drained: the stream restarts at this step
    start_step, state.tick = step, 0
  return _Restored(step, state, extra, extra_arrays, start_step)


def _loss_relay(pipe: Pipeline, loss_log: LossLog) -> LossRelay:
  """Multi-process: the losses cross from the last stage to process 0 once
  per flush (the pipeline leaves them where they are computed)."""
  if not pipe.multiprocess:
    return LossRelay(loss_log)
  J, spec_move = pipe.num_stages, pipe.messages.move
  return LossRelay(loss_log, lambda x, spec: spec_move(x, J - 1, 0, spec))


def _open_data(config):
  """``(info, train, test)``; a process that does not feed stage 0 opens
  the labels only. Downloads first with ``config.download``."""
  start = time.time()
  info = data_lib.get_dataset_info(config.dataset)
  _prepare_data(config)
  if info.objective != "classification":  # text: every process reads the characters
    return data_lib.open_text(config.dataset, config.model.context or info.image_shape[0],
                              config.data_dir or None, download=False)
  # Multi-process: only stage 0's process (the one owning devices[0]) reads images.
  open_fn = (data_lib.open_split if transport.is_local(distributed.devices(config)[0])
             else data_lib.open_labels)
  train, test = (_open_split_test_cached(open_fn, config.dataset, split, config.data_dir or None,
                                         limit)
                 for split, limit in ((info.train_split, None),
                                      (info.test_split, config.eval_examples or None)))
  logging.info("data: %d train / %d test images, %.1f s", len(train), len(test),
               time.time() - start)
  return info, train, test


TEST_SPLIT_CACHE = "PETRA_JAX_TEST_SPLIT_CACHE"  # set by tests/conftest.py and .ci/run only
_OPEN_SPLIT = data_lib.open_split  # the hook leaves a replaced open_split alone


def _open_split_test_cached(open_fn, dataset: str, split: str, data_dir: Optional[str],
                            limit: Optional[int] = None):
  """``open_fn(dataset, split, data_dir, limit=limit, download=False)``: the
  split's first ``limit`` examples (None: all). Test-support hook:
  with the environment variable ``PETRA_JAX_TEST_SPLIT_CACHE`` set to a
  directory, a decoded in-memory split is saved there as ``.npz`` once and
  read back by later processes (the test session's CLI runs, CI's newest-stack
  check), byte for byte the decoded arrays, instead of decoding the PNGs again
  in each process; processes that ask at once wait for the first one's file."""
  cache = os.environ.get(TEST_SPLIT_CACHE)
  if (not cache or open_fn is not _OPEN_SPLIT
      or data_lib.get_dataset_info(dataset).lazy):
    return open_fn(dataset, split, data_dir, limit=limit, download=False)
  key = "-".join(s.replace("/", "_") for s in (
      os.path.realpath(data_dir or "default"), dataset, split)).lstrip("-")
  path = os.path.join(cache, key + ".npz")
  with _cache_lock(path):  # one process decodes, the others wait and read its file
    if os.path.exists(path):
      with np.load(path) as z:
        images, labels = z["images"], z["labels"]
    else:
      opened = open_fn(dataset, split, data_dir, download=False)
      images, labels = opened.images, opened.labels
      tmp = f"{path}.{os.getpid()}.tmp.npz"
      np.savez(tmp, images=images, labels=labels)
      os.replace(tmp, path)  # atomic: a reader without the lock sees whole files only
  images, labels = images[:limit], labels[:limit]
  images.flags.writeable = labels.flags.writeable = False
  return data_lib.Split(images=images, labels=labels)


@contextlib.contextmanager
def _cache_lock(path: str):
  """An exclusive ``flock`` on ``path + '.lock'`` (POSIX; elsewhere no lock)."""
  try:
    import fcntl  # noqa: PLC0415  (POSIX only)
  except ImportError:
    yield
    return
  with open(path + ".lock", "w") as f:
    fcntl.flock(f, fcntl.LOCK_EX)
    yield


def _prepare_data(config) -> None:
  """Checks the data set, downloads and prepares it if missing as
  ``config.download`` says (None: CIFAR only; True: any; False: never):
  process 0 only, the others wait for it."""
  if config.download is False:
    return  # never download: opening the data checks it, in every process
  if jax.process_index() == 0:
    data_lib.ensure_prepared(config.dataset, config.data_dir or None, download=config.download)
  if jax.process_count() > 1:
    distributed.barrier("petra_jax data prepared")


def precision(config) -> stage_lib.Precision:
  """The stages' :class:`~petra_jax.engine.stages.stage.Precision` from ``config.dtype``
  and ``config.stream_dtype``."""
  return stage_lib.Precision(config.dtype, config.stream_dtype or config.dtype)


def message_formats(config) -> quantize_lib.MessageFormats:
  """The engine's :class:`~petra_jax.engine.arrays.quantize.MessageFormats` from ``config.quantize``."""
  q = config.quantize
  return quantize_lib.MessageFormats(q.forward, q.backward, q.buffer, q.per_channel,
                                     q.stochastic)


def stage_sizes(config: ml_collections.ConfigDict, blocks, micro_shape, num_classes: int,
                checkpoint_dir: str):
  """Blocks per stage from ``config.model``, or None for one block per stage.

  ``stage_sizes`` if set; else, with ``num_stages``, the grouping that
  minimises the slowest stage's cost (:func:`partition.balanced_stage_sizes`):
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
      costs = distributed.broadcast_floats(costs)
    logging.info("measured ms per tick of each block: %s", [round(c, 2) for c in costs])
  return partition.balanced_stage_sizes(blocks, m.num_stages, micro_shape, costs=costs)


def build_pipeline(config, workdir: str, info, micro: int, steps_per_epoch: int,
                   lr_schedule: Optional[optax.Schedule] = None):
  """The stages (grouped as configured), their pipeline and observers; every
  stage's optimizer and predictor share the learning-rate schedule ``lr_schedule``
  (built here when None).

  Returns:
    ``(pipe, sizes, probes)``: the :class:`Pipeline`, the blocks per stage
    (None: one each), and ``{"reconstruction"|"grad_quality": observer}``.
  """
  k = config.accumulation_steps
  stages = models.build_model(config.model.name, width=config.model.width,
                              depth=validation.depth(config), num_classes=info.num_classes,
                              imagenet_stem=info.imagenet_stem,
                              patch_size=config.model.patch_size or None,
                              tokenizer=config.model.tokenizer)
  stages = stage_lib.with_precision(stages, precision(config))
  stages = stage_lib.with_reversible_backward(stages, config.model.reversible_backward)
  sizes = stage_sizes(config, stages, (micro,) + info.image_shape, info.num_classes,
                      os.path.join(workdir, "checkpoints"))
  if sizes:
    stages = partition.group_stages(stages, sizes)
    logging.info("stages of %s blocks each", sizes)
  devices = distributed.devices(config)
  if not methods_lib.get(config.method).pipelined:
    devices = devices[:config.data_parallel]
  probes = {}
  if config.reconstruction_error_every:
    probes["reconstruction"] = observers.ReconstructionProbe(config.reconstruction_error_every, k)
  if config.grad_quality_every:
    probes["grad_quality"] = observers.GradientProbe(config.grad_quality_every, k)
  # Each stage's optimizer (and forward weights) compensate its own delay
  # tau_j in the grouped pipeline; methods without delay get the plain ones.
  delays = None if methods_lib.get(config.method).delayed else [0] * len(stages)
  if lr_schedule is None:
    lr_schedule = optim.learning_rate_schedule(config, steps_per_epoch)
  stages, options = method_setup(config, stages, info.num_classes)
  pipe = Pipeline(stages, compensation.stage_optimizers(config, steps_per_epoch, len(stages),
                                                        delays, lr_schedule=lr_schedule), devices,
                  method=config.method, accumulation_steps=k, bn_stats=config.model.bn_stats,
                  observers=list(probes.values()),
                  predictors=compensation.stage_predictors(config, steps_per_epoch, len(stages),
                                                           delays, lr_schedule=lr_schedule),
                  formats=message_formats(config), send_losses=False,
                  data_parallel=config.data_parallel, objective=objective.get(info.objective), **options)
  return pipe, sizes, probes


def method_setup(config, stages, num_classes: int) -> tuple:
  """``(stages, Pipeline options)`` of ``config.method``: auxiliary heads
  (``config.auxiliary``) for ``local`` and for forward gradients with a local
  guess; ``forward_gradient``'s options (``config.forward_gradient``)."""
  updates = methods_lib.get(config.method).updates
  if updates == "backward":
    return stages, {}
  fg = config.forward_gradient
  if updates == "local" or fg.guess == "local":
    stages = auxiliary.with_heads(stages, config.auxiliary.head, num_classes,
                                  config.auxiliary.hidden)
  if updates == "local":
    return stages, {}
  options = fg_lib.Options(guess=fg.guess, perturb=fg.perturb, emulate=fg.emulate, eps=fg.eps,
                           projection=fg.projection, seed=config.seed)
  return stages, {"forward_gradient": options}


def checkpointer(config, workdir: str, pipe: Pipeline, sizes) -> checkpoint_lib.Checkpointer:
  """This process's :class:`checkpoint.Checkpointer`; the fingerprint names
  what a resumed run must share (the grouping may change: resharding)."""
  return checkpoint_lib.Checkpointer(
      os.path.join(workdir, "checkpoints"), config.keep_checkpoints, fingerprint=dict(
          model=config.model.name, width=config.model.width, depth=config.model.depth,
          patch_size=config.model.patch_size, tokenizer=config.model.tokenizer,
          context=config.model.context, method=config.method, compensation=config.compensation.name,
          dataset=config.dataset, num_stages=pipe.num_stages, stage_sizes=sizes,
          batch_size=config.batch_size, accumulation_steps=config.accumulation_steps,
          seed=config.seed, dtype=config.dtype, stream_dtype=config.stream_dtype,
          quantize=[config.quantize[k] for k in quantize_lib.PAYLOADS]
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
