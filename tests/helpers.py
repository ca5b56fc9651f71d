"""Shared helpers for tests: tiny models and configs, an independent composed
model, reading a run's losses and waiting for a process's event."""

import contextlib
import functools
import importlib.util
import logging
import math
import os
import pathlib
import signal
import subprocess
import sys
import textwrap
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

REPO = str(pathlib.Path(__file__).resolve().parents[1])

# A user's linen model file, ``tiny(num_classes, width=3)``: stem, 3 reversible Conv-BN-ReLU
# stages, head. The CLI passes only the arguments the function takes (no depth).
USER_MODULE = textwrap.dedent('''
    import flax.linen as nn
    import jax.numpy as jnp
    import petra_jax


    class F(nn.Module):
      width: int

      @nn.compact
      def __call__(self, x, train=True):
        x = nn.Conv(self.width, (3, 3))(x)
        return nn.relu(nn.BatchNorm(use_running_average=not train)(x))


    class Stem(nn.Module):
      width: int

      @nn.compact
      def __call__(self, x, train=True):
        return tuple(jnp.split(F(2 * self.width)(x, train), 2, axis=-1))


    class Head(nn.Module):
      num_classes: int

      @nn.compact
      def __call__(self, x, train=True):
        return nn.Dense(self.num_classes)(jnp.concatenate(x, -1).mean((1, 2)))


    def tiny(num_classes, width=3):
      return ([petra_jax.Stage("stem", Stem(width), False)]
              + [petra_jax.Stage(f"rev{i}", F(width), True) for i in range(3)]
              + [petra_jax.Stage("head", Head(num_classes), False)])
''')


def tree_params():
  """Float64 weights of the optimizer tests: an attention kernel [4, 2, 3], a dense kernel
  [6, 4] and bias [4], a norm scale [4] (the names optimizers mask on)."""
  rng = np.random.default_rng(0)
  return {"attn": {"query": {"kernel": rng.normal(size=(4, 2, 3))}},
          "dense": {"kernel": rng.normal(size=(6, 4)), "bias": rng.normal(size=(4,))},
          "norm": {"scale": rng.normal(size=(4,))}}


def gradient_sequence(n, seed=1, scale=1.0):
  """``n`` float64 gradients shaped as :func:`tree_params`, normal with std ``scale``."""
  rng = np.random.default_rng(seed)
  return [jax.tree.map(lambda a: scale * rng.normal(size=a.shape), tree_params())
          for _ in range(n)]


def run_optimizer(tx, gs, params):
  """Applies ``tx`` (jitted) to the gradients ``gs`` (cast to float32) from ``params``; the
  params after each call and the last state."""
  p = jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), params)
  state, out, update = tx.init(p), [], jax.jit(tx.update)
  for g in gs:
    u, state = update(jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), g), state, p)
    p = optax.apply_updates(p, u)
    out.append(p)
  return out, state


def random_batch(batch=8, size=16, num_classes=10, seed=0):
  rng = np.random.default_rng(seed)
  x = jnp.asarray(rng.normal(size=(batch, size, size, 3)), jnp.float32)
  y = jnp.asarray(rng.integers(0, num_classes, batch), jnp.int32)
  return x, y


def composed_loss(stages, params, batch_stats, x, labels, taps=None):
  """Loss of the composed model, written independently of the engine.

  The reversible coupling is spelt out here, (y1, y2) = (x2 + F(x1), x1),
  so this does not reuse petra_jax.engine.stages.stage.forward. ``taps``: one
  zero tree per stage but the last, added to that stage's output (their
  gradient is the output's cotangent).
  """
  h = x
  for j, (s, p, bs) in enumerate(zip(stages, params, batch_stats)):
    variables = {"params": p, "batch_stats": bs} if bs else {"params": p}
    if s.reversible:
      x1, x2 = h
      f, _ = s.module.apply(variables, x1, train=True, mutable=["batch_stats"])
      h = (x2 + f, x1)
    else:
      h, _ = s.module.apply(variables, h, train=True, mutable=["batch_stats"])
    if taps is not None and j < len(taps):
      h = jax.tree.map(jnp.add, h, taps[j])
  return optax.softmax_cross_entropy_with_integer_labels(h, labels).mean()


def composed_cotangents(stages, params, batch_stats, x, labels, outputs):
  """``(parameter gradients, [cotangent of stage j's output for j < J - 1])`` of
  :func:`composed_loss`, one jitted ``jax.grad``; ``outputs`` gives the outputs' shapes."""
  taps = jax.tree.map(jnp.zeros_like, list(outputs))
  grad = jax.jit(jax.grad(lambda p, t: composed_loss(stages, p, batch_stats, x, labels, t),
                          argnums=(0, 1)))
  return grad(params, taps)


def composed_grad(stages, params, batch_stats, x, labels):
  """``jax.grad`` of :func:`composed_loss` with respect to ``params``, jitted: one XLA
  program instead of op by op (seconds for the first such gradient of a worker)."""
  return jax.jit(jax.grad(lambda *a: composed_loss(stages, *a)))(params, batch_stats, x, labels)


def composed_logits(stages, params, batch_stats, x):
  """Eval-mode logits ``float32[B, K]`` of the composed model (``train=False``:
  BatchNorm with the running statistics ``batch_stats``), the coupling spelt
  out as in :func:`composed_loss`; a stage's ``pre`` (i-RevNet's
  parameter-free ``P``) maps its input first, arrays it sets aside pass
  through."""
  h = x
  for s, p, bs in zip(stages, params, batch_stats):
    variables = {"params": p, "batch_stats": bs} if bs else {"params": p}
    if s.reversible:
      x1, x2, *carried = h if s.pre is None else s.pre.apply(h)
      h = (x2 + s.module.apply(variables, x1, train=False), x1, *carried)
    else:
      h = s.module.apply(variables, h, train=False)
  return h


def loss_and_accuracy(logits, labels):
  """float64 NumPy mean cross-entropy and accuracy (first maximum wins) of
  ``logits [N, K]`` against int ``labels [N]``."""
  z = np.asarray(logits, np.float64)
  z = z - z.max(1, keepdims=True)
  logp = z - np.log(np.exp(z).sum(1, keepdims=True))
  labels = np.asarray(labels)
  loss = -logp[np.arange(len(labels)), labels].mean()
  return float(loss), float(np.mean(np.argmax(z, 1) == labels))


def rel_err(a, b):
  """||a - b|| / ||b|| over all leaves of two pytrees."""
  la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
  num = sum(float(jnp.sum((u - v) ** 2)) for u, v in zip(la, lb))
  den = sum(float(jnp.sum(v ** 2)) for v in lb)
  return (num / den) ** 0.5


def batches_of(seed_offset=0, **kwargs):
  """``m -> random_batch(seed=m + seed_offset)``: a different batch per micro-batch."""
  return lambda m: random_batch(seed=m + seed_offset, **kwargs)


def run_ticks(pipe, state, num_micro_batches, batches, num_ticks=None):
  """Runs the first ``num_ticks`` ticks (default: all) of the pipeline's
  schedule over ``num_micro_batches``; returns ``(state, outputs)``."""
  table = pipe.schedule(num_micro_batches)
  n = len(table) if num_ticks is None else num_ticks
  return pipe.run(state, (table[t] for t in range(n)), batches)


def random_variables(stage, x, seed):
  """Variables shaped like ``stage.init``'s, filled by numpy.

  Fast: real init compiles jax.random's threefry once per kernel shape, which
  takes seconds per stage on a small CPU. Kernels get He-normal values, 1-D
  variables (BN scale, bias and statistics, dense bias) values in [0.5, 1.5].
  """
  rng = np.random.default_rng(seed)
  shapes = jax.eval_shape(functools.partial(stage.init, jax.random.key(0)), x)

  def fill(a):
    if len(a.shape) >= 2:
      std = (2 / math.prod(a.shape[:-1])) ** 0.5
      return jnp.asarray(rng.normal(0.0, std, a.shape), jnp.float32)
    return jnp.asarray(rng.uniform(0.5, 1.5, a.shape), jnp.float32)

  return jax.tree.map(fill, shapes)


def jitted(fn, stage, **kwargs):
  """``fn(stage, *args, **kwargs)`` as one jitted program of ``args``: a stage function run op by
  op dispatches (and, the first time in a worker, compiles) each primitive on its own."""
  return jax.jit(lambda *args: fn(stage, *args, **kwargs))


def tiny_revnet():
  """stem, rev, downsample, rev, head: a 5-stage RevNet of width 2 (fast to compile)."""
  from petra_jax import models  # pylint: disable=g-import-not-at-top
  from petra_jax.engine.stages.stage import Stage  # pylint: disable=g-import-not-at-top
  return [Stage("stem", models.Stem(2), False),
          Stage("rev0", models.BasicResidual(2), True),
          Stage("down", models.BasicDownsample(4, 2), False),
          Stage("rev1", models.BasicResidual(4), True),
          Stage("head", models.Head(10), False)]


def zero_delay_update_errors(stages, method: str) -> list:
  """Per stage, the relative error between ``method``'s update with every
  delay 0 (one micro-batch drained through ``drained_step``, SGD
  with rate 1) and ``-jax.grad`` of the composed model (:func:`composed_loss`,
  an independent composition) at the same weights."""
  from petra_jax.engine import pipeline  # pylint: disable=g-import-not-at-top
  pipe = pipeline.Pipeline(stages, optax.sgd(1.0), jax.devices()[:1], method=method)
  x, y = random_batch()
  state = pipe.init(0, x)
  params = [jax.tree.map(lambda a: a.copy(), s.params) for s in state.train_states]
  stats = [s.batch_stats for s in state.train_states]
  ref = composed_grad(stages, params, stats, x, y)
  state, _ = drained_step(pipe, state, x, y)
  step = jax.tree.map(lambda b, a: b - a, params, [s.params for s in state.train_states])
  return [rel_err(step[j], ref[j]) for j in range(len(stages))]


def drained_step(pipe, state, images, labels):
  """One micro-batch with every delay 0: the method's stage steps on the
  ``drained`` table. Returns ``(new_state, loss)``."""
  from petra_jax.engine.schedules import Schedule  # noqa: PLC0415
  state, outs = pipe.run(state, Schedule("drained", pipe.num_stages, 1),
                         lambda m: (images, labels))
  return state, outs[0].loss


# CLI flags evaluating a tiny run on the test split's first 500 images (one batch).
SMALL_EVAL = ("--config.eval_examples=500", "--config.eval_batch_size=500")


def tiny_config(data_dir, **overrides):
  """The default config at width 4, 40 steps of 32 images, constant rate 0.05,
  evaluated on the test split's first 500 images (one batch); ``overrides``
  maps dotted field names (``"optim.name"``) to values."""
  from petra_jax import config as config_lib  # pylint: disable=g-import-not-at-top
  c = config_lib.get_config()
  c.data_dir = data_dir
  c.model.width = 4
  c.batch_size = 32
  c.accumulation_steps = 1
  c.num_epochs = 1
  c.steps_per_epoch = 40
  c.log_every = 1
  c.num_devices = 1
  c.eval_batch_size = 500
  c.eval_examples = 500
  c.optim.learning_rate = 0.05
  c.optim.schedule = "constant"
  c.optim.warmup_epochs = 0
  return override(c, **overrides)


def override(config, **overrides):
  """``config`` with dotted fields (``"optim.name"``) set to the given values."""
  for k, v in overrides.items():
    target = config
    *path, last = k.split(".")
    for p in path:
      target = target[p]
    target[last] = v
  return config


def config_file(path, *variant):
  """``get_config(*variant)`` of a config file relative to the repository
  (config_flags' ``path:variant``)."""
  spec = importlib.util.spec_from_file_location("cfg", os.path.join(REPO, path))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config(*variant)


def train_losses(workdir) -> dict:
  """``{step: train_loss}`` of ``WORKDIR/metrics.jsonl`` (empty if absent)."""
  from petra_jax.training import metrics  # pylint: disable=g-import-not-at-top
  if not os.path.exists(os.path.join(str(workdir), "metrics.jsonl")):
    return {}
  return {r["step"]: r["train_loss"] for r in metrics.read_metrics(str(workdir))
          if "train_loss" in r}


def tensorboard_scalars(workdir):
  """``[(tag, step)]`` of every scalar in the event files, read from the
  TFRecord framing (8-byte length, 4-byte CRC, data, 4-byte CRC)."""
  import glob  # noqa: PLC0415
  import struct  # noqa: PLC0415
  from tensorboardX.proto import event_pb2  # noqa: PLC0415
  out = []
  for path in sorted(glob.glob(os.path.join(workdir, "tensorboard", "events.*"))):
    with open(path, "rb") as f:
      data = f.read()
    i = 0
    while i + 12 <= len(data):
      (n,) = struct.unpack("<Q", data[i:i + 8])
      event = event_pb2.Event.FromString(data[i + 12:i + 12 + n])
      out += [(v.tag, event.step) for v in event.summary.value if v.HasField("simple_value")]
      i += 12 + n + 4
  return out


def without_virtual_devices(environ) -> dict:
  """A copy of ``environ`` whose ``XLA_FLAGS`` keeps conftest's compile options but not its 4
  virtual CPU devices: for subprocesses that choose their own device count."""
  env = dict(environ)
  env["XLA_FLAGS"] = " ".join(f for f in env.get("XLA_FLAGS", "").split()
                              if not f.startswith("--xla_force_host_platform_device_count"))
  return env


def wait_for(condition, proc=None, what="the condition", timeout_s=300.0):
  """Polls ``condition()`` until true; fails if ``proc`` (a Popen) exits first
  or after ``timeout_s`` (a hang guard, not a measurement)."""
  deadline = time.monotonic() + timeout_s
  while not condition():
    if proc is not None and proc.poll() is not None:
      assert condition(), f"{what} never happened (exit {proc.returncode})"
      return
    assert time.monotonic() < deadline, f"{what} never happened in {timeout_s} s"
    time.sleep(0.05)


def restored_test_metrics(config, workdir, blocks):
  """``(test_loss, test_accuracy)`` of a finished run's last checkpoint over
  the first ``config.eval_examples`` test images (0: the whole split, read by
  ``data.load_split``), from :func:`composed_logits` of ``blocks`` (one per
  stage) in float32 and :func:`loss_and_accuracy`."""
  from petra_jax import data  # noqa: PLC0415
  from petra_jax.training import assembly  # noqa: PLC0415
  run, progress = assembly.setup(config, str(workdir))
  run.checkpointer.close()
  test = data.load_split(config.dataset, run.info.test_split, config.data_dir,
                         limit=config.eval_examples or None)
  states = progress.state.train_states
  assert len(states) == len(blocks)
  forward = jax.jit(lambda params, stats, x: composed_logits(blocks, params, stats, x))
  params, stats = [s.params for s in states], [s.batch_stats for s in states]
  mean, std = np.array(run.info.mean), np.array(run.info.std)
  logits = [forward(params, stats, ((test.images[i:i + 1000] / 255.0 - mean) / std
                                    ).astype(np.float32))
            for i in range(0, len(test), 1000)]
  return loss_and_accuracy(np.concatenate(logits), test.labels)


def train_in_process(capsys, *args):
  """``python -m petra_jax.train ARGS`` run in this process: ``train._parse_flags``
  then ``train.main``, as absl's ``app.run`` calls them, a ``sys.exit(message)``
  printed to stderr with status 1 as the interpreter does. Returns a
  ``subprocess.CompletedProcess`` of what ``capsys`` captured. absl's flags and
  logging verbosity are restored afterwards."""
  from absl import flags, logging  # noqa: PLC0415
  from petra_jax import train  # noqa: PLC0415
  verbosity, argv = logging.get_verbosity(), sys.argv
  sys.argv = ["petra_jax.train", *args]  # where ml_collections reads --config.* overrides
  capsys.readouterr()
  flags.FLAGS.unparse_flags()
  try:
    train.main(train._parse_flags(list(sys.argv)))  # pylint: disable=protected-access
    code = 0
  except SystemExit as e:
    code = e.code
  finally:
    flags.FLAGS.unparse_flags()
    for name in [n for n in flags.FLAGS if n.startswith("config.")]:
      delattr(flags.FLAGS, name)  # the overrides' flags, defined per parse
    logging.set_verbosity(verbosity)
    sys.argv = argv
  if isinstance(code, str):
    print(code, file=sys.stderr)
    code = 1
  out = capsys.readouterr()
  return subprocess.CompletedProcess(list(args), code or 0, out.out, out.err)


# ``python -c PAUSE STEP ARGS...``: the CLI (as ``python -m petra_jax.train
# ARGS``) printing "paused" and waiting for a line on stdin once the
# train_loss of update STEP is in metrics.jsonl.
PAUSE = """
import sys
from absl import app, flags
from petra_jax import train
from petra_jax.training import metrics
pause_at = int(sys.argv.pop(1))
write = metrics.MetricWriter.write
def paused(self, step, **scalars):
  write(self, step, **scalars)
  if step == pause_at and "train_loss" in scalars:
    print("paused", flush=True)
    sys.stdin.readline()
metrics.MetricWriter.write = paused
flags.mark_flags_as_required(["config"])
app.run(train.main, flags_parser=train._parse_flags)
"""


class Paused:
  """``python -m petra_jax.train ARGS`` under :data:`PAUSE`, started and
  stopped once the train_loss of update ``step`` is in ``--workdir``'s
  metrics.jsonl; its stderr goes to a file beside the workdir."""

  def __init__(self, args, step):
    workdir = pathlib.Path(next(a for a in args if a.startswith("--workdir="))[10:])
    self.err = workdir.parent / f"{workdir.name}.stderr"
    with open(self.err, "w") as err:  # a file: a pipe could fill
      self.proc = subprocess.Popen(
          [sys.executable, "-c", PAUSE, str(step), *args],
          cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True)
    for line in self.proc.stdout:
      if line == "paused\n":
        break
    assert self.proc.poll() is None, self._err()
    assert step in train_losses(workdir)

  def _err(self):
    return self.err.read_text()[-3000:]

  def signal_and_go_on(self, sig):
    """Sends ``sig``, lets the run go on; returns ``(exit status, stderr)``."""
    self.proc.send_signal(sig)
    if sig != signal.SIGKILL:
      self.proc.stdin.write("\n")
      self.proc.stdin.flush()
    self.proc.wait(timeout=600)
    return self.proc.returncode, self._err()

  def kill(self):
    self.proc.kill()
    self.proc.wait()


def reference_revnet():
  """stem, rev, rev, head at width 2: the reference loop's RevNet (J = 4, BatchNorm)."""
  from petra_jax import models  # pylint: disable=g-import-not-at-top
  from petra_jax.engine.stages.stage import Stage  # pylint: disable=g-import-not-at-top
  return [Stage("stem", models.Stem(2), False),
          Stage("rev0", models.BasicResidual(2), True),
          Stage("rev1", models.BasicResidual(2), True),
          Stage("head", models.Head(10), False)]


def reference_revvit():
  """A depth-1 RevViT at width 2 grouped into 3 stages (1, 2, 1): the reference loop's RevViT."""
  from petra_jax import models  # pylint: disable=g-import-not-at-top
  from petra_jax.engine.stages import partition  # pylint: disable=g-import-not-at-top
  blocks = models.build_model("revvit_tiny", width=2, depth=1, patch_size=4)
  return partition.group_stages(blocks, (1, 2, 1))


def drained_run(pipe, batches, num_micro_batches):
  """``pipe`` from seed 0 over ``num_micro_batches`` micro-batches, drained: ``(initial params,
  initial statistics, losses [M] in micro-batch order, final params, final statistics)``."""
  state = pipe.init(0, batches(0)[0])
  p0 = [jax.tree.map(np.array, s.params) for s in state.train_states]
  s0 = [jax.tree.map(np.array, s.batch_stats) for s in state.train_states]
  state, out = pipe.run(state, pipe.schedule(num_micro_batches), batches)
  assert state.in_flight() == 0
  assert sorted(o.micro_batch for o in out) == list(range(num_micro_batches))
  losses = np.array([float(o.loss) for o in sorted(out)])
  final = state.train_states
  return p0, s0, losses, [s.params for s in final], [s.batch_stats for s in final]


@contextlib.contextmanager
def compiles_counted():
  """Yields a list that holds, once the block ends, the first 80 characters of each program JAX
  compiled inside it (``jax.log_compiles``'s "Compiling ..." records, cache hits included)."""
  found: list = []

  class _Handler(logging.Handler):
    def emit(self, record):
      if record.getMessage().startswith("Compiling"):
        found.append(record.getMessage()[:80])
  handler, logger = _Handler(level=logging.WARNING), logging.getLogger("jax")
  logger.addHandler(handler)
  try:
    with jax.log_compiles():
      yield found
  finally:
    logger.removeHandler(handler)
