"""Language models (models/gpt.py, engine/objective.py, data/text.py, sample.py): the
causal mask, exact reconstruction, zero-delay updates against jax.grad, the loss and
evaluation against NumPy, windows, sampling, and the recipe through the CLI."""

import os
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from helpers import composed_grad, composed_logits, config_file, drained_step, rel_err
from petra_jax import models, sample
from petra_jax.data import text
from petra_jax.engine.stages import objective
from petra_jax.engine import pipeline
from petra_jax.engine.stages import stage as stage_lib
from petra_jax.training import evaluate

V, T = 11, 8


def tiny(name, depth=2):
  """stem, (attn, mlp) x depth, head: 4 heads x 2 = 8 features, vocabulary V."""
  return models.build_model(name, width=2, depth=depth, num_classes=V)


def tokens(batch=4, seed=0):
  ids = np.random.default_rng(seed).integers(0, V, (batch, T + 1)).astype(np.int32)
  return jnp.asarray(ids[:, :-1]), jnp.asarray(ids[:, 1:])


def init(stages, seed=0):
  method = "petra" if stage_lib.has_reversible(stages) else "backprop"
  pipe = pipeline.Pipeline(stages, optax.sgd(1.0), jax.devices()[:1], method=method,
                           objective=objective.NEXT_TOKEN)
  state = pipe.init(seed, tokens()[0])
  return pipe, state, [s.params for s in state.train_states]


@pytest.mark.parametrize("name", ["gpt_nano", "revgpt_nano"])
def test_future_tokens_do_not_change_past_logits(name):
  stages = tiny(name)
  _, _, params = init(stages)
  x, _ = tokens()
  forward = jax.jit(lambda x: composed_logits(stages, params, [{}] * len(stages), x))
  logits = forward(x)
  assert logits.shape == (4, T, V)
  for t in range(T - 1):
    changed = x.at[:, t + 1].set((x[:, t + 1] + 1) % V)
    other = forward(changed)
    np.testing.assert_allclose(other[:, :t + 1], logits[:, :t + 1], rtol=1e-6, atol=1e-6)
    assert np.abs(other[:, t + 1] - logits[:, t + 1]).max() > 1e-4


def test_attention_is_flax_multi_head_attention_with_a_causal_mask():
  """Same variables (names, shapes, initial values) and outputs as flax's
  MultiHeadDotProductAttention under nn.make_causal_mask, with non-zero biases."""
  import flax.linen as nn  # noqa: PLC0415
  from petra_jax.models import gpt  # noqa: PLC0415
  x = jax.random.normal(jax.random.key(0), (3, 7, 8))
  ours = gpt.CausalSelfAttention(heads=4)
  theirs = nn.MultiHeadDotProductAttention(num_heads=4, kernel_init=gpt.init)
  v_ours, v_theirs = ours.init(jax.random.key(1), x), theirs.init(jax.random.key(1), x, x)
  assert jax.tree.structure(v_ours) == jax.tree.structure(v_theirs)
  for a, b in zip(jax.tree.leaves(v_ours), jax.tree.leaves(v_theirs)):
    np.testing.assert_array_equal(a, b)
  keys = iter(jax.random.split(jax.random.key(2), 16))
  v = jax.tree.map(lambda a: jax.random.normal(next(keys), a.shape), v_theirs)
  mask = nn.make_causal_mask(jnp.ones(x.shape[:2], jnp.int32))
  np.testing.assert_allclose(ours.apply(v, x), theirs.apply(v, x, x, mask=mask),
                             rtol=1e-5, atol=1e-5)


def test_gelu_is_the_exact_gelu():
  """x Phi(x) against float64 math.erf (torch's nn.GELU(), flax's gelu(approximate=False))."""
  import math  # noqa: PLC0415
  from petra_jax.models import gpt  # noqa: PLC0415
  x = np.linspace(-8.0, 8.0, 1601, dtype=np.float32)
  want = [0.5 * float(v) * (1.0 + math.erf(float(v) / math.sqrt(2.0))) for v in x]
  np.testing.assert_allclose(gpt.gelu(jnp.asarray(x)), want, rtol=1e-6, atol=1e-6)


def test_causal_reversible_blocks_reconstruct_their_input():
  stages = tiny("revgpt_nano")
  _, _, params = init(stages)
  h = stage_lib.forward(stages[0], params[0], {}, tokens()[0])[0]
  body = stage_lib.group(stages[1:-1])
  p = {f"block_{i}": q for i, q in enumerate(params[1:-1])}
  stats = {k: {} for k in p}
  back = stage_lib.inverse(body, p, stats, stage_lib.forward(body, p, stats, h)[0])
  assert rel_err(back, h) < 1e-6


@pytest.mark.parametrize("method", ["petra", "revprop", "delayed", "1f1b"])
def test_zero_delay_update_equals_jax_grad(method):
  """One micro-batch drained (every delay 0), SGD at rate 1: each stage's step is
  jax.grad of the composed model (helpers.composed_loss, written without the engine)."""
  stages = tiny("revgpt_nano")
  pipe = pipeline.Pipeline(stages, optax.sgd(1.0), jax.devices()[:1], method=method,
                           objective=objective.NEXT_TOKEN)
  x, y = tokens()
  state = pipe.init(0, x)
  params = [jax.tree.map(lambda a: a.copy(), s.params) for s in state.train_states]
  ref = composed_grad(stages, params, [{}] * len(stages), x, y)
  state, _ = drained_step(pipe, state, x, y)
  step = jax.tree.map(lambda b, a: b - a, params, [s.params for s in state.train_states])
  errors = [rel_err(step[j], ref[j]) for j in range(len(stages))]
  assert max(errors) < 1e-4, errors


def _numpy_nats(logits, targets):
  z = np.asarray(logits, np.float64)
  z = z - z.max(-1, keepdims=True)
  logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
  return -np.take_along_axis(logp, np.asarray(targets)[..., None], -1)[..., 0]


def test_loss_and_metrics_against_numpy():
  rng = np.random.default_rng(1)
  logits = rng.normal(size=(3, 5, V)).astype(np.float32) * 3
  targets = rng.integers(0, V, (3, 5)).astype(np.int32)
  nats = _numpy_nats(logits, targets)
  np.testing.assert_allclose(objective.NEXT_TOKEN.loss(logits, targets), nats.mean(), rtol=1e-6)
  loss_sum, hits = objective.eval_sums(logits, targets, np.int32(2))  # rows 0 and 1
  np.testing.assert_allclose(loss_sum, nats[:2].sum(), rtol=1e-6)
  assert int(hits) == int((logits[:2].argmax(-1) == targets[:2]).sum())
  m = objective.NEXT_TOKEN.metrics(float(loss_sum), int(hits), 10, "val")
  mean = nats[:2].mean()
  np.testing.assert_allclose([m["val_loss"], m["val_bits_per_char"], m["val_perplexity"]],
                             [mean, mean / np.log(2), np.exp(mean)], rtol=1e-6)
  assert set(objective.CLASSIFICATION.metrics(1.0, 1, 2)) == {"test_loss", "test_accuracy"}


def _split(n=60, fixed=True, seed=2):
  ids = np.random.default_rng(seed).integers(0, V, n).astype(np.int32)
  return text.TextSplit(ids, T, fixed, text.Vocabulary("abcdefghijk"))


def test_windows_are_shifted_and_evaluation_windows_do_not_overlap():
  train, test = _split(fixed=False), _split(fixed=True)
  assert len(train) == 60 - T and len(test) == (60 - 1) // T
  x, y = train.windows(np.array([0, 5]))
  np.testing.assert_array_equal(x[1], train.ids[5:5 + T])
  np.testing.assert_array_equal(y[1], train.ids[6:6 + T])
  np.testing.assert_array_equal(train.labels[np.array([5])], y[1:])
  _, y = test.windows(np.arange(len(test)))
  np.testing.assert_array_equal(y.ravel(), test.ids[1:1 + len(test) * T])


def test_evaluation_against_an_independent_forward_on_fixed_windows():
  stages = tiny("revgpt_nano", depth=1)
  pipe, state, params = init(stages)
  split = _split(n=61)
  got = evaluate.evaluate(pipe, state, split, None, batch_size=4, prefix="val")
  x, y = split.windows(np.arange(len(split)))
  nats = _numpy_nats(composed_logits(stages, params, [{}] * len(stages), x), y)
  np.testing.assert_allclose(got["val_loss"], nats.mean(), rtol=1e-5)
  np.testing.assert_allclose(got["val_bits_per_char"], nats.mean() / np.log(2), rtol=1e-5)


def test_evaluation_windows_by_hand_and_across_joined_splits(monkeypatch):
  """Window i feeds ids i T .. i T + T - 1 and scores i T + 1 .. i T + T, i < (N - 1) // T;
  ``nanogpt_val`` is validation then test joined, its windows cut across the seam."""
  split = text.TextSplit(np.arange(23, dtype=np.int32), 5, True, text.Vocabulary("ab"))
  assert len(split) == 4  # (23 - 1) // 5: ids 21 and 22 are never scored
  x, y = split.windows(np.arange(4))
  np.testing.assert_array_equal(x, [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9], [10, 11, 12, 13, 14],
                                    [15, 16, 17, 18, 19]])
  np.testing.assert_array_equal(y, x + 1)
  fake = {"validation": "abcdefg", "test": "hij"}
  monkeypatch.setattr(text, "read_text", lambda name, s, data_dir=None, download=None: fake[s])
  vocabulary = text.Vocabulary.from_text("abcdefghij")
  joined = text.open_eval_split("tiny_shakespeare", "nanogpt_val", 3, vocabulary)
  assert vocabulary.decode(joined.ids) == "abcdefghij" and len(joined) == 3
  x, y = joined.windows(np.arange(3))
  assert [vocabulary.decode(w) for w in x] == ["abc", "def", "ghi"]  # "ghi" straddles the seam
  assert [vocabulary.decode(w) for w in y] == ["bcd", "efg", "hij"]
  assert len(text.open_eval_split("tiny_shakespeare", "validation", 3, vocabulary)) == 2
  with pytest.raises(ValueError, match="nanogpt_val"):
    text.eval_text("tiny_shakespeare", "nope")


def _predict():
  stages = tiny("gpt_nano", depth=1)
  _, _, params = init(stages, seed=3)
  forward = jax.jit(lambda x: composed_logits(stages, params, [{}] * len(stages), x))
  return lambda ids: forward(jnp.asarray(ids))


def test_greedy_sampling_is_the_argmax_of_a_teacher_forced_forward():
  predict = _predict()
  prompt = np.array([1, 2, 3], np.int32)
  out = sample.generate(predict, prompt, T - 3, T, temperature=0.0)
  full = np.concatenate([prompt, out])[None]
  want = np.asarray(predict(full)).argmax(-1)[0, 2:-1]
  np.testing.assert_array_equal(out[:-1], want[:len(out) - 1])
  longer = sample.generate(predict, prompt, 12, T, temperature=0.0)  # past the context
  np.testing.assert_array_equal(longer[:T - 3], out)


def test_same_seed_same_text():
  predict = _predict()
  prompt = np.array([4], np.int32)
  a = sample.generate(predict, prompt, 10, T, temperature=1.0, seed=0)
  b = sample.generate(predict, prompt, 10, T, temperature=1.0, seed=0)
  c = sample.generate(predict, prompt, 10, T, temperature=1.0, seed=1)
  np.testing.assert_array_equal(a, b)
  assert not np.array_equal(a, c)


def test_vocabulary_errors_name_the_characters(tmp_path):
  vocab = text.Vocabulary.from_text("hello world")
  assert vocab.decode(vocab.encode("low")) == "low"
  with pytest.raises(ValueError, match="'Z'"):
    vocab.encode("helloZ")
  text.save_vocabulary(str(tmp_path), vocab)
  assert text.load_vocabulary(str(tmp_path)) == vocab
  with pytest.raises(ValueError, match="another vocabulary"):
    text.save_vocabulary(str(tmp_path), text.Vocabulary("ab"))


def test_sample_on_an_empty_workdir_is_one_line(tmp_path, capsys):
  assert sample.main(["--workdir", str(tmp_path)]) == 1
  err = capsys.readouterr().err.strip()
  assert err.count("\n") == 0 and "no trained language model" in err


SHARED_TFDS = pathlib.Path(__file__).resolve().parents[1].parent / "shared" / "data" / \
    "tensorflow_datasets"


@pytest.fixture(scope="module")
def shakespeare_dir():
  for d in (os.environ.get("TFDS_DATA_DIR"), str(SHARED_TFDS)):
    if d and (pathlib.Path(d) / "tiny_shakespeare").is_dir():
      return d
  if os.environ.get("CI"):
    pytest.fail("tiny_shakespeare not found (set TFDS_DATA_DIR)", pytrace=False)
  pytest.skip("tiny_shakespeare not found (set TFDS_DATA_DIR)")


def test_runlocal_trains_resumes_samples_and_scores(shakespeare_dir, tmp_path, capsys,
                                                   monkeypatch):
  from petra_jax.training import loop  # pylint: disable=g-import-not-at-top

  config = config_file("configs/shakespeare_cpu.py", "runlocal")
  config.data_dir = shakespeare_dir
  config.max_steps = 3
  workdir = str(tmp_path)
  first = loop.train_and_evaluate(config, workdir)
  assert 0 < first["val_loss"] < 5 and "test_bits_per_char" in first
  config.max_steps = 0  # the whole run: resumes at update 3
  second = loop.train_and_evaluate(config, workdir)
  out = capsys.readouterr().out
  assert "resumed at update 3" in out
  assert "updates of 8 sequences (2 micro-batches each)" in out and " images" not in out
  assert second["val_loss"] < 5
  assert sample.main(["--workdir", workdir, "--prompt", "ROMEO:", "--length", "20",
                      "--temperature", "0"]) == 0
  out = capsys.readouterr().out
  assert out.startswith("ROMEO:") and len(out.rstrip("\n")) >= 6
  _check_text_losses(workdir, monkeypatch, capsys)


def _check_text_losses(workdir: str, monkeypatch, capsys) -> None:
  """``validation`` and ``test`` scored from a finished run's checkpoint equal its last logged
  ``val_loss`` and ``test_loss`` to float32 round-off; the cache spares a second load."""
  import json  # pylint: disable=g-import-not-at-top
  from petra_jax.training import metrics  # pylint: disable=g-import-not-at-top
  records = metrics.read_metrics(workdir)
  logged = {"validation": [r["val_loss"] for r in records if "val_loss" in r][-1],
            "test": [r["test_loss"] for r in records if "test_loss" in r][-1]}
  got = evaluate.text_losses(workdir, ["validation", "test", "nanogpt_val"])
  for name in logged:
    np.testing.assert_allclose(got[name], logged[name], rtol=1e-6)
  # Validation and test are the two halves of nanogpt_val, equally long.
  assert min(logged.values()) - 0.05 < got["nanogpt_val"] < max(logged.values()) + 0.05
  saved = json.loads((pathlib.Path(workdir) / evaluate.TEXT_LOSSES_FILE).read_text())
  assert saved == {"step": max(r["step"] for r in records), "losses": got}
  monkeypatch.setattr(evaluate, "load", lambda workdir: pytest.fail("recomputed"))
  assert evaluate.text_losses(workdir, ["nanogpt_val"]) == {"nanogpt_val": got["nanogpt_val"]}
  assert sample.main(["--workdir", workdir, "--evaluate", "validation,nanogpt_val"]) == 0
  out = capsys.readouterr().out
  assert f"validation: {got['validation']:.4f} nats/char" in out and "nanogpt_val:" in out


def test_study_rows_are_valid_configs_and_the_gap_is_to_revprop():
  from petra_jax.studies import language_model as study  # pylint: disable=g-import-not-at-top
  from petra_jax.training import validation  # pylint: disable=g-import-not-at-top

  class Args:
    recipe = str(pathlib.Path(__file__).resolve().parents[1] / "configs" / "shakespeare_cpu.py")
    epochs, steps_per_epoch, data_dir = 1, 5, ""

  for row in study.ROWS:
    validation.validate_config(study.row_config(Args, row, 0), 1)
  def run(row, seed, val):
    return dict(row=row, seed=seed, wall_time=1.0,
                losses={"validation": val, "test": val + 0.1, "nanogpt_val": None})

  lines = study.table([run("revprop", 0, 1.75), run("petra_j4_k4", 0, 1.80)])
  assert "| +0.050 | one seed | 1.900 | +0.050 | one seed | n/a | n/a | n/a |" in lines[-1]


def test_study_is_registered_in_the_studies_command(capsys):
  """``python -m petra_jax.studies language_model --rows=nope``: one line naming the rows."""
  from petra_jax.studies import cli  # pylint: disable=g-import-not-at-top
  assert cli.main(["language_model", "--rows=nope", "--workdir=/nonexistent"]) == 1
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and "revprop" in err[0], err


def test_nanogpt_val_is_validation_then_test_the_last_tenth_of_the_text(shakespeare_dir):
  """nanoGPT's shakespeare_char/prepare.py: val.bin = data[int(n * 0.9):] of the whole text."""
  parts = [text.read_text("tiny_shakespeare", s, shakespeare_dir, False)
           for s in ("train", "validation", "test")]
  joined = text.eval_text("tiny_shakespeare", "nanogpt_val", shakespeare_dir)
  assert joined == parts[1] + parts[2] and len(joined) == 2 * 55_770
  whole = "".join(parts)
  assert joined == whole[int(len(whole) * 0.9):]


def test_the_reference_gets_at_least_as_many_probes_as_petra_each_a_change():
  """Issue 48: revprop's own knobs as rows, at least as many as PETRA's probes, and every one
  changes the reference's config (a probe equal to the recipe would count without being one)."""
  from petra_jax.studies import language_model as study  # pylint: disable=g-import-not-at-top

  class Args:
    recipe = str(pathlib.Path(__file__).resolve().parents[1] / "configs" / "shakespeare_cpu.py")
    epochs, steps_per_epoch, data_dir = 4, 0, ""
  probes = [r for r in study.ROWS if r.startswith("revprop_")]
  assert len(probes) >= study.PETRA_PROBES == 5
  base = study.row_config(Args, "revprop", 100).to_dict()
  for row in probes:
    assert study.row_config(Args, row, 100).to_dict() != base, row
  assert study.row_config(Args, "revprop_lr0.002", 100).optim.learning_rate == 0.002
  assert study.stale_updates("revprop_wd0.3") == (4, 4, 0.0)


def test_pipeline_rows_at_a_probed_rate_change_only_the_rate():
  """``<row>_lr<x>``: PETRA (or delayed) with the re-tuned reference's rate carried over,
  every other field the row's; an unknown row is one line naming the row patterns."""
  from petra_jax.studies import language_model as study  # pylint: disable=g-import-not-at-top

  class Args:
    recipe = str(pathlib.Path(__file__).resolve().parents[1] / "configs" / "shakespeare_cpu.py")
    epochs, steps_per_epoch, data_dir = 4, 0, ""
  base = study.row_config(Args, "petra_j4_k16_lookahead_own", 0).to_dict()
  tuned = study.row_config(Args, "petra_j4_k16_lookahead_own_lr0.003", 0).to_dict()
  assert tuned["optim"].pop("learning_rate") == 0.003 != base["optim"].pop("learning_rate")
  assert tuned == base
  with pytest.raises(ValueError) as e:
    study.row_config(Args, "petra_j4_k16_lr0.003", 0)
  assert "\n" not in str(e.value) and "_lr<rate of REFERENCE_PROBES>" in str(e.value)
