"""Progress lines say img/s for images and sequences/s, tokens/s for text."""

from petra_jax.training import console


def test_images_per_second():
  assert console.rate_text(12.5) == "12.5 img/s"


def test_sequences_and_tokens_per_second():
  # 64 sequences of 256 characters each in 2 s: 32 sequences/s, 32 * 256 tokens/s.
  assert console.rate_text(64 / 2, "sequences", 256) == "32.0 sequences/s, 8192 tokens/s"
  assert console.rate_text(3.0, "sequences") == "3.0 sequences/s"
