"""The training loop, tick by tick, and its hooks between updates."""

from __future__ import annotations

import contextlib
import os
import time
from typing import Callable, NamedTuple, Optional

import jax
import ml_collections

from petra_jax import data as data_lib
from petra_jax.engine.stages import diagnostics
from petra_jax.engine import schedules as schedule_lib
from petra_jax.training import checkpoint as checkpoint_lib
from petra_jax.training import console
from petra_jax.training import distributed
from petra_jax.training import preemption
from petra_jax.training import profile_window
from petra_jax.training import run_record
from petra_jax.training import validation
from petra_jax.training.assembly import Progress, Setup, setup
from petra_jax.training.evaluate import evaluate
from petra_jax.training.loss_log import Diverged


EPOCH_END_MIN_SECONDS = 60.0  # an epoch end this soon after a save is not saved again

def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str,
                       restart: bool = False, on_accepted: Optional[Callable] = None) -> dict:
  """Trains ``config.model`` with ``config.method`` and evaluates it.

  Runs the method's tick table over ``total_steps * k`` micro-batches; writes
  ``WORKDIR/config.json`` (once the config is validated and the workdir's
  checkpoint, if any, accepted: a refused run never overwrites another's
  record), ``metrics.jsonl`` and TensorBoard events. A run whose last
  checkpoint ends it prints one line and returns its last evaluation;
  ``restart`` deletes the workdir's run first (after validating the config).

  Args:
    config: the run's config (:mod:`petra_jax.config`).
    workdir: the run's directory (resumed from its newest checkpoint, if any).
    restart: start over: delete the workdir's run first.
    on_accepted: called once the set-up has succeeded.

  Returns:
    The last evaluation's metrics plus ``wall_time`` (seconds since start).

  Raises:
    ConfigError, data.DataError, FloatingPointError (a NaN/Inf loss);
    SystemExit(75) after SIGTERM / SIGINT.
  """
  console.check_platform(config)
  if _begin(config, workdir, restart):
    return run_record.last_result(workdir)
  with preemption.StopOnSignal(announce=False) as stop:
    # Set up: data, pipeline, schedule, checkpointer; the newest checkpoint restored.
    run, progress = _set_up(config, workdir, stop)
    _record(run)
    if on_accepted is not None:
      on_accepted()
    if run.restored_step == run.total_steps:  # (a run-length field changed, not its end)
      _say_finished(workdir, run.total_steps)
      _close(run)
      return run_record.last_result(workdir)
    run.writer.write_text("config", "```\n" + config.to_json(indent=2, sort_keys=True) + "\n```")
    console.setup_summary(run)
    # Train: every update, logged, evaluated and checkpointed as the config says.
    progress = _train(run, progress, stop)
    # Finish: the last losses, evaluation and checkpoint.
    with _discard_diverged(run):
      return finish(run, progress)


def _set_up(config, workdir: str, stop: preemption.StopOnSignal) -> tuple[Setup, Progress]:
  """:func:`setup`; a signal during it exits (75) with one line, nothing trained."""
  stop.raising = True
  try:
    run, progress = setup(config, workdir)
  except preemption.Interrupted as e:
    message = (f"preempted by {e.signal_name} during start-up, before any training; "
               "re-run the same command to start again.")
    if jax.process_count() > 1:
      distributed.exit_now(message if jax.process_index() == 0 else "",
                           preemption.PREEMPTED_EXIT_CODE)
    preemption.exit_preempted(message)
  stop.raising = False
  return run, progress


def _train(run: Setup, progress: Progress, stop: preemption.StopOnSignal) -> Progress:
  """The tick table from the restored tick on: after each update its hooks (a train_loss
  line, an evaluation, a checkpoint) as the config says; a stop request checkpoints and
  exits (75). Returns the progress after the last tick."""
  c = run.config
  bar, lines = _progress_display(run, progress.step)
  with _discard_diverged(run), contextlib.closing(bar), \
      profile_window.ProfileWindow(c.profile_steps, run.workdir, progress.step) as window:
    t = progress.state.tick
    while t < len(run.schedule):
      # A call runs several updates only up to the next one whose hooks read the state
      # (evaluation, checkpoint): the hooks then see the state of that very update.
      with jax.profiler.TraceAnnotation(profile_window.CALL_EVENT):
        progress.state, outputs, n = run.executor.advance(
            progress.state, run.schedule, t, run.batches, limit=_next_drain_point(run, t),
            last_micro_batch=_next_due_step(run, progress.step) * c.accumulation_steps - 1)
      run.loss_log.begin_call()
      for out in outputs:
        run.relay.add(out.micro_batch, out.loss)
      updates = _updates_fed(run, t, t + n)
      progress.step = updates[-1] if updates else progress.step
      window.after_call(progress.step, progress.state)
      t += n
      if t in run.drain_points:  # (checkpoint_drain) the pipeline is empty
        progress.last_save = save_checkpoint(run, progress)
      lines.update(progress.step, run.loss_log.last_loss, run.loss_log.read_step)
      if not updates:
        continue
      bar.update(len(updates) * c.batch_size)
      if progress.step < run.total_steps:  # (the last update's hooks: finish)
        due = _due(run, progress.step)
        if due.log or due.evaluate:
          run.relay.flush()  # multi-process: the losses so far reach process 0
        if due.log:
          _log_diagnostics(run)
        if due.evaluate:
          progress.result = evaluate_and_log(run, progress)
        if _checkpoint_due(run, progress, due.epoch_end):
          progress.last_save = save_checkpoint(run, progress)
      if _stop_requested(run, progress.step, stop) and progress.step < run.total_steps:
        bar.close()
        preempt(run, progress, stop.signal_name or "a signal to another process")
  return progress


def _progress_display(run: Setup, step: int) -> tuple:
  """``(bar, lines)``: the progress bar and the progress lines from update ``step`` on."""
  c, examples = run.config, run.pipe.objective.examples
  bar = console.progress(run.total_steps * c.batch_size, c.method, examples,
                         initial=step * c.batch_size)
  lines = console.ProgressLines(c.progress_seconds, bar, run.total_steps, run.steps_per_epoch,
                                c.batch_size, step, examples,
                                tokens_per_example=_tokens_per_example(run))
  return bar, lines


def _tokens_per_example(run: Setup) -> int:
  """Tokens in one training example: a sequence's length ``T`` for text, 0 for images."""
  if run.pipe.objective.examples == "images":
    return 0
  return int(run.config.model.context or run.info.image_shape[0])


def _updates_fed(run: Setup, t: int, end: int) -> list:
  """The updates whose last micro-batch ticks ``t`` to ``end - 1`` fed, in order
  (update ``s`` counts ``s`` updates fed: 1 for the first)."""
  k, updates = run.config.accumulation_steps, []
  for u in range(t, end):
    m = schedule_lib.fed(run.schedule[u])
    if m is not None and (m + 1) % k == 0:
      updates.append((m + 1) // k)
  return updates


def _next_drain_point(run: Setup, t: int) -> int:
  """The first tick after ``t`` at which the pipeline is drained (checkpoint_drain), or the end."""
  return min([p for p in run.drain_points if p > t] + [len(run.schedule)])


def _next_due_step(run: Setup, step: int) -> int:
  """The next update after ``step`` at which a hook reads the state: an epoch's end
  (evaluation, checkpoint), an evaluation within it, ``checkpoint_every``, or the last update.

  A train_loss line is not one: each loss carries its micro-batch, so a call may run past it
  (the loss log reads a call's losses after the next dispatch). What reads at a line, the
  probes and the multi-process loss relay, runs on the host executor, one tick a call."""
  c = run.config
  every = [run.steps_per_epoch] + ([c.checkpoint_every] if c.checkpoint_every else [])
  spe, offsets = run.steps_per_epoch, evaluation_offsets(run.steps_per_epoch, c.evals_per_epoch)
  within = [(step // spe) * spe + o for o in offsets] + [(step // spe + 1) * spe + offsets[0]]
  return min([(step // n + 1) * n for n in every] + [s for s in within if s > step]
             + [run.total_steps])


def evaluation_offsets(steps_per_epoch: int, evals_per_epoch: int) -> list[int]:
  """The updates into an evaluated epoch after which to evaluate: ``ceil(i S / n)`` for
  ``i = 1..n`` (``S`` updates an epoch, ``n = evals_per_epoch``), sorted, the last ``S``."""
  n = max(1, evals_per_epoch)
  return sorted({-(-i * steps_per_epoch // n) for i in range(1, n + 1)})


class _Due(NamedTuple):
  """The hooks due after an update: a train_loss line, an evaluation; whether it ends an epoch."""
  log: bool
  evaluate: bool
  epoch_end: bool


def _due(run: Setup, step: int) -> _Due:
  """What to do after update ``step`` (before the last) as ``log_every``, ``eval_every`` and
  ``evals_per_epoch`` say (:func:`evaluation_offsets` into each ``eval_every``-th epoch)."""
  c, spe = run.config, run.steps_per_epoch
  epoch_end = step % spe == 0
  epoch = -(-step // spe)  # 1-based: the epoch update ``step`` belongs to
  evaluate_now = bool(c.eval_every and epoch % c.eval_every == 0 and step - (epoch - 1) * spe
                      in evaluation_offsets(spe, c.evals_per_epoch))
  return _Due(step % c.log_every == 0, evaluate_now, epoch_end)


def _begin(config, workdir: str, restart: bool) -> bool:
  """Before set-up: ``restart`` (a config that fails validation deletes nothing), a note on a
  changed config; True (and one line) when the workdir's run is finished already."""
  if restart:
    validation.validate_config(config, len(jax.local_devices()))
  if restart and jax.process_index() == 0:
    run_record.start_over(workdir)
  if restart and jax.process_count() > 1:
    distributed.barrier("petra_jax restart")
  newest = checkpoint_lib.newest_meta(os.path.join(workdir, "checkpoints"))
  extra = {} if newest is None else newest[1].get("extra", {})
  if newest is not None and run_record.finished(newest[0], extra, config):
    _say_finished(workdir, newest[0])
    return True
  changed = run_record.differences(extra["config"], config) if "config" in extra else []
  if changed and jax.process_index() == 0:
    console.warn(f"warning: resuming {workdir} (step {newest[0]}) with a config that differs "
                 f"from its checkpoint's: {'; '.join(changed)}.")
  return False


def _record(run: Setup) -> None:
  """After a successful set-up: ``config.json`` (process 0)."""
  if jax.process_index() == 0:
    run_record.write_config(run.workdir, run.config)


def _say_finished(workdir: str, step: int) -> None:
  console.say(f"already finished: {workdir} holds the checkpoint of its last step ({step}); "
              "nothing to do (pass --restart to train it again from scratch).")


def _close(run: Setup) -> None:
  """Closes the checkpointer (after its last save) and the metrics writer."""
  run.checkpointer.wait()
  run.checkpointer.close()
  run.writer.close()


def checkpointing(config) -> bool:
  """Whether the run checkpoints at all."""
  return bool(config.checkpoint_every or config.checkpoint_minutes)


def _checkpoint_due(run: Setup, progress: Progress, epoch_end: bool) -> bool:
  """Whether to checkpoint after update ``progress.step`` (not the last, not with
  ``checkpoint_drain``: that one checkpoints at its drain points)."""
  c = run.config
  if c.checkpoint_drain:
    return False
  return bool((c.checkpoint_every and progress.step % c.checkpoint_every == 0)
              or _auto_checkpoint_due(run, progress, epoch_end))


def _auto_checkpoint_due(run: Setup, progress: Progress, epoch_end: bool) -> bool:
  """``checkpoint_minutes``: that long after the last checkpoint, and at an epoch's end unless
  this run saved less than :data:`EPOCH_END_MIN_SECONDS` ago (on a GPU an epoch can take
  seconds, and a save each would cost a large share of them). Multi-process: process 0's
  clock, agreed at epoch ends and every ``preemption_check_every`` updates.
  """
  minutes = run.config.checkpoint_minutes
  if not minutes:
    return False
  now, last = time.time(), progress.last_save
  since = now - (run.began if last is None else last)
  late = since >= 60 * minutes or (epoch_end and (last is None or since >= EPOCH_END_MIN_SECONDS))
  if not run.pipe.multiprocess:
    return late
  if not epoch_end and progress.step % run.config.distributed.preemption_check_every:
    return False
  return bool(distributed.broadcast_int(int(late)))


def finish(run: Setup, progress: Progress) -> dict:
  """After the last tick: the last losses, evaluation and checkpoint.

  Args:
    run: the run's set-up.
    progress: the progress after the last tick (``step == run.total_steps``).

  Returns:
    The last evaluation's metrics plus ``wall_time`` (text: and the final split's).

  Raises:
    Diverged: a NaN/Inf loss.
  """
  run.relay.flush()
  run.loss_log.finish(run.total_steps)
  _log_diagnostics(run, wait=True)
  result = evaluate_and_log(run, progress)
  if run.info.final_split:
    result = {**result, **_evaluate_final_split(run, progress)}
  if checkpointing(run.config) and (run.restored_step or 0) < run.total_steps:
    save_checkpoint(run, progress)
  run.checkpointer.prune(verified_through=run.total_steps)
  _close(run)
  console.outputs(run.workdir,
                  run.checkpointer.directory if checkpointing(run.config) else None)
  return result


def evaluate_and_log(run: Setup, progress: Progress) -> dict:
  """Test metrics with the weights of update ``progress.step``, written at that step.

  Args:
    run: the run's set-up (its test split, writer).
    progress: the state to evaluate and its step.

  Returns:
    The metrics plus ``wall_time`` (seconds since the run's start).
  """
  result = evaluate(run.pipe, progress.state, run.test, run.info, run.config.eval_batch_size,
                    prefix=run.info.eval_prefix)
  result["wall_time"] = time.time() - run.start
  run.writer.write(progress.step, epoch=progress.step / run.steps_per_epoch, **result)
  if result.keys() - {"wall_time"}:
    console.epoch_line(progress.step, run.steps_per_epoch, run.loss_log.last_loss, result)
  return result


def _evaluate_final_split(run: Setup, progress: Progress) -> dict:
  """The final figure: ``test_*`` metrics on ``info.final_split`` (text's test split)."""
  split = data_lib.open_eval_split(run.config.dataset, run.info.final_split, run.test.context,
                                   run.test.vocabulary, run.config.data_dir or None)
  result = evaluate(run.pipe, progress.state, split, run.info, run.config.eval_batch_size)
  run.writer.write(progress.step, epoch=progress.step / run.steps_per_epoch, **result)
  if result:
    console.say(" ".join(f"{k} {v:.4f}" for k, v in result.items()))
  return result


def save_checkpoint(run: Setup, progress: Progress) -> float:
  """Saves the whole pipeline at ``progress.step`` (every process, its part);
  older known-good checkpoints beyond ``keep_checkpoints`` are pruned first.

  Args:
    run: the run's set-up (its checkpointer, loss log, writer).
    progress: the state to save and its step.

  Returns:
    The time of the save (``time.time()``), the progress's next ``last_save``.

  Raises:
    Diverged: a NaN/Inf loss among those not yet verified.
  """
  run.relay.flush()
  run.checkpointer.prune(verified_through=_verified_through(run))
  _log_diagnostics(run, wait=True)
  log_meta, log_arrays = run.loss_log.state()
  run.writer.flush()
  run.checkpointer.save(progress.step, progress.state, extra={
      "loss_log": log_meta, "metrics_offset": run.writer.offset(),
      "config": run_record.as_dict(run.config),
      "run": run_record.run_end(run.config, run.total_steps),
      "wall_time": time.time() - run.start}, extra_arrays=log_arrays)
  return time.time()


def preempt(run: Setup, progress: Progress, signal_name: str) -> None:
  """SIGTERM/SIGINT: checkpoint at this update, one line, exit 75 (every
  process; process 0 prints).

  Args:
    run: the run's set-up.
    progress: the state to save and its step.
    signal_name: the signal's name for the line (``SIGTERM``).

  Raises:
    SystemExit: always (75, ``preemption.PREEMPTED_EXIT_CODE``).
  """
  if run.checkpointer.latest_step() != progress.step:
    save_checkpoint(run, progress)
  _close(run)
  message = (f"preempted by {signal_name} at step {progress.step}: checkpoint saved in "
             f"{run.checkpointer.directory}; re-run the same command to resume.")
  if run.pipe.multiprocess:  # skip jax.distributed's shutdown barrier
    # ... but not before every process has its part saved: process 0 leads the
    # coordination service, and a peer still waiting on its save when it exits aborts.
    distributed.barrier("preempted: every checkpoint part saved")
    distributed.exit_now(message if jax.process_index() == 0 else "",
                         preemption.PREEMPTED_EXIT_CODE)
  preemption.exit_preempted(message)


def _verified_through(run: Setup) -> int:
  """The updates whose losses are all known finite (process 0's count);
  raises Diverged on every process if one is NaN/Inf."""
  try:
    run.loss_log.check_finite()
    verified = run.loss_log.next_step
  except Diverged as e:
    if not run.pipe.multiprocess:
      raise
    verified = -e.step
  if run.pipe.multiprocess:
    verified = distributed.broadcast_int(verified)
  if verified < 0:
    raise Diverged(float("nan"), -verified)
  return verified


def _log_diagnostics(run: Setup, wait: bool = False) -> None:
  """Writes the reconstruction errors and gradient qualities measured so far
  (computed ticks ago: reading them does not wait, unless ``wait``)."""
  k = run.config.accumulation_steps
  if run.reconstruction is not None:
    for m, j, err in run.reconstruction.pop_results():
      run.writer.write(m // k + 1, **{f"reconstruction_error/stage_{j}": float(err)})
  if run.grad_quality is not None:
    _write_grad_quality(run.writer, run.grad_quality.pop_results(wait), k, run.steps_per_epoch)


def _write_grad_quality(writer, results, k: int, steps_per_epoch: int):
  """Gradient-quality lines (paper App. B) at step ``m // k + 1``."""
  for m, quality in results:
    values = jax.device_get(quality)
    step = m // k + 1
    writer.write(step, epoch=step / steps_per_epoch, **{
        diagnostics.metric_key(name, j): float(v[j])
        for name, v in values.items() for j in range(len(v))})


@contextlib.contextmanager
def _discard_diverged(run: Setup):
  """On :class:`Diverged` at step N, deletes the checkpoints at steps >= N."""
  try:
    yield
  except Diverged as e:
    run.checkpointer.discard_from(e.step)
    raise


def _stop_requested(run: Setup, step: int, stop: preemption.StopOnSignal) -> bool:
  """Whether to stop after update ``step``: a signal here or, multi-process, on
  any process (agreed only every ``preemption_check_every`` updates)."""
  if not run.pipe.multiprocess:
    return stop.requested
  if step % run.config.distributed.preemption_check_every:
    return False
  return distributed.any_process(stop.requested)
