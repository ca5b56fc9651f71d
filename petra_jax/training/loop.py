"""The training loop, tick by tick, and its hooks between updates."""

from __future__ import annotations

import contextlib
import os
import time
from typing import Callable, Optional

import jax
import ml_collections

from petra_jax import data as data_lib
from petra_jax.engine.stages import diagnostics
from petra_jax.engine import schedules as schedule_lib
from petra_jax.training import checkpoint as checkpoint_lib
from petra_jax.training import console
from petra_jax.training import distributed
from petra_jax.training import preemption
from petra_jax.training import run_record
from petra_jax.training import validation
from petra_jax.training.assembly import Run, setup
from petra_jax.training.evaluate import evaluate
from petra_jax.training.loss_log import Diverged


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str,
                       restart: bool = False, on_accepted: Optional[Callable] = None) -> dict:
  """Trains ``config.model`` with ``config.method`` and evaluates it.

  Runs the method's tick table over ``total_steps * k`` micro-batches; writes
  ``WORKDIR/config.json`` (once the config is validated and the workdir's
  checkpoint, if any, accepted: a refused run never overwrites another's
  record), ``metrics.jsonl`` and TensorBoard events. A run whose last
  checkpoint ends it prints one line and returns its last evaluation;
  ``restart`` deletes the workdir's run first (after validating the config).
  ``on_accepted()`` is called once the set-up has succeeded.

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
    run = _setup(config, workdir, stop)
    _record(run)
    if on_accepted is not None:
      on_accepted()
    if run.restored_step == run.total_steps:  # (a run-length field changed, not its end)
      _say_finished(workdir, run.total_steps)
      run.checkpointer.close()
      run.writer.close()
      return run_record.last_result(workdir)
    run.writer.write_text("config", "```\n" + config.to_json(indent=2, sort_keys=True) + "\n```")
    console.setup_summary(run)
    _run_ticks(run, stop)
    with _discard_diverged(run):
      return finish(run)


def _setup(config, workdir: str, stop: preemption.StopOnSignal) -> Run:
  """:func:`setup`; a signal during it exits (75) with one line, nothing trained."""
  stop.raising = True
  try:
    run = setup(config, workdir)
  except preemption.Interrupted as e:
    message = (f"preempted by {e.signal_name} during start-up, before any training; "
               "re-run the same command to start again.")
    if jax.process_count() > 1:
      distributed.exit_now(message if jax.process_index() == 0 else "",
                           preemption.PREEMPTED_EXIT_CODE)
    preemption.exit_preempted(message)
  stop.raising = False
  return run


def _tokens_per_example(run: Run) -> int:
  """Tokens in one training example: a sequence's length ``T`` for text, 0 for images."""
  if run.pipe.objective.examples == "images":
    return 0
  return int(run.config.model.context or run.info.image_shape[0])


def _run_ticks(run: Run, stop: preemption.StopOnSignal) -> None:
  """The tick table from the run's tick on: every update logged, checkpointed and
  evaluated as the config says; a stop request checkpoints and exits (75)."""
  config = run.config
  bar = console.progress(run.total_steps * config.batch_size, config.method,
                         run.pipe.objective.examples, initial=run.step * config.batch_size)
  examples = run.pipe.objective.examples
  lines = console.ProgressLines(config.progress_seconds, bar, run.total_steps,
                                run.steps_per_epoch, config.batch_size, run.step, examples,
                                tokens_per_example=_tokens_per_example(run))
  with _discard_diverged(run), contextlib.closing(bar):
    t = run.state.tick
    while t < len(run.schedule):
      run.state, outputs, n = run.executor.advance(
          run.state, run.schedule, t, run.batches, limit=_next_drain_point(run, t),
          last_micro_batch=_next_due_step(run) * config.accumulation_steps - 1)
      for out in outputs:
        run.relay.add(out.micro_batch, out.loss)
      # A call runs several updates only up to the next one whose hooks act (log,
      # evaluation, checkpoint): the hooks then see the state of that very update.
      fed = sum(_update_fed(run, run.schedule[u]) for u in range(t, t + n))
      t += n
      if t in run.drain_points:  # (checkpoint_drain) the pipeline is empty
        save_checkpoint(run)
      if fed:
        bar.update(fed * config.batch_size)
        on_update(run)
        lines.update(run.step, run.loss_log.last_loss)
        if _stop_requested(run, stop) and run.step < run.total_steps:
          bar.close()
          preempt(run, stop.signal_name or "a signal to another process")


def _next_drain_point(run: Run, t: int) -> int:
  """The first tick after ``t`` at which the pipeline is drained (checkpoint_drain), or the end."""
  return min([p for p in run.drain_points if p > t] + [len(run.schedule)])


def _next_due_step(run: Run) -> int:
  """The next update after ``run.step`` at which a hook acts: a train_loss line, an epoch's
  end (evaluation, checkpoint), ``checkpoint_every``, or the last update."""
  c, s = run.config, run.step
  every = [c.log_every, run.steps_per_epoch] + ([c.checkpoint_every] if c.checkpoint_every else [])
  return min([(s // n + 1) * n for n in every] + [run.total_steps])


def _begin(config, workdir: str, restart: bool) -> bool:
  """Before set-up: ``restart`` (a config that fails validation deletes
  nothing), a note on a changed config; True (and one line) when the
  workdir's run is finished already."""
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


def _record(run: Run) -> None:
  """After a successful set-up: ``config.json`` (process 0)."""
  if jax.process_index() == 0:
    run_record.write_config(run.workdir, run.config)


def _say_finished(workdir: str, step: int) -> None:
  console.say(f"already finished: {workdir} holds the checkpoint of its last step ({step}); "
              "nothing to do (pass --restart to train it again from scratch).")


def checkpointing(config) -> bool:
  """Whether the run checkpoints at all."""
  return bool(config.checkpoint_every or config.checkpoint_minutes)


def on_update(run: Run) -> None:
  """After update ``run.step``: logs, evaluations and checkpoints as configured."""
  c, step = run.config, run.step
  if step == run.total_steps:
    return
  epoch_end = step % run.steps_per_epoch == 0
  evaluating = epoch_end and c.eval_every and (step // run.steps_per_epoch) % c.eval_every == 0
  if step % c.log_every == 0 or evaluating:
    run.relay.flush()  # multi-process: the losses so far reach process 0
  if step % c.log_every == 0:
    _log_diagnostics(run)
  if evaluating:
    evaluate_and_log(run)
  if not c.checkpoint_drain and ((c.checkpoint_every and step % c.checkpoint_every == 0)
                                 or _auto_checkpoint_due(run, epoch_end)):
    save_checkpoint(run)


def _auto_checkpoint_due(run: Run, epoch_end: bool) -> bool:
  """``checkpoint_minutes``: at an epoch's end or that long after the last
  checkpoint (multi-process: process 0's clock, agreed every
  ``preemption_check_every`` updates).
  """
  minutes = run.config.checkpoint_minutes
  if not minutes:
    return False
  if epoch_end:
    return True
  late = time.time() - run.last_save >= 60 * minutes
  if not run.pipe.multiprocess:
    return late
  if run.step % run.config.distributed.preemption_check_every:
    return False
  return bool(distributed.broadcast_int(int(late)))


def finish(run: Run) -> dict:
  """After the last tick: the last losses, evaluation and checkpoint."""
  run.relay.flush()
  run.loss_log.finish(run.total_steps)
  _log_diagnostics(run, wait=True)
  evaluate_and_log(run)
  if run.info.final_split:
    _evaluate_final_split(run)
  if checkpointing(run.config) and (run.restored_step or 0) < run.total_steps:
    save_checkpoint(run)
  run.checkpointer.prune(verified_through=run.total_steps)
  run.checkpointer.wait()
  run.checkpointer.close()
  run.writer.close()
  console.outputs(run.workdir,
                  run.checkpointer.directory if checkpointing(run.config) else None)
  return run.result


def evaluate_and_log(run: Run) -> None:
  """Test metrics with the current weights, written at ``run.step``."""
  result = evaluate(run.pipe, run.state, run.test, run.info, run.config.eval_batch_size,
                    prefix=run.info.eval_prefix)
  result["wall_time"] = time.time() - run.start
  run.writer.write(run.step, epoch=run.step / run.steps_per_epoch, **result)
  if result.keys() - {"wall_time"}:
    console.epoch_line(run.step, run.steps_per_epoch, run.loss_log.last_loss, result)
  run.result = result


def _evaluate_final_split(run: Run) -> None:
  """The final figure: ``test_*`` metrics on ``info.final_split`` (text's test split)."""
  split = data_lib.open_eval_split(run.config.dataset, run.info.final_split, run.test.context,
                                   run.test.vocabulary, run.config.data_dir or None)
  result = evaluate(run.pipe, run.state, split, run.info, run.config.eval_batch_size)
  run.writer.write(run.step, epoch=run.step / run.steps_per_epoch, **result)
  run.result.update(result)
  if result:
    console.say(" ".join(f"{k} {v:.4f}" for k, v in result.items()))


def save_checkpoint(run: Run) -> None:
  """Saves the whole pipeline at ``run.step`` (every process, its part);
  older known-good checkpoints beyond ``keep_checkpoints`` are pruned first.
  """
  run.relay.flush()
  run.checkpointer.prune(verified_through=_verified_through(run))
  _log_diagnostics(run, wait=True)
  log_meta, log_arrays = run.loss_log.state()
  run.writer.flush()
  run.checkpointer.save(run.step, run.state, extra={
      "loss_log": log_meta, "metrics_offset": run.writer.offset(),
      "config": run_record.as_dict(run.config),
      "run": run_record.run_end(run.config, run.total_steps),
      "wall_time": time.time() - run.start}, extra_arrays=log_arrays)
  run.last_save = time.time()


def preempt(run: Run, signal_name: str) -> None:
  """SIGTERM/SIGINT: checkpoint at this update, one line, exit 75 (every
  process; process 0 prints).
  """
  if run.checkpointer.latest_step() != run.step:
    save_checkpoint(run)
  run.checkpointer.wait()
  run.checkpointer.close()
  run.writer.close()
  message = (f"preempted by {signal_name} at step {run.step}: checkpoint saved in "
             f"{run.checkpointer.directory}; re-run the same command to resume.")
  if run.pipe.multiprocess:  # skip jax.distributed's shutdown barrier
    distributed.exit_now(message if jax.process_index() == 0 else "",
                         preemption.PREEMPTED_EXIT_CODE)
  preemption.exit_preempted(message)


def _verified_through(run: Run) -> int:
  """The updates whose losses are all known finite (process 0's count);
  raises Diverged on every process if one is NaN/Inf.
  """
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


def _log_diagnostics(run: Run, wait: bool = False) -> None:
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
def _discard_diverged(run: Run):
  """On :class:`Diverged` at step N, deletes the checkpoints at steps >= N."""
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
  """Whether to stop at this update: a signal here or, multi-process, on
  any process (agreed only every ``preemption_check_every`` updates).
  """
  if not run.pipe.multiprocess:
    return stop.requested
  if run.step % run.config.distributed.preemption_check_every:
    return False
  return distributed.any_process(stop.requested)
