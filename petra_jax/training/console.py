"""What a run prints: a set-up summary, progress bars (on a terminal), a line
per evaluation and where outputs went (process 0); other libraries' INFO
logging only with absl's ``--verbosity``.
"""

from __future__ import annotations

import errno
import logging as std_logging
import math
import os
import sys
import time
from typing import Optional

from absl import logging
import jax
from tqdm import tqdm

from petra_jax import data as data_lib
from petra_jax import optim

_ACCELERATOR_INSTALL = {
    "gpu": "pip install -e '.[cuda12]'",
    "cuda": "pip install -e '.[cuda12]'",
    "tpu": "pip install -e '.[tpu]'",
}


# Other libraries' warnings that say nothing about the run (orbax 0.12.8).
_HARMLESS_WARNINGS = (
    "No jax.Array in TypeHandlerRegistry: ArrayMetadata persistence is disabled",
    "Global object size logging disabled",
)


def disk_full(e: BaseException) -> bool:
  """Whether ``e`` or an exception it was raised from is ENOSPC / EDQUOT."""
  seen = 0
  while e is not None and seen < 20:
    if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
      return True
    e, seen = e.__cause__ or e.__context__, seen + 1
  return False



class _DropHarmless(std_logging.Filter):
  """Drops the records of :data:`_HARMLESS_WARNINGS`."""

  def filter(self, record: std_logging.LogRecord) -> bool:
    if record.exc_info and disk_full(record.exc_info[1]):
      return False  # (the run says it in one line)
    message = record.getMessage()
    return not any(h in message for h in _HARMLESS_WARNINGS)


def quiet_library_logging(verbosity_given: bool) -> None:
  """Warnings and errors only, unless ``--verbosity`` was given; call
  before JAX starts its backends.
  """
  if not verbosity_given:
    logging.set_verbosity(logging.WARNING)
    logging.get_absl_handler().addFilter(_DropHarmless())


def _printing() -> bool:
  return jax.process_index() == 0


def say(line: str) -> None:
  """Prints one line (stdout, process 0 only) without breaking a progress bar."""
  if _printing():
    tqdm.write(line)


def warn(line: str) -> None:
  """Prints one line to stderr (process 0) without breaking a progress bar."""
  if _printing():
    tqdm.write(line, file=sys.stderr)


def progress(total: int, desc: str, unit: str, initial: int = 0, leave: bool = True) -> tqdm:
  """A progress bar on stderr (process 0, on a terminal only)."""
  return tqdm(total=total, initial=initial, unit=unit, unit_scale=True, desc=desc,
              disable=None if _printing() else True, mininterval=2.0, leave=leave)


def platform_mismatch(wanted: str, jax_platforms: str, backend: str) -> Optional[str]:
  """The warning line for an accelerator asked for (``wanted``, else the
  first of ``jax_platforms``) while JAX runs on ``backend`` "cpu", else None.
  """
  source = "config.platform"
  if not wanted and jax_platforms:
    wanted, source = jax_platforms.split(",")[0].strip(), "JAX_PLATFORMS"
  wanted = wanted.lower()
  if wanted not in _ACCELERATOR_INSTALL or backend != "cpu":
    return None
  return (f"warning: {source}={wanted!r} but JAX runs on the CPU (no {wanted} backend is "
          f"installed or it failed to start); install it: {_ACCELERATOR_INSTALL[wanted]}, "
          f"or set --config.platform=cpu.")


def check_platform(config) -> None:
  """Prints :func:`platform_mismatch`'s line, if any (stderr, process 0)."""
  line = platform_mismatch(config.platform,
                           os.environ.get("JAX_PLATFORMS") or jax.config.jax_platforms or "",
                           jax.default_backend())
  if line and _printing():
    tqdm.write(line, file=sys.stderr)


def backend_error() -> Optional[str]:
  """Starts JAX's backends (after ``jax.distributed``); the line naming the
  fix if ``$JAX_PLATFORMS``'s platform cannot start, else None.
  """
  try:
    jax.default_backend()
    return None
  except (RuntimeError, AssertionError) as e:
    asked = os.environ.get("JAX_PLATFORMS") or jax.config.jax_platforms or ""
    why = (str(e).splitlines() or [type(e).__name__])[0]
    install = _ACCELERATOR_INSTALL.get(asked.split(",")[0].strip().lower())
    fix = f"install it ({install}) or " if install else ""
    return (f"JAX could not start the platform JAX_PLATFORMS={asked!r} asks for ({why}); "
            f"{fix}unset JAX_PLATFORMS to use the ones installed.")


def setup_summary(run) -> None:
  """The run in a few lines: what trains where on what, how long, how it checkpoints.

  Args:
    run: the run's :class:`~petra_jax.training.assembly.Setup`.
  """
  c, pipe = run.config, run.pipe
  sizes = [len(s.blocks) or 1 for s in pipe.stages]
  examples = pipe.objective.examples
  where = sorted({f"{d.platform}:{d.id}" for d in pipe.devices})
  say(f"{c.method} {c.model.name} (width {c.model.width}) on {c.dataset}: {pipe.num_stages} "
      f"stages of {sizes} blocks on {', '.join(where)}; {len(run.train)} train / "
      f"{len(run.test)} test {examples}")
  say(f"data: {c.dataset} read from {os.path.abspath(data_lib.resolve_data_dir(c.data_dir))}")
  resumed = ""
  if run.restored_step is not None:
    resumed = (f", resumed at update {run.restored_step} (resumed from "
               f"{run.checkpointer.directory}/{run.restored_step})")
  say(f"{run.total_steps} updates of {c.batch_size} {examples} ({c.accumulation_steps} "
      f"micro-batches each), {run.steps_per_epoch} per epoch{resumed}")
  lr = optim.base_learning_rate(c)
  auto = (" (automatic: 0.1 x batch_size / 256, as optim.learning_rate = 0; set "
          "--config.optim.learning_rate to choose)") if not c.optim.learning_rate else ""
  every = f"every {c.checkpoint_every} updates" if c.checkpoint_every else ""
  if c.checkpoint_minutes and not c.checkpoint_drain:
    every += (" and " if every else "") + (f"at each epoch end and at least every "
                                           f"{c.checkpoint_minutes:g} min")
  rates = (f"learning rate {c.optim.muon_learning_rate:g} on the matrices, {lr:g} (AdamW) "
           f"on the rest" if c.optim.name == "muon" else f"learning rate {lr:g}")
  say(f"{c.optim.name} at {rates}{auto}; checkpoints {every or 'off'}")
  if getattr(run, "executor", None) is not None:
    say(f"executor: {run.executor.describe()}")


def epoch_line(step: int, steps_per_epoch: int, train_loss: float, result: dict) -> None:
  """``epoch E: train_loss L <every metric of result> (T s)``; ``E`` a fraction (``0.15``)
  at a step that ends no epoch (a run stopped early by ``max_steps``). ``train_loss`` is the
  last written ``train_loss`` line's; NaN (no line written yet: an evaluation before the
  first ``log_every`` updates) leaves it out."""
  epoch = (f"{step // steps_per_epoch}" if step % steps_per_epoch == 0
           else f"{step / steps_per_epoch:.2f}")
  metrics = " ".join(f"{k} {v:.4f}" for k, v in result.items() if k != "wall_time")
  train = f"train_loss {train_loss:.4f} " if math.isfinite(train_loss) else ""
  say(f"epoch {epoch}: {train}{metrics} ({result['wall_time']:.0f} s)")


def rate_text(examples_per_s: float, examples: str = "images",
              tokens_per_example: int = 0) -> str:
  """Throughput for a progress line: ``"R img/s"`` for images, else ``"R <examples>/s"`` and,
  with ``tokens_per_example`` (a sequence's tokens), ``", T tokens/s"``."""
  if examples == "images":
    return f"{examples_per_s:.1f} img/s"
  text = f"{examples_per_s:.1f} {examples}/s"
  if tokens_per_example:
    text += f", {examples_per_s * tokens_per_example:.0f} tokens/s"
  return text


# XLA's compile of one program, a load from the persistent compilation cache included.
_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
_compiling = {"seconds": 0.0, "listening": False}


def compile_seconds() -> float:
  """Seconds this process has spent in XLA compiles (every thread) since the first call: a
  ``jax.monitoring`` listener, registered by that call, sums the compile events."""
  if not _compiling["listening"]:
    jax.monitoring.register_event_duration_secs_listener(_count_compile)
    _compiling["listening"] = True
  return _compiling["seconds"]


def _count_compile(event: str, duration_secs: float, **kwargs) -> None:
  del kwargs
  if event == _COMPILE_EVENT:
    _compiling["seconds"] += duration_secs


class ProgressLines:
  """Where no progress bar shows (output not a terminal: SLURM, nohup, CI), a line
  ``step S/T (E epochs): train_loss L, R img/s`` at least every ``seconds``
  seconds (0: never), process 0 only; for text ``R sequences/s, T tokens/s``
  (:func:`rate_text`).

  ``S`` is the update dispatched; ``R`` counts the updates known to have run (``done``:
  the loss log's last line read), since dispatch runs ahead of the device by up to two
  ``train_loss`` lines; with no update known done since the last line, no line yet. ``R`` is
  wall time; where XLA compiled for a tenth of the line's window or more (the first programs,
  the drain's at the end), the line ends ``(C s of it compiling)``.
  """

  def __init__(self, seconds: float, bar: tqdm, total_steps: int, steps_per_epoch: int,
               batch_size: int, step: int, examples: str = "images",
               tokens_per_example: int = 0):
    self.enabled = bool(seconds) and bool(bar.disable) and _printing()
    self.seconds, self.total, self.per_epoch = seconds, total_steps, steps_per_epoch
    self.batch_size = batch_size
    self.examples, self.tokens_per_example = examples, tokens_per_example
    self.last_time, self.last_done = time.time(), step
    self.last_compiling = compile_seconds() if self.enabled else 0.0

  def update(self, step: int, train_loss: float, done: Optional[int] = None) -> None:
    """After dispatching update ``step`` (``done``: the last update known to have run;
    default ``step``): prints the line if ``seconds`` have passed and ``done`` moved."""
    if not self.enabled:
      return
    now, done = time.time(), step if done is None else done
    if now - self.last_time < self.seconds or done <= self.last_done:
      return
    window, compiling = max(now - self.last_time, 1e-9), compile_seconds() - self.last_compiling
    rate = (done - self.last_done) * self.batch_size / window
    loss = f"train_loss {train_loss:.4f}, " if math.isfinite(train_loss) else ""
    note = f" ({compiling:.1f} s of it compiling)" if compiling >= 0.1 * window else ""
    say(f"step {step}/{self.total} ({step / self.per_epoch:.2f} epochs): {loss}"
        f"{rate_text(rate, self.examples, self.tokens_per_example)}{note}")
    self.last_time, self.last_done, self.last_compiling = now, done, compile_seconds()


def outputs(workdir: str, checkpoint_dir: Optional[str]) -> None:
  """Where the metrics (and checkpoints) went."""
  line = (f"metrics: {os.path.join(workdir, 'metrics.jsonl')} (TensorBoard: "
          f"{os.path.join(workdir, 'tensorboard')})")
  if checkpoint_dir:
    line += f"; checkpoints: {checkpoint_dir}"
  say(line)
