"""The default run configuration; ``configs/*.py`` override only what differs.

Every field and its meaning: docs/config.md. ``batch_size`` counts the images of one
update, split into ``accumulation_steps`` (k) micro-batches of ``batch_size // k``.
"""

import ml_collections

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
  """The default configuration: RevNet18 on CIFAR-10 trained with PETRA."""
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
  c.eval_batch_size = 500
  c.prefetch = 4
  c.log_every = 50
  c.num_devices = 0           # 0 = all local devices
  c.data_parallel = 1
  c.platform = ""
  c.seed = 0
  c.reconstruction_error_every = 0
  c.grad_quality_every = 0
  c.checkpoint_every = 0
  c.checkpoint_minutes = 10.0  # also at each epoch end and at least this often; 0 = checkpoint_every only
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
