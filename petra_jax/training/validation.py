"""Config checks before anything is built: one line per bad value, naming the fix.

:func:`validate_config` runs first in every training run
(:func:`petra_jax.training.assembly.setup`); each failed check raises one
:class:`ConfigError` whose message names the ``--config.<field>`` to change.
The numeric bounds live in one table, :data:`RANGES`.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import ml_collections

from petra_jax import config as config_lib
from petra_jax import data as data_lib
from petra_jax.engine import compiled
from petra_jax import models, optim
from petra_jax.engine import methods as methods_lib
from petra_jax.engine.arrays import precision as precision_lib
from petra_jax.engine.arrays import quantize as quantize_lib
from petra_jax.engine.stages import stage as stage_lib
from petra_jax.optim import compensation
from petra_jax.training import profile_window


class ConfigError(ValueError):
  """A configuration value that cannot work; the message names the fix."""


@dataclasses.dataclass(frozen=True)
class Range:
  """The values a numeric field may take: ``low <= v`` (``low < v`` when
  ``low_open``) and ``v < high`` (``v <= high`` when ``high_closed``).

  Attributes:
    flag: the field, as in ``--config.<flag>``.
    low, high: the bounds (``math.inf``: none above).
    low_open: whether ``low`` itself is refused.
    high_closed: whether ``high`` itself is allowed.
    why: what the bound protects against, shown in the error.
  """
  flag: str
  low: float
  high: float = math.inf
  low_open: bool = False
  high_closed: bool = False
  why: str = ""

  def allows(self, value) -> bool:
    """Whether ``value`` (int or float) is inside the range."""
    above = value > self.low if self.low_open else value >= self.low
    below = value <= self.high if self.high_closed else value < self.high
    return above and below

  def describe(self) -> str:
    """``">= 0"``, ``"> 0"``, ``"in [0, 1)"``."""
    low = f"{'>' if self.low_open else '>='} {self.low:g}"
    if self.high == math.inf:
      return low
    return (f"in {'(' if self.low_open else '['}{self.low:g}, {self.high:g}"
            f"{']' if self.high_closed else ')'}")


# Every numeric field with a bound, in config.py's order.
RANGES = (
    Range("model.width", 1, why="channels per stream"),
    Range("model.depth", 0, why="0: the model's own depth"),
    Range("model.num_stages", 0, why="0: one block per stage"),
    Range("model.patch_size", 0, why="0: the ViT's default patch"),
    Range("batch_size", 1, why="images per update"),
    Range("periods_per_dispatch", 1, why="periods per compiled call"),
    Range("unroll_ticks", 1, why="ticks per iteration of the compiled loop"),
    Range("accumulation_steps", 1, why="micro-batches per update"),
    Range("num_epochs", 1, why="0 epochs is a run with no training steps"),
    Range("steps_per_epoch", 0, why="0: the whole training split"),
    Range("max_steps", 0, why="0: num_epochs epochs"),
    Range("eval_every", 0, why="0: evaluate at the end only"),
    Range("evals_per_epoch", 1, why="evaluations in an evaluated epoch"),
    Range("eval_batch_size", 1, why="images per evaluation batch"),
    Range("eval_examples", 0, why="0: the whole test split"),
    Range("prefetch", 0, why="0: off"),
    Range("log_every", 1, why="updates between train_loss lines"),
    Range("progress_seconds", 0, why="0: no progress lines off a terminal"),
    Range("num_devices", 0, why="0: all local devices"),
    Range("data_parallel", 1, why="devices per stage"),
    Range("seed", 0, why="NumPy's generators take no negative seed"),
    Range("reconstruction_error_every", 0, why="0: off"),
    Range("grad_quality_every", 0, why="0: off"),
    Range("checkpoint_every", 0, why="0: off"),
    Range("checkpoint_minutes", 0, why="0: checkpoint_every only"),
    Range("keep_checkpoints", 1, why="0 would delete every checkpoint to resume from"),
    Range("distributed.preemption_check_every", 1,
          why="updates between the processes' agreements to stop"),
    Range("optim.learning_rate", 0,
          why="0: 0.1 * batch_size / 256; a negative rate climbs the loss"),
    Range("optim.momentum", 0, 1, why="1 or more never forgets a gradient"),
    Range("optim.weight_decay", 0, why="a negative decay grows the weights"),
    Range("optim.warmup_epochs", 0, why="0: no warm-up"),
    Range("optim.decay_factor", 0, low_open=True,
          why="0 stops training, a negative factor climbs the loss"),
    Range("optim.end_learning_rate", 0, why="a negative rate climbs the loss"),
    Range("optim.polynomial_power", 0, low_open=True, why="the decay's exponent"),
    Range("optim.trust_coefficient", 0, low_open=True, why="lars' eta"),
    Range("optim.lars_eps", 0, why="added to a norm"),
    Range("optim.adam_b1", 0, 1, why="a moving average's decay"),
    Range("optim.adam_b2", 0, 1, why="a moving average's decay"),
    Range("optim.adam_eps", 0, why="added to a root mean square"),
    Range("optim.muon_learning_rate", 0, low_open=True, why="muon's rate"),
    Range("optim.muon_momentum", 0, 1, why="a moving average's decay"),
    Range("optim.momentum_decay", 0, why="nadamw's psi: 0 keeps mu_t = b1 / 2"),
    Range("optim.clip_norm", 0, why="0: no clipping"),
    Range("compensation.lr_power", 0, why="a negative power raises the rate with the delay"),
    Range("compensation.pipemare_warmup_epochs", 0, why="pipemare's warm-up"),
    Range("compensation.prediction_scale", 0, why="a negative horizon predicts backwards"),
    Range("compensation.lookahead_momentum", 0, 1, why="a momentum"),
    Range("compensation.lookahead_delay_ref", 0, why="0: stage 0's delay"),
)


def validate_config(config: ml_collections.ConfigDict, num_local_devices: int) -> None:
  """Checks the config before anything is built.

  Args:
    config: the run config (:mod:`petra_jax.config`).
    num_local_devices: devices of this process (``len(jax.local_devices())``).

  Raises:
    ConfigError: unknown method, model, dataset, optimizer, schedule or
      format; a method the model does not support; a numeric field outside
      its :data:`RANGES`; a warm-up longer than the run; ``model.num_stages``
      and ``model.stage_sizes`` that disagree, more stages than blocks; a
      batch that does not split into k micro-batches; more devices than exist;
      a ``profile_steps`` that is not ``'START:STOP'``.
  """
  _check_choices(config)
  _check_task(config)
  _check_numerics(config)
  _check_ranges(config)
  _check_batch(config)
  _check_stages(config)
  _check_local(config)
  _check_profile(config)
  _check_devices(config, num_local_devices)


def _check_profile(config) -> None:
  """``profile_steps`` reads as ``'START:STOP'`` or ``''``."""
  try:
    profile_window.parse(config.profile_steps)
  except ValueError as e:
    raise ConfigError(str(e)) from None


def _check_devices(config, num_local_devices: int) -> None:
  """``num_devices`` groups of ``data_parallel`` devices exist, and every
  batch splits over a group."""
  n, d = config.num_devices, config.data_parallel
  if n * d > num_local_devices:
    raise ConfigError(
        f"num_devices={n} x data_parallel={d} needs {n * d} devices but only "
        f"{num_local_devices} exist; use --config.num_devices=0 for all of them.")
  if not n and num_local_devices % d:
    raise ConfigError(
        f"data_parallel={d} does not divide the {num_local_devices} devices; set "
        f"--config.num_devices to the number of groups of {d} devices.")
  micro = config.batch_size // config.accumulation_steps
  for name, size in (("micro-batch (batch_size / accumulation_steps)", micro),
                     ("eval_batch_size", config.eval_batch_size)):
    if size % d:
      raise ConfigError(f"the {name} of {size} images does not split over data_parallel={d} "
                        f"devices; use a multiple of {d}.")


def validate_multiprocess(config: ml_collections.ConfigDict) -> None:
  """Raises ConfigError for what a multi-process run does not support."""
  if jax.process_count() == 1:
    return
  if not methods_lib.get(config.method).pipelined:
    raise ConfigError(f"method {config.method!r} runs on one device; run it in a single process "
                      "(without launch/*.sh or jax.distributed).")


def steps_per_epoch(config: ml_collections.ConfigDict, num_examples: int) -> int:
  """Updates per epoch: ``config.steps_per_epoch``, or (0) every full batch.

  Args:
    num_examples: images of the training split.

  Raises:
    ConfigError: more steps than the split holds batches, or a batch
      larger than the split.
  """
  full = num_examples // config.batch_size
  if full == 0:
    raise ConfigError(f"batch_size={config.batch_size} but the training split holds only "
                      f"{num_examples} images; use --config.batch_size <= {num_examples}.")
  if config.steps_per_epoch > full:
    raise ConfigError(f"steps_per_epoch={config.steps_per_epoch} but the training split holds "
                      f"only {full} batches of {config.batch_size}; use "
                      f"--config.steps_per_epoch <= {full} (0: the whole split).")
  return config.steps_per_epoch or full


def depth(config: ml_collections.ConfigDict):
  """``config.model.depth``, None for the model's own (0)."""
  return config.model.depth or None


def _check_choices(config) -> None:
  """Names that must be in a registry; methods the model supports."""
  for what, value, choices, flag in (
      ("method", config.method, tuple(methods_lib.ALL_METHODS), "method"),
      ("model", config.model.name, sorted(models.MODEL_SPECS) + [config.model.name] * (
          ":" in config.model.name), "model.name"),
      ("dataset", config.dataset, sorted(data_lib.DATASETS), "dataset"),
      ("optimizer", config.optim.name, optim.OPTIMIZERS, "optim.name"),
      ("schedule", config.optim.schedule, optim.LR_SCHEDULES, "optim.schedule"),
      ("stage-balancing cost", config.model.balance_by, config_lib.BALANCE_BY,
       "model.balance_by"),
      ("platform", config.platform, config_lib.PLATFORMS, "platform"),
      ("executor", config.executor, compiled.EXECUTORS, "executor"),
      ("reversible backward", config.model.reversible_backward,
       stage_lib.REVERSIBLE_BACKWARDS, "model.reversible_backward"),
      ("tokenizer", config.model.tokenizer, sorted(models.TOKENIZERS), "model.tokenizer")):
    if value not in choices:
      raise ConfigError(f"Unknown {what} {value!r}; choose one of {tuple(choices)} "
                        f"(--config.{flag}=...).")
  try:  # a MODULE:FUNCTION model is imported and built here
    reversible = models.is_reversible(config.model.name, config.model.width, depth(config))
  except ValueError as e:
    raise ConfigError(str(e)) from None
  if methods_lib.get(config.method).reconstructs and not reversible:
    supported = [n for n, m in methods_lib.ALL_METHODS.items() if not m.reconstructs]
    raise ConfigError(
        f"method {config.method!r} needs a reversible model, and {config.model.name!r} is not; "
        f"{config.model.name} supports {supported}, or use a RevNet "
        f"({sorted(n for n, spec in models.MODEL_SPECS.items() if spec.reversible)}).")
  try:
    compensation.check_optimizer(config.optim, compensation.parse_name(config.compensation.name))
  except ValueError as e:
    raise ConfigError(f"{e} (--config.compensation.name=...)") from None


def _check_task(config) -> None:
  """A zoo model trained for its data set's objective (a language model on text)."""
  name, info = config.model.name, data_lib.get_dataset_info(config.dataset)
  if config.method in methods_lib.LOCAL_METHODS and info.objective != "classification":
    raise ConfigError(f"method {config.method!r} trains image classifiers only (its "
                      f"auxiliary heads pool images); use one of {list(methods_lib.METHODS)} "
                      f"on {config.dataset}.")
  if models.is_user_model(name) or models.MODEL_SPECS[name].objective == info.objective:
    return
  fits = sorted(n for n, s in models.MODEL_SPECS.items() if s.objective == info.objective)
  raise ConfigError(f"model {name!r} is not built for {config.dataset}'s objective ({info.objective}); "
                    f"use one of {fits} (--config.model.name=...).")


def _check_numerics(config) -> None:
  """``dtype``, ``stream_dtype`` and the ``quantize`` formats."""
  for flag, value, choices in (
      ("dtype", config.dtype, precision_lib.DTYPES),
      ("stream_dtype", config.stream_dtype, ("",) + precision_lib.DTYPES),
      *((f"quantize.{k}", config.quantize[k], quantize_lib.FORMATS)
        for k in quantize_lib.PAYLOADS)):
    if value not in choices:
      raise ConfigError(f"Unknown {flag} {value!r}; choose one of {tuple(choices)} "
                        f"(--config.{flag}=...).")


def _field(config, flag: str):
  """``config.a.b`` for ``flag="a.b"``."""
  value = config
  for name in flag.split("."):
    value = value[name]
  return value


def _check_ranges(config) -> None:
  """Every :data:`RANGES` bound; decay epochs; the warm-up within the run."""
  for r in RANGES:
    value = _field(config, r.flag)
    if not r.allows(value):
      raise ConfigError(f"{r.flag} must be {r.describe()}, got {value} ({r.why}); "
                        f"pass --config.{r.flag}=<a value {r.describe()}>.")
  o = config.optim
  if any(e < 0 for e in o.decay_epochs):
    raise ConfigError(f"optim.decay_epochs={tuple(o.decay_epochs)} holds a negative epoch; "
                      "pass --config.optim.decay_epochs with epochs >= 0.")
  if o.warmup_epochs > config.num_epochs:
    raise ConfigError(
        f"optim.warmup_epochs={o.warmup_epochs:g} is longer than the run "
        f"(num_epochs={config.num_epochs}): the rate would never finish its warm-up; use "
        f"--config.optim.warmup_epochs <= {config.num_epochs}.")


def _check_batch(config) -> None:
  """Batch, k micro-batches, gradient-quality probes."""
  k = config.accumulation_steps
  if config.batch_size % k:
    raise ConfigError(
        f"batch_size={config.batch_size} does not split into accumulation_steps={k} "
        f"micro-batches; use a batch_size that is a multiple of {k}.")
  method = methods_lib.get(config.method)
  if config.grad_quality_every and not method.pipelined:
    raise ConfigError("grad_quality_every compares a pipeline's gradients with exact ones; "
                      f"method {config.method!r} computes only exact ones: use another method or "
                      "--config.grad_quality_every=0.")
  if config.grad_quality_every and not method.probed and method.updates == "backward":
    raise ConfigError("grad_quality_every probes each stage's whole backward (one vjp); method "
                      f"{config.method!r} has none (it splits it): use another method or "
                      "--config.grad_quality_every=0.")


def _check_local(config) -> None:
  """``config.forward_gradient`` and ``config.auxiliary``: their values, that
  they are set only for a method that reads them, and what the local methods
  (``local``, ``forward_gradient``) do not support."""
  from petra_jax.engine.methods import forward_gradient  # pylint: disable=g-import-not-at-top
  from petra_jax.engine.methods import local_learning  # pylint: disable=g-import-not-at-top
  from petra_jax.models import auxiliary  # pylint: disable=g-import-not-at-top
  fg, aux = config.forward_gradient, config.auxiliary
  try:
    forward_gradient.check_options(fg.guess, fg.perturb, fg.emulate, fg.eps, fg.projection)
  except ValueError as e:
    raise ConfigError(str(e)) from None
  if aux.head not in auxiliary.HEADS or aux.hidden < 1:
    raise ConfigError(f"auxiliary.head={aux.head!r}, auxiliary.hidden={aux.hidden}: choose a head "
                      f"in {auxiliary.HEADS} (--config.auxiliary.head=...) and "
                      "--config.auxiliary.hidden >= 1.")
  _check_unread_options(config)
  if config.method not in methods_lib.LOCAL_METHODS:
    return
  probes = [f for f in ("grad_quality_every", "reconstruction_error_every") if config[f]]
  if probes:
    raise ConfigError(f"method {config.method!r} does not support backward-pass probes (it has "
                      f"no exact backward pass): pass {' '.join(f'--config.{f}=0' for f in probes)}.")
  try:
    local_learning.check_transport(
        config.method, [k for k in quantize_lib.PAYLOADS if config.quantize[k] != "none"],
        jax.process_count() > 1)
  except ValueError as e:
    raise ConfigError(str(e)) from None
  if config.data_parallel > 1:
    raise ConfigError(f"method {config.method!r} runs one device per stage: pass "
                      "--config.data_parallel=1.")


def _check_unread_options(config) -> None:
  """Refuses ``forward_gradient.*`` changed from its default under another
  method, and ``auxiliary.*`` changed under a method without heads (all but
  ``local`` and ``forward_gradient`` with ``guess="local"``)."""
  defaults = config_lib.get_config()
  updates = methods_lib.get(config.method).updates
  uses_heads = updates == "local" or (updates == "forward_gradient"
                                      and config.forward_gradient.guess == "local")
  for group, used, readers in (
      ("forward_gradient", updates == "forward_gradient", "--config.method=forward_gradient"),
      ("auxiliary", uses_heads, "--config.method=local or --config.method=forward_gradient with "
                                "--config.forward_gradient.guess=local")):
    changed = [k for k in defaults[group] if config[group][k] != defaults[group][k]]
    if changed and not used:
      flags = " ".join(f"--config.{group}.{k}" for k in changed)
      raise ConfigError(f"{flags} set, but method {config.method!r} does not read "
                        f"config.{group} (only {readers} does): drop {flags} or change the "
                        "method.")


def _check_stages(config) -> None:
  """Stage counts and sizes against each other and the model's blocks."""
  m = config.model
  if m.stage_sizes and m.num_stages and m.num_stages != len(m.stage_sizes):
    raise ConfigError(
        f"model.num_stages={m.num_stages} disagrees with model.stage_sizes="
        f"{tuple(m.stage_sizes)} ({len(m.stage_sizes)} stages); set one of them: "
        f"--config.model.stage_sizes='()' to group by num_stages, or "
        f"--config.model.num_stages=0 to keep stage_sizes.")
  try:
    info = data_lib.get_dataset_info(config.dataset)
    num_blocks = len(models.build_model(  # a user model built and traced at its width
        m.name, width=m.width if ":" in m.name else 1, depth=depth(config),
        num_classes=info.num_classes, image_shape=info.image_shape))
  except ValueError as e:  # e.g. a depth for a model whose block counts are fixed
    raise ConfigError(str(e)) from None
  num_stages = len(m.stage_sizes) or m.num_stages
  if num_stages > num_blocks:
    raise ConfigError(
        f"model.num_stages={num_stages} but {m.name} has only {num_blocks} blocks "
        f"(one per stage at most); use --config.model.num_stages <= {num_blocks}.")
  if m.stage_sizes and (sum(m.stage_sizes) != num_blocks or min(m.stage_sizes) < 1
                        or len(m.stage_sizes) < 2):
    raise ConfigError(
        f"model.stage_sizes={tuple(m.stage_sizes)} must be at least 2 positive "
        f"block counts summing to {m.name}'s {num_blocks} blocks; pass "
        f"--config.model.stage_sizes='()' to reset it (one block per stage, or "
        f"--config.model.num_stages=J to group them), or counts summing to {num_blocks}.")
  if num_stages == 1:
    raise ConfigError("model.num_stages=1: a pipeline needs at least 2 stages; use 0 for one "
                      "block per stage.")
