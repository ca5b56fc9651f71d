"""The default run configuration; ``configs/*.py`` override only what differs.

Every field's one-line meaning: :data:`HELP` (``python -m petra_jax.train --help``
prints it with the defaults); more in docs/config.md. ``batch_size`` counts the images
of one update, split into ``accumulation_steps`` (k) micro-batches of ``batch_size // k``.
"""

import importlib.util
import os

import ml_collections

from petra_jax.engine import periods

BALANCE_BY = ("flops", "time")
PLATFORMS = ("", "cpu", "gpu", "tpu")


def _model_config() -> ml_collections.ConfigDict:
  """``config.model``: the network and its split into stages."""
  c = ml_collections.ConfigDict()
  c.name = "revnet18"   # a name in MODEL_SPECS, or MODULE:FUNCTION (docs/api.md)
  c.width = 64
  c.depth = 0           # 0 = the model's default
  c.num_stages = 0      # 0 = one residual block per stage (paper)
  c.stage_sizes = ()    # blocks per stage; () = balanced by balance_by
  c.balance_by = "flops"
  c.bn_stats = "backward"
  c.patch_size = 0      # 0 = 4 (32x32 images), 16 (ImageNet)
  c.tokenizer = "patch"
  c.context = 0         # text: characters per window T; 0 = the data set's (64)
  c.reversible_backward = "vanilla"
  return c


def _distributed_config() -> ml_collections.ConfigDict:
  """``config.distributed``: multi-process runs (docs/multihost.md)."""
  c = ml_collections.ConfigDict()
  c.coordinator_address = ""  # "" = $JAX_COORDINATOR_ADDRESS
  c.num_processes = 0         # 0 = $JAX_NUM_PROCESSES
  c.process_id = -1           # -1 = $JAX_PROCESS_ID
  c.auto_detect = False
  c.initialization_timeout_s = 120
  c.heartbeat_timeout_s = 20
  c.shutdown_timeout_s = 30
  c.preemption_check_every = 10
  return c


def _compensation_config() -> ml_collections.ConfigDict:
  """``config.compensation``: delay compensation (petra_jax.optim.compensation)."""
  c = ml_collections.ConfigDict()
  c.name = "none"  # or adam_prediction, adam_lookahead, error_feedback, ... joined with "+"
  c.lr_power = 1.0
  c.pipemare_warmup_epochs = 5.0
  c.prediction_scale = 1.0
  c.lookahead_momentum = 0.99
  c.lookahead_delay_ref = 0.0  # 0 = stage 0's delay (lookahead_rule "run_max")
  c.lookahead_rule = "run_max"  # or "own_delay": b1_j from stage j's own delay D_j only
  return c


def _quantize_config() -> ml_collections.ConfigDict:
  """``config.quantize``: "none", "bfloat16", "float16" or "int8" per message kind."""
  c = ml_collections.ConfigDict()
  c.forward = "none"
  c.backward = "none"
  c.buffer = "none"
  c.per_channel = False
  c.stochastic = False
  return c


def _optim_config() -> ml_collections.ConfigDict:
  """``config.optim``: optimizer and learning-rate schedule."""
  c = ml_collections.ConfigDict()
  c.name = "sgd"         # "sgd", "lars", "adam" (AdamW), "muon" (+ AdamW), "nadamw"
  c.learning_rate = 0.0  # 0 = 0.1 * batch_size / 256 (paper Sec. 4)
  c.momentum = 0.9
  c.nesterov = True
  c.weight_decay = 5e-4
  c.schedule = "step"
  c.warmup_epochs = 5.0
  c.decay_epochs = (150, 225)
  c.decay_factor = 0.1
  c.end_learning_rate = 0.0
  c.polynomial_power = 2.0
  c.trust_coefficient = 0.02
  c.lars_eps = 1e-8
  c.adam_b1 = 0.9
  c.adam_b2 = 0.999
  c.adam_eps = 1e-8
  c.muon_learning_rate = 0.02  # muon: the matrices' peak rate (schedule's shape); rest: adam's
  c.muon_momentum = 0.95       # muon: beta of the matrices' momentum
  c.momentum_decay = 0.004     # nadamw: psi of Dozat's schedule mu_t = b1 (1 - 0.96^(t psi) / 2)
  c.clip_norm = 0.0            # nadamw: clip each stage's gradient to this global norm; 0 = off
  return c


def _auxiliary_config() -> ml_collections.ConfigDict:
  """``config.auxiliary``: the auxiliary heads of ``local`` and ``forward_gradient``."""
  c = ml_collections.ConfigDict()
  c.head = "mlp"
  c.hidden = 128
  return c


def _forward_gradient_config() -> ml_collections.ConfigDict:
  """``config.forward_gradient``: method ``forward_gradient`` (Fournier et al., 2023)."""
  c = ml_collections.ConfigDict()
  c.guess = "local"
  c.perturb = "activity"
  c.emulate = False
  c.eps = 1e-16
  c.projection = "batch"
  return c


def get_config() -> ml_collections.ConfigDict:
  """The default configuration: RevNet18 on CIFAR-10 trained with PETRA.

  Returns:
    A fresh ``ml_collections.ConfigDict`` (every field and its help: docs/config.md).
  """
  c = ml_collections.ConfigDict()
  c.method = "petra"
  c.dataset = "cifar10"
  c.data_dir = ""             # "" = $TFDS_DATA_DIR, then ../shared/data/tensorflow_datasets
  c.download = ml_collections.config_dict.placeholder(bool)
  c.model = _model_config()
  c.batch_size = 128
  c.accumulation_steps = 2
  c.num_epochs = 300
  c.steps_per_epoch = 0       # 0 = the full training split
  c.max_steps = 0             # 0 = num_epochs epochs
  c.eval_every = 1            # epochs; 0 = at the end only
  c.evals_per_epoch = 1       # evaluations in an evaluated epoch, evenly spaced, the last at its end
  c.eval_batch_size = 500
  c.eval_examples = 0         # the first N test examples; 0 = the whole split
  c.prefetch = 4
  c.log_every = 50
  c.executor = "auto"         # "compiled" | "host"; auto = compiled on accelerators where it can
  c.periods_per_dispatch = periods.PERIODS_PER_DISPATCH  # compiled: steady-state periods per call
  c.unroll_ticks = periods.UNROLL_TICKS  # compiled: ticks per iteration of the scan's loop
  c.order_writes = periods.ORDER_WRITES  # compiled: carried slots written after their reads
  c.progress_seconds = 60.0   # output not a terminal: a progress line this often; 0 = off
  c.profile_steps = ""        # "START:STOP": those updates traced with jax.profiler; "" = off
  c.num_devices = 0           # 0 = all local devices
  c.data_parallel = 1
  c.platform = ""
  c.seed = 0
  c.reconstruction_error_every = 0
  c.grad_quality_every = 0
  c.checkpoint_every = 0
  c.checkpoint_minutes = 10.0  # at least this often, and at epoch ends a minute apart; 0 = checkpoint_every only
  c.keep_checkpoints = 2
  c.checkpoint_drain = False
  c.distributed = _distributed_config()
  c.compensation = _compensation_config()
  c.dtype = "float32"
  c.stream_dtype = ""         # "" = dtype
  c.quantize = _quantize_config()
  c.optim = _optim_config()
  c.auxiliary = _auxiliary_config()
  c.forward_gradient = _forward_gradient_config()
  return c


def recipe(path: str) -> ml_collections.ConfigDict:
  """The config of the recipe ``FILE[:VARIANT]`` (``configs/cifar10.py:runlocal``): the file's
  ``get_config(VARIANT)``. Raises ValueError naming the fix if the file is absent."""
  file, _, variant = path.partition(":")
  if not os.path.isfile(file):
    raise ValueError(f"no recipe at {file}: run from the repository root or pass the path "
                     "of a file under configs/.")
  spec = importlib.util.spec_from_file_location("petra_recipe", file)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config(variant) if variant else module.get_config()


def override(config: ml_collections.ConfigDict, fields: dict) -> ml_collections.ConfigDict:
  """Sets each dotted field of ``fields`` (``{"optim.name": "muon"}``) in ``config``; returns it.

  Raises:
    KeyError: a field that ``config`` does not have.
  """
  for key, value in fields.items():
    *path, last = key.split(".")
    target = config
    for part in path:
      target = target[part]
    if last not in target:
      raise KeyError(f"config has no field {key!r}")
    target[last] = value
  return config


# Every field's meaning in one line: the command line's help (``--help``).
HELP = {
    "method": "petra, backprop, revprop, delayed, dsp, approximate_input, gpipe, 1f1b, local, "
              "forward_gradient, ... (docs/methods.md)",
    "dataset": "cifar10, cifar100, imagenet32 or imagenet (docs/data.md)",
    "data_dir": "tfds data dir; '' = $TFDS_DATA_DIR, then ../shared/data/tensorflow_datasets",
    "download": "a missing data set: None = download CIFAR only, True = any, False = never",
    "model.name": "a zoo name (python -m petra_jax.models lists them) or MODULE:FUNCTION",
    "model.width": "channels per stream after the stem; ViTs: dimension per head",
    "model.depth": "revnet_fixed: reversible blocks; ViTs: layers; 0 = the model's default",
    "model.num_stages": "pipeline stages J; 0 = one block per stage (paper)",
    "model.stage_sizes": "blocks per stage, e.g. '(2,3,5)'; '()' = one per block or "
                         "balanced by num_stages",
    "model.balance_by": "num_stages grouping by 'flops' or measured 'time'",
    "model.bn_stats": "running BN statistics from the 'backward' recomputation or the 'forward'",
    "model.patch_size": "ViTs: the stem's patch; 0 = 4 (32x32 images), 16 (ImageNet)",
    "model.tokenizer": "ViTs: 'patch' or 'conv' (CCT's convolutions)",
    "model.context": "text: characters per window T; 0 = the data set's (64)",
    "model.reversible_backward": "a group of reversible blocks: 'vanilla' or 'pareprop'",
    "batch_size": "images per optimizer update (k micro-batches of batch_size / k)",
    "accumulation_steps": "k: micro-batches whose gradients are averaged per update",
    "num_epochs": "epochs the schedules span",
    "steps_per_epoch": "updates per epoch; 0 = the full training split",
    "max_steps": "stop after this many updates; 0 = num_epochs epochs",
    "eval_every": "epochs between test evaluations; 0 = at the end only",
    "evals_per_epoch": "evaluations in each evaluated epoch, evenly spaced, the last at its end",
    "eval_batch_size": "images per evaluation batch",
    "eval_examples": "evaluate on the first N test examples; 0 = the whole split",
    "prefetch": "micro-batches decoded ahead in background threads (ImageNet); 0 = off",
    "log_every": "updates between train_loss lines in metrics.jsonl",
    "executor": "'compiled' (steady-state ticks as one jitted lax.scan), 'host' (a jitted call "
                "per task) or 'auto' (compiled on a GPU/TPU where it can run the pipeline)",
    "periods_per_dispatch": "compiled executor: steady-state periods (a stream's ticks, a "
                            "flushed schedule's rounds) per dispatch",
    "unroll_ticks": "compiled executor: ticks per iteration of its lax.scan loop, in whole "
                    "periods, at least one (fewer carry copies per tick, longer compiles)",
    "order_writes": "compiled executor: order each carried slot's new value after the reads of "
                    "its old one, so that XLA updates the loop's carry in place instead of "
                    "copying it (the same values; more small operations)",
    "progress_seconds": "output not a terminal (SLURM, nohup, CI): a progress line this often "
                        "(seconds); 0 = off",
    "profile_steps": "'START:STOP': trace updates START to STOP with jax.profiler into "
                     "WORKDIR/profile (TensorBoard's profile tab), whole executor calls; '' = off",
    "num_devices": "devices to spread the stages over; 0 = all local devices",
    "data_parallel": "D: devices per stage (micro-batch sharded over them)",
    "platform": "the platform the run expects: gpu, tpu, cpu; '' = whatever JAX picks",
    "seed": "initialisation, data order and augmentation",
    "reconstruction_error_every": "updates between reconstruction-error probes; 0 = off",
    "grad_quality_every": "updates between gradient-quality probes (paper App. B); 0 = off",
    "checkpoint_every": "updates between checkpoints; 0 = off",
    "checkpoint_minutes": "also checkpoint at least this often (minutes), and at each epoch end "
                          "a minute or more after the last save; 0 = checkpoint_every only",
    "keep_checkpoints": "how many of the latest checkpoints to keep",
    "checkpoint_drain": "drain the pipeline before each periodic checkpoint (reshardable)",
    "distributed.coordinator_address": "host:port of process 0; '' = $JAX_COORDINATOR_ADDRESS",
    "distributed.num_processes": "0 = $JAX_NUM_PROCESSES",
    "distributed.process_id": "-1 = $JAX_PROCESS_ID",
    "distributed.auto_detect": "let JAX detect SLURM / TPU pod / MPI settings",
    "distributed.initialization_timeout_s": "seconds to wait for every process to join",
    "distributed.heartbeat_timeout_s": "seconds after which a silent peer is declared dead",
    "distributed.shutdown_timeout_s": "seconds to wait for the others at exit",
    "distributed.preemption_check_every": "updates between the processes' agreements to stop",
    "compensation.name": "delay compensation: none, lr_scale, pipemare, spike, weight_prediction, "
                         "nesterov_lookahead, adam_prediction, adam_lookahead, ... joined with +",
    "compensation.lr_power": "p of lr_scale / pipemare: lr x max(D_j, 1) ** -p",
    "compensation.pipemare_warmup_epochs": "K of pipemare, in epochs",
    "compensation.prediction_scale": "weight_prediction horizon = this x D_j updates",
    "compensation.lookahead_momentum": "nesterov_lookahead: gamma of the most delayed stage",
    "compensation.lookahead_delay_ref": "the delay (updates) that gets lookahead_momentum; "
                                        "0 = stage 0's",
    "compensation.lookahead_rule": "'run_max' (b1 scaled by the run's largest delay) or "
                                    "'own_delay' (b1_j from stage j's own delay D_j)",
    "dtype": "float32 or bfloat16: convolutions, BatchNorm and activations",
    "stream_dtype": "the activations between blocks and stages; '' = dtype",
    "quantize.forward": "activations sent to the next stage: none, bfloat16, float16, int8",
    "quantize.backward": "(x~, delta) sent to the previous stage: none, bfloat16, float16, int8",
    "quantize.buffer": "inputs kept by non-reversible stages: none, bfloat16, float16, int8",
    "quantize.per_channel": "int8: one scale per channel instead of per tensor",
    "quantize.stochastic": "int8: stochastic (unbiased) rounding",
    "optim.name": "sgd (paper), lars, adam (AdamW), muon (+ AdamW), nadamw or kron (PSGD Kron)",
    "optim.learning_rate": "peak rate; 0 = 0.1 x batch_size / 256 (paper Sec. 4)",
    "optim.momentum": "sgd, lars",
    "optim.nesterov": "sgd, lars: Nesterov momentum",
    "optim.weight_decay": "on conv and dense kernels only (adam: decoupled)",
    "optim.schedule": "step, cosine, polynomial or constant",
    "optim.warmup_epochs": "linear warm-up from 0, in epochs",
    "optim.decay_epochs": "step: the epochs at which the rate is multiplied by decay_factor",
    "optim.decay_factor": "step: the factor at each of decay_epochs",
    "optim.end_learning_rate": "cosine, polynomial: the rate at the last update",
    "optim.polynomial_power": "polynomial: the decay's exponent",
    "optim.trust_coefficient": "lars: eta (trust ratio clipped at 1, LARC)",
    "optim.lars_eps": "lars: epsilon",
    "optim.adam_b1": "adam, muon's AdamW, kron: beta1",
    "optim.adam_b2": "adam, muon's AdamW: beta2",
    "optim.adam_eps": "adam, muon's AdamW: epsilon",
    "optim.muon_learning_rate": "muon: the matrices' peak rate",
    "optim.muon_momentum": "muon: beta of the matrices' momentum",
    "optim.momentum_decay": "nadamw: psi of Dozat's momentum schedule",
    "optim.clip_norm": "nadamw: clip each stage's gradient to this global norm; 0 = off",
    "auxiliary.head": "local methods' heads: linear, mlp or cnn",
    "auxiliary.hidden": "hidden width of the mlp/cnn heads",
    "forward_gradient.guess": "local (auxiliary-loss gradient) or random (Gaussian)",
    "forward_gradient.perturb": "activity or weights",
    "forward_gradient.emulate": "True: <g, guess> from the exact gradient, as the paper's runs",
    "forward_gradient.eps": "the projection's <g, v> / (|v|^2 + eps)",
    "forward_gradient.projection": "activity: batch (one direction per micro-batch) or sample",
}


def fields(config: ml_collections.ConfigDict, prefix: str = "") -> dict:
  """``{"model.name": value, ...}``: every leaf field of ``config``, dotted."""
  out = {}
  for key, value in config.items():
    if isinstance(value, ml_collections.ConfigDict):
      out.update(fields(value, f"{prefix}{key}."))
    else:
      out[f"{prefix}{key}"] = value
  return out
