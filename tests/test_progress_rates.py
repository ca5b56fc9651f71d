"""Progress lines say img/s for images and sequences/s, tokens/s for text."""

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
