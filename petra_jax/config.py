"""Default run configuration; ``configs/*.py`` start from it and override.

Every field is documented here, on its line, except those of
``config.compensation``: their defaults and meanings live beside the code
that reads them, in ``petra_jax.optim.compensation.DEFAULTS`` (the names and
equations in that module's docstring). The bounds of the numeric fields are
checked in ``petra_jax.training.validation.RANGES``.

``batch_size`` counts the images of one optimizer update; it is split into
``accumulation_steps`` (k) micro-batches of ``batch_size // k`` images, one
per tick. The paper's "batch size 64, k = 2" is ``batch_size=128,
accumulation_steps=2``.
"""

import ml_collections

from petra_jax.optim import compensation
from petra_jax.engine.methods import METHODS  # noqa: F401  (what each method keeps; its schedule)
from petra_jax.engine.reversible_backward import BACKWARDS as REVERSIBLE_BACKWARDS  # noqa: F401
BALANCE_BY = ("flops", "time")  # cost per block for model.num_stages balancing
PLATFORMS = ("", "cpu", "gpu", "tpu")  # config.platform


def _model_config() -> ml_collections.ConfigDict:
  """``config.model``: the network and its split into stages."""
  c = ml_collections.ConfigDict()
  c.name = "revnet18"   # a name in petra_jax.models.MODEL_SPECS
  c.width = 64          # channels per stream after the stem (paper: 64); ViTs: dimension per head
  c.depth = 0           # revnet_fixed only: reversible blocks at constant width; 0 = its default (20)
                        # (ViTs: transformer layers, default 12)
  c.num_stages = 0      # pipeline stages J; 0 = one residual block per stage (paper)
  c.stage_sizes = ()    # blocks per stage, e.g. (2, 3, 5); () with num_stages = balanced (balance_by)
  c.balance_by = "flops"  # num_stages grouping minimises the slowest stage's: "flops" (XLA cost
                          # analysis) or "time" (forward + backward measured on the device at start)
  c.bn_stats = "backward"  # running BN statistics: "backward" (paper) or "forward" (authors' code)
  c.patch_size = 0      # ViTs only (revvit_*, vit_*): the stem's patch; 0 = 4 (32x32), 16 (ImageNet)
  c.tokenizer = "patch"  # ViTs only: the stem, "patch" (ViT's) or "conv" (CCT's 3x3 convs + max-pools)
  c.reversible_backward = "vanilla"  # a stage of several reversible blocks: "vanilla" (reconstruct
                          # then vjp, block by block) or "pareprop" (petra_jax.engine.reversible_backward)
  return c


def _distributed_config() -> ml_collections.ConfigDict:
  """``config.distributed``: multi-process runs."""
  # Multi-process runs (jax.distributed; launch/local.sh, launch/slurm.sh,
  # launch/tpu_pod.sh): stages spread over every process's devices. Unset
  # fields fall back to $JAX_COORDINATOR_ADDRESS, $JAX_NUM_PROCESSES and
  # $JAX_PROCESS_ID; with no coordinator and auto_detect False the run is
  # single-process.
  c = ml_collections.ConfigDict()
  c.coordinator_address = ""  # "host:port" of process 0
  c.num_processes = 0         # 0 = $JAX_NUM_PROCESSES
  c.process_id = -1           # -1 = $JAX_PROCESS_ID
  c.auto_detect = False       # let jax detect SLURM / TPU pod / MPI settings
  c.initialization_timeout_s = 120  # wait this long for every process to join
  c.heartbeat_timeout_s = 20  # a silent peer is declared dead after this
  c.shutdown_timeout_s = 30   # wait this long for the others at exit
  # SIGTERM/SIGINT: the processes agree to stop only every this many updates
  # (a collective); a stop comes at most this many - 1 updates late.
  c.preemption_check_every = 10
  return c


def _quantize_config() -> ml_collections.ConfigDict:
  """``config.quantize``: formats of messages and buffers (petra_jax.engine.quantize)."""
  # Each one of "none", "bfloat16", "float16", "int8" (signed int8 with a
  # float32 scale). Where the authors' --quantize-forward-com,
  # --quantize-backward-com and --quantize-buffer apply theirs.
  c = ml_collections.ConfigDict()
  c.forward = "none"      # activations sent to the next stage
  c.backward = "none"     # (x~, delta) sent to the previous stage
  c.buffer = "none"       # inputs kept by non-reversible stages ("none": as received)
  c.per_channel = False   # int8: one scale per channel (last axis) instead of per tensor
  c.stochastic = False    # int8: stochastic (unbiased) rounding instead of round to nearest
  return c


def _optim_config() -> ml_collections.ConfigDict:
  """``config.optim``: optimizer and learning-rate schedule."""
  c = ml_collections.ConfigDict()
  c.name = "sgd"         # "sgd" (paper), "lars" (clipped, LARC), "adam" (AdamW) or "muon" (+ AdamW)
  c.learning_rate = 0.0  # 0 -> 0.1 * batch_size / 256 (Goyal et al.; paper Sec. 4)
  c.momentum = 0.9       # sgd, lars
  c.nesterov = True      # sgd, lars
  c.weight_decay = 5e-4  # on conv and dense kernels only (adam: decoupled, times lr)
  c.schedule = "step"    # "step", "cosine", "polynomial" or "constant"
  c.warmup_epochs = 5.0  # linear warm-up from 0
  c.decay_epochs = (150, 225)  # "step": multiply by decay_factor at these epochs
  c.decay_factor = 0.1
  c.end_learning_rate = 0.0  # "cosine", "polynomial": the rate at the last update
  c.polynomial_power = 2.0   # "polynomial": exponent of the decay
  c.trust_coefficient = 0.02  # lars: eta; trust ratio clipped at 1 (LARC)
  c.lars_eps = 1e-8
  c.adam_b1 = 0.9
  c.adam_b2 = 0.999
  c.adam_eps = 1e-8
  c.muon_learning_rate = 0.02  # muon: the matrices' peak rate (schedule's shape); rest: adam's
  c.muon_momentum = 0.95       # muon: beta of the matrices' momentum
  return c


def _auxiliary_config() -> ml_collections.ConfigDict:
  """``config.auxiliary``: the heads of methods ``local`` and
  ``forward_gradient`` with ``guess="local"`` (petra_jax.models.auxiliary)."""
  c = ml_collections.ConfigDict()
  c.head = "mlp"    # "linear", "mlp" (pool 2x2, hidden, K) or "cnn" (1x1 conv, pool 2x2, K)
  c.hidden = 128    # hidden width of the mlp/cnn heads
  return c


def _forward_gradient_config() -> ml_collections.ConfigDict:
  """``config.forward_gradient``: method ``forward_gradient`` (Fournier et
  al., ICML 2023; petra_jax.engine.forward_gradient)."""
  c = ml_collections.ConfigDict()
  c.guess = "local"        # "local" (auxiliary-loss gradient) or "random" (Gaussian)
  c.perturb = "activity"   # "activity" (per-sample guess of the stage's output) or "weights"
  c.emulate = False        # True: <g, guess> from the exact gradient (backprop), as the paper's runs
  c.eps = 1e-16            # the projection's <g, v> / (||v||^2 + eps)
  c.projection = "batch"   # activity: "batch" (one direction per micro-batch; exact through
                           # BatchNorm) or "sample" (per sample, the paper's; see forward_gradient.py)
  return c


def get_config() -> ml_collections.ConfigDict:
  """The default configuration: a small RevNet18 trained with PETRA."""
  c = ml_collections.ConfigDict()
  c.method = "petra"          # a name in petra_jax.engine.methods.METHODS (e.g. petra, revprop, backprop, 1f1b)
  c.dataset = "cifar10"       # a name in petra_jax.data.DATASETS
  c.data_dir = ""             # tfds data_dir; "" -> $TFDS_DATA_DIR -> ../shared/data/tensorflow_datasets
  c.download = ml_collections.config_dict.placeholder(bool)  # missing data set: None (auto) = tfds downloads CIFAR-10/100 on first use; True = any (ImageNet32 too); False = never

  c.model = _model_config()

  c.batch_size = 128          # images per optimizer update (k micro-batches)
  c.accumulation_steps = 2    # k: micro-batches averaged per update
  c.num_epochs = 300
  c.steps_per_epoch = 0       # updates per epoch; 0 = the full training split
  c.max_steps = 0             # stop after this many updates; 0 = num_epochs epochs (schedules still span num_epochs)
  c.eval_every = 1            # epochs between test evaluations; 0 = at the end only
  c.eval_batch_size = 500
  c.prefetch = 4              # micro-batches decoded ahead in background threads (lazy datasets: ImageNet); 0 = off
  c.log_every = 50            # updates between train_loss lines in metrics.jsonl
  c.num_devices = 0           # devices to spread the stages over; 0 = all local devices (per process when multi-process)
  c.data_parallel = 1         # D: devices per stage (state replicated, micro-batch sharded over a "data" axis);
                              # a run uses num_devices x D devices (0 = all: stages over all local devices / D groups)
  c.platform = ""             # the platform this run expects: "gpu", "tpu" or "cpu"; "" = whatever JAX picks.
                              # If "gpu"/"tpu" (or $JAX_PLATFORMS names one) but JAX runs on the CPU,
                              # the run says so and names the install (pip install -e '.[cuda12]' / '.[tpu]')
  c.seed = 0
  c.reconstruction_error_every = 0  # updates between ||x~ - x||/||x|| probes of reversible stages; 0 = off
  c.grad_quality_every = 0    # updates between gradient-quality probes (paper App. B; petra_jax.engine.diagnostics); 0 = off
  c.checkpoint_every = 0      # updates between checkpoints (and one at the end); 0 = off
  c.keep_checkpoints = 2      # how many of the latest checkpoints to keep
  c.checkpoint_drain = False  # drain the pipeline before each periodic checkpoint (reshardable; changes the updates)

  c.distributed = _distributed_config()

  # Delay compensation of the delayed methods (petra, dsp, delayed,
  # approximate_input), per stage from its delay tau_j (petra_jax.optim.compensation):
  # name = "none", "lr_scale", "pipemare", "spike", "weight_prediction",
  # "nesterov_lookahead", "adam_prediction", "adam_lookahead", "adam_momentum",
  # "error_feedback", or several joined with "+". Its fields (name,
  # lr_power, pipemare_warmup_epochs, prediction_scale, lookahead_momentum,
  # lookahead_delay_ref) are documented in compensation.DEFAULTS.
  c.compensation = compensation.defaults()

  # Precision (petra_jax.engine.stage.Precision): convolutions, BatchNorm and
  # activations in `dtype`; parameters, optimizer state and gradient
  # accumulation always float32. `stream_dtype`: the activations between
  # blocks and stages (messages, buffers, the coupling's additions); "" = dtype.
  c.dtype = "float32"         # "float32" or "bfloat16"
  c.stream_dtype = ""         # "", "float32" or "bfloat16"
  c.quantize = _quantize_config()

  c.optim = _optim_config()
  c.auxiliary = _auxiliary_config()
  c.forward_gradient = _forward_gradient_config()
  return c


def imagenet_recipe(dataset: str) -> ml_collections.ConfigDict:
  """The paper's ImageNet recipe (Sec. 4) on ``dataset``: RevNet18 width 64,
  batch 256 = k 4 micro-batches of 64, 90 epochs, SGD-Nesterov, 5 warm-up
  epochs, lr x0.1 at epochs 30, 60 and 80, weight decay 1e-4."""
  c = get_config()
  c.method = "petra"
  c.dataset = dataset
  c.model.name = "revnet18"
  c.model.width = 64
  c.batch_size = 256
  c.accumulation_steps = 4
  c.num_epochs = 90
  c.optim.name = "sgd"
  c.optim.schedule = "step"
  c.optim.warmup_epochs = 5
  c.optim.decay_epochs = (30, 60, 80)
  c.optim.weight_decay = 1e-4
  return c
