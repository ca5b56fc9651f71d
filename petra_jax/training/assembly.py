"""A training run put together: data, stages, pipeline, schedule, checkpoint.

:func:`setup` turns a config and a workdir into a :class:`Run`, the state
that the loop (:mod:`petra_jax.training.loop`) and its hooks share.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any, Callable, Optional

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
from petra_jax.training import batch_source
from petra_jax.training import checkpoint as checkpoint_lib
from petra_jax.training import distributed
from petra_jax.training import metrics as metrics_lib
from petra_jax.training import validation
from petra_jax.training.loss_log import LossLog, LossRelay


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
  loss_log: LossLog
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
  relay: Optional[LossRelay] = None  # the losses on their way to loss_log
  last_save: float = dataclasses.field(default_factory=time.time)
  executor: Any = None  # runs the ticks (:mod:`petra_jax.engine.compiled`)


def setup(config: ml_collections.ConfigDict, workdir: str) -> Run:
  """Validates the config, opens the data, builds the pipeline, restores.

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
  restored = ckpt.restore(state, [p.state_sharding for p in pipe.placements])
  step, extra, extra_arrays, start_step = 0, {}, {}, 0
  if restored is not None:
    step, state, extra, extra_arrays = restored
    start -= extra.get("wall_time", 0.0)  # metrics' wall_time goes on from the checkpoint's
    if not state.in_flight():  # drained: the stream restarts at this step
      start_step, state.tick = step, 0
  writer = metrics_lib.MetricWriter(workdir, enabled=jax.process_index() == 0,
                                    truncate_to=extra.get("metrics_offset"))
  loss_log = LossLog(writer, k, config.log_every, steps_per_epoch, lr)
  if restored is not None and jax.process_index() == 0:  # (the losses live on process 0)
    loss_log.restore(extra["loss_log"], extra_arrays)
  schedule, drain_points = _schedule(config, pipe, start_step, total_steps)
  try:
    executor = compiled.executor(pipe, config.executor, config.periods_per_dispatch)
  except compiled.Unsupported as e:
    raise validation.ConfigError(str(e)) from None
  return Run(config, workdir, info, train, test, pipe, state, schedule,
             batch_source.batch_source(config, info, train, pipe, steps_per_epoch), writer, loss_log, ckpt,
             steps_per_epoch, total_steps, step=step,
             restored_step=None if restored is None else step,
             reconstruction=probes.get("reconstruction"),
             grad_quality=probes.get("grad_quality"), start=start, drain_points=drain_points,
             relay=_loss_relay(pipe, loss_log), executor=executor)


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


TEST_SPLIT_CACHE = "PETRA_JAX_TEST_SPLIT_CACHE"  # set by tests/conftest.py only
_OPEN_SPLIT = data_lib.open_split  # the hook leaves a replaced open_split alone


def _open_split_test_cached(open_fn, dataset: str, split: str, data_dir: Optional[str],
                            limit: Optional[int] = None):
  """``open_fn(dataset, split, data_dir, limit=limit, download=False)``: the
  split's first ``limit`` examples (None: all). Test-support hook:
  with the environment variable ``PETRA_JAX_TEST_SPLIT_CACHE`` set to a
  directory, a decoded in-memory split is saved there as ``.npy`` once and
  read back by later processes (the test session's CLI runs), byte for byte
  the decoded arrays, instead of decoding the PNGs again in each process."""
  cache = os.environ.get(TEST_SPLIT_CACHE)
  if (not cache or open_fn is not _OPEN_SPLIT
      or data_lib.get_dataset_info(dataset).lazy):
    return open_fn(dataset, split, data_dir, limit=limit, download=False)
  key = "-".join(s.replace("/", "_") for s in (
      os.path.realpath(data_dir or "default"), dataset, split)).lstrip("-")
  path = os.path.join(cache, key + ".npz")
  if os.path.exists(path):
    with np.load(path) as z:
      images, labels = z["images"], z["labels"]
  else:
    opened = open_fn(dataset, split, data_dir, download=False)
    images, labels = opened.images, opened.labels
    tmp = f"{path}.{os.getpid()}.tmp.npz"
    np.savez(tmp, images=images, labels=labels)
    os.replace(tmp, path)  # atomic: concurrent test processes read whole files only
  images, labels = images[:limit], labels[:limit]
  images.flags.writeable = labels.flags.writeable = False
  return data_lib.Split(images=images, labels=labels)


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
