"""Progress lines say img/s for images and sequences/s, tokens/s for text."""

import jax
import jax.numpy as jnp

from petra_jax.training import console


def test_images_per_second():
  assert console.rate_text(12.5) == "12.5 img/s"


def test_sequences_and_tokens_per_second():
  # 64 sequences of 256 characters each in 2 s: 32 sequences/s, 32 * 256 tokens/s.
  assert console.rate_text(64 / 2, "sequences", 256) == "32.0 sequences/s, 8192 tokens/s"
  assert console.rate_text(3.0, "sequences") == "3.0 sequences/s"


class _Bar:
  disable = True


def test_the_rate_counts_updates_known_to_have_run(monkeypatch, capsys):
  """Dispatch runs ahead of the device: the rate counts the updates whose losses were read
  (``done``), and no line comes while none is known to have run since the last line."""
  clock = [100.0]
  monkeypatch.setattr(console.time, "time", lambda: clock[0])
  monkeypatch.setattr(console, "_printing", lambda: True)
  lines = console.ProgressLines(10.0, _Bar(), total_steps=100, steps_per_epoch=50,
                                batch_size=8, step=0)
  clock[0] = 120.0
  lines.update(40, 1.5, done=0)  # 40 updates dispatched, none known done: no line
  assert capsys.readouterr().out == ""
  lines.update(40, 1.5, done=25)  # 25 updates of 8 images in 20 s
  assert "step 40/100 (0.80 epochs): train_loss 1.5000, 10.0 img/s" in capsys.readouterr().out


def test_a_line_says_how_much_of_its_window_went_to_compiling(monkeypatch, capsys):
  """The rate stays wall time; a window with a tenth or more of it compiling says so."""
  clock = [100.0]
  monkeypatch.setattr(console.time, "time", lambda: clock[0])
  monkeypatch.setattr(console, "_printing", lambda: True)
  lines = console.ProgressLines(10.0, _Bar(), total_steps=100, steps_per_epoch=50,
                                batch_size=8, step=0)
  event = "/jax/core/compile/backend_compile_duration"
  jax.monitoring.record_event_duration_secs(event, 3.0)  # as XLA reports a compile
  clock[0] = 120.0
  lines.update(10, 1.5)  # 10 updates of 8 images in 20 s, 3 s of them compiling
  assert capsys.readouterr().out.rstrip().endswith("4.0 img/s (3.0 s of it compiling)")
  jax.monitoring.record_event_duration_secs(event, 1.9)  # under a tenth of the next 20 s
  clock[0] = 140.0
  lines.update(20, 1.4)
  assert capsys.readouterr().out.rstrip().endswith("4.0 img/s")


def test_jax_reports_a_compile_under_the_event_counted():
  before = console.compile_seconds()
  jax.jit(lambda x: x * 3 + 1)(jnp.arange(7.0)).block_until_ready()  # a new program
  assert console.compile_seconds() > before
