"""The small-scale studies: the numbers in their tables, checked by hand.

The study commands are run with a stand-in trainer that writes a
``metrics.jsonl`` chosen here and returns its last evaluation, so every
figure a table shows is known in advance; one real tiny run checks the
table against the metrics file that training wrote.
"""

import json
import math
import os

import pytest

from helpers import REPO
from petra_jax import studies


def _write_metrics(workdir, records):
  os.makedirs(workdir, exist_ok=True)
  with open(os.path.join(workdir, "metrics.jsonl"), "w", encoding="utf-8") as f:
    for r in records:
      f.write(json.dumps(r) + "\n")


def _records(losses, evals, recon=()):
  """Train losses at steps 1, 2, ...; then ``(wall_time, accuracy)`` evaluations;
  then reconstruction errors."""
  out = [{"step": i + 1, "epoch": (i + 1) / len(losses), "train_loss": v}
         for i, v in enumerate(losses)]
  out += [{"step": len(losses), "epoch": 1.0 * (i + 1), "test_loss": 1.0,
           "test_accuracy": acc, "wall_time": wall} for i, (wall, acc) in enumerate(evals)]
  out += [{"step": len(losses), "epoch": 1.0, f"reconstruction_error/stage_{j}": e}
          for j, e in enumerate(recon)]
  return out


class FakeTrainer:
  """Stands in for ``train.train_and_evaluate``: writes ``records(config)``
  and returns the last evaluation, as the trainer does; keeps every config."""

  def __init__(self, records):
    self.records, self.configs = records, []

  def __call__(self, config, workdir):
    self.configs.append(config)
    records = self.records(config)
    _write_metrics(workdir, records)
    last = [r for r in records if "test_accuracy" in r][-1]
    return {"test_loss": 1.0, "test_accuracy": last["test_accuracy"],
            "wall_time": last["wall_time"]}


def _run(monkeypatch, tmp_path, fake, argv):
  monkeypatch.setattr(studies.train, "train_and_evaluate", fake)
  out = tmp_path / "docs"
  rc = studies.main([*argv, "--width=4", "--batch-size=16", f"--out={out}",
                     f"--workdir={tmp_path / 'runs'}"])
  assert rc == 0
  return out


def _table_rows(text):
  """The markdown table's data rows, as lists of cell strings."""
  lines = [l for l in text.splitlines() if l.startswith("| `")]
  return [[c.strip() for c in l.strip("|").split("|")] for l in lines]


# Accuracy, last train loss and wall time of each method's stand-in run.
TABLE4_RUNS = {"backprop": (0.60, 1.25, 10.0), "delayed": (0.50, 1.50, 20.0),
               "dsp": (0.45, 1.75, 30.0), "approximate_input": (0.40, 2.00, 40.0),
               "petra": (0.55, 2.25, 50.0)}


def test_table4_rows_by_hand(monkeypatch, tmp_path):
  def records(config):
    acc, loss, wall = TABLE4_RUNS[config.method]
    return _records([3.0, loss], [(wall / 2, 0.1), (wall, acc)])
  fake = FakeTrainer(records)
  out = _run(monkeypatch, tmp_path, fake, ["table4", "--compensation=spike"])
  rows = _table_rows((out / "table4.md").read_text())
  # Paper Table 4: (delayed, input buffer, param. buffer) and its CIFAR-100 accuracy.
  expected = [["`backprop`", "no", "-", "-", "60.0", "1.250", "10", "77.5"],
              ["`delayed`", "yes", "yes", "yes", "50.0", "1.500", "20", "76.5"],
              ["`dsp`", "yes", "yes", "no", "45.0", "1.750", "30", "76.4"],
              ["`approximate_input`", "yes", "no", "yes", "40.0", "2.000", "40", "75.4"],
              ["`petra`", "yes", "no", "no", "55.0", "2.250", "50", "75.9"]]
  assert rows == expected
  assert [c.method for c in fake.configs] == list(TABLE4_RUNS)
  for c in fake.configs:
    assert c.accumulation_steps == 1 and c.batch_size == 16 and c.model.width == 4
    # The compensation applies to the delayed methods only.
    assert c.compensation.name == ("none" if c.method == "backprop" else "spike")
  assert (out / "table4.png").stat().st_size > 1000


def test_ksweep_micro_batches_by_hand(monkeypatch, tmp_path):
  def records(config):
    k = config.accumulation_steps
    return _records([2.0, 1.0 + k / 8], [(5.0 * k, 0.3 + k / 100)])
  fake = FakeTrainer(records)
  out = _run(monkeypatch, tmp_path, fake, ["ksweep", "--ks=2,4"])
  rows = _table_rows((out / "ksweep.md").read_text())
  # 16 images per update split into k micro-batches.
  assert rows == [["`backprop`", "1", "16", "31.0", "1.125", "5"],
                  ["`petra_k2`", "2", "8", "32.0", "1.250", "10"],
                  ["`petra_k4`", "4", "4", "34.0", "1.500", "20"]]
  assert [(c.method, c.accumulation_steps, c.batch_size) for c in fake.configs] == [
      ("backprop", 1, 16), ("petra", 2, 16), ("petra", 4, 16)]


def test_compensation_gaps_and_equal_wall_time_by_hand(monkeypatch, tmp_path):
  # backprop evaluates at 10, 20, 30 s; each PETRA row ends at its own time.
  petra = {((), "none"): (0.65, 15.0), ((), "spike"): (0.55, 25.0),
           ((1, 2, 2, 5), "none"): (0.45, 35.0), ((1, 2, 2, 5), "spike"): (0.35, 5.0)}

  def records(config):
    if config.method == "backprop":
      return _records([2.0, 1.0], [(10.0, 0.5), (20.0, 0.6), (30.0, 0.7)])
    acc, wall = petra[(tuple(config.model.stage_sizes), config.compensation.name)]
    return _records([2.0, 1.5], [(wall, acc)], recon=(1e-3, 3e-3))
  fake = FakeTrainer(records)
  out = _run(monkeypatch, tmp_path, fake, ["compensation", "--ks=2", "--stages=10,4",
                                           "--compensations=none,spike"])
  rows = _table_rows((out / "compensation.md").read_text())
  # gap = 100 (0.7 - acc); backprop at the row's wall time: its last evaluation
  # at or before it (none before 10 s); mean reconstruction error (1e-3 + 3e-3) / 2.
  assert rows == [
      ["`backprop_k2`", "1", "2", "-", "70.0", "+0.0", "nan", "30", "nan"],
      ["`petra_J10_k2_none`", "10", "2", "none", "65.0", "+5.0", "50.0", "15", "2.00e-03"],
      ["`petra_J10_k2_spike`", "10", "2", "spike", "55.0", "+15.0", "60.0", "25", "2.00e-03"],
      ["`petra_J4_k2_none`", "4", "2", "none", "45.0", "+25.0", "70.0", "35", "2.00e-03"],
      ["`petra_J4_k2_spike`", "4", "2", "spike", "35.0", "+35.0", "nan", "5", "2.00e-03"]]
  assert all(c.accumulation_steps == 2 for c in fake.configs)
  assert (out / "compensation_accuracy.png").stat().st_size > 1000


def test_summaries_of_a_hand_written_metrics_file(tmp_path):
  records = _records([2.0, 1.0], [(10.0, 0.25), (20.0, 0.5)], recon=(1e-2, 3e-2, 2e-2))
  assert math.isnan(studies.at_wall_time(records, 9.0))  # no evaluation yet
  assert studies.at_wall_time(records, 10.0) == 0.25
  assert studies.at_wall_time(records, 19.9) == 0.25
  assert studies.at_wall_time(records, 25.0) == 0.5
  assert studies.mean_reconstruction_error(records) == pytest.approx(2e-2)
  assert math.isnan(studies.mean_reconstruction_error(records[:2]))


@pytest.mark.long
def test_ksweep_table_matches_its_metrics_files(cifar10_dir, tmp_path):
  """A real tiny run: the table's accuracy, loss and micro-batch are those of
  the metrics each run wrote."""
  out, work = tmp_path / "docs", tmp_path / "runs"
  rc = studies.main(["ksweep", "--ks=2", "--width=4", "--batch-size=16", "--steps-per-epoch=4",
                     "--log-every=1", f"--data-dir={cifar10_dir}", f"--out={out}",
                     f"--workdir={work}"])
  assert rc == 0
  text = (out / "ksweep.md").read_text()
  assert "python -m petra_jax.studies ksweep --ks=2 --width=4" in text
  for row, (name, k) in zip(_table_rows(text), (("backprop", 1), ("petra_k2", 2))):
    with open(work / name / "metrics.jsonl", encoding="utf-8") as f:
      records = [json.loads(line) for line in f]
    losses = [r["train_loss"] for r in records if "train_loss" in r]
    last_eval = [r for r in records if "test_accuracy" in r][-1]
    assert len(losses) == 4  # one per update, --log-every=1
    assert row == [f"`{name}`", str(k), str(16 // k), f"{100 * last_eval['test_accuracy']:.1f}",
                   f"{losses[-1]:.3f}", f"{last_eval['wall_time']:.0f}"]
  assert (out / "ksweep.png").stat().st_size > 1000


def test_unknown_study_is_rejected(capsys):
  with pytest.raises(SystemExit) as e:
    studies.main(["table5"])
  assert e.value.code == 2
  assert "invalid choice: 'table5'" in capsys.readouterr().err


def test_local_rows_selected_by_name(monkeypatch, tmp_path):
  """--rows keeps the named rows (in the study's order); backprop at the same
  wall time is NaN when backprop is not among them; a bad name is one error."""
  accs = {("forward_gradient", "random"): 0.30, ("forward_gradient", "local"): 0.40,
          ("local", "local"): 0.45}

  def records(config):
    acc = accs[(config.method, config.forward_gradient.guess)]
    return _records([2.0, 1.0], [(10.0, acc)])
  fake = FakeTrainer(records)
  out = _run(monkeypatch, tmp_path, fake, ["local", "--stages=5", "--seeds=1",
                                           "--rows=local,fg_random_weights,fg_local_weights"])
  rows = _table_rows((out / "local.md").read_text())
  assert [(r[0], r[1], r[2], r[3], r[4]) for r in rows] == [
      ("`local_J5_s1`", "5", "1", "45.0", "nan"),
      ("`fg_local_weights_J5_s1`", "5", "1", "40.0", "nan"),
      ("`fg_random_weights_J5_s1`", "5", "1", "30.0", "nan")]
  assert [(c.forward_gradient.perturb, tuple(c.model.stage_sizes)) for c in fake.configs][1:] \
      == [("weights", (1, 2, 2, 2, 3))] * 2
  monkeypatch.setattr(studies.train, "train_and_evaluate", fake)
  assert studies.main(["local", "--rows=fg_magic", f"--out={tmp_path}"]) == 1
  fake.configs.clear()
  out = _run(monkeypatch, tmp_path, fake, ["local", "--stages=5", "--rows=local", "--ks=4"])
  assert [r[0] for r in _table_rows((out / "local.md").read_text())] == ["`local_J5_s0_k4`"]
  assert [c.accumulation_steps for c in fake.configs] == [4]


def test_transformers_means_gaps_and_equal_wall_time_by_hand(monkeypatch, tmp_path):
  """Per row: accuracy per seed and their mean; the gap to backprop's mean over the same
  seeds; backprop's accuracy at the row's wall time, same seed (NaN before its first eval)."""
  runs = {("backprop", 0): [(10.0, 0.5), (20.0, 0.6), (30.0, 0.7)],
          ("backprop", 1): [(10.0, 0.4), (20.0, 0.5), (30.0, 0.6)],
          ("none", 0): [(25.0, 0.55)], ("none", 1): [(15.0, 0.45)],
          ("adam_lookahead", 0): [(35.0, 0.65)], ("adam_lookahead", 1): [(5.0, 0.60)]}

  def records(config):
    row = "backprop" if config.method == "backprop" else config.compensation.name
    return _records([2.0, 1.0], runs[(row, config.seed)])
  fake = FakeTrainer(records)
  out = _run(monkeypatch, tmp_path, fake, ["transformers", "--seeds=0,1",
                                           "--rows=backprop,petra,petra_lookahead"])
  rows = _table_rows((out / "transformers_study.md").read_text())
  assert rows == [
      ["`backprop`", "0, 1", "70.0, 60.0", "65.0", "+0.0", "65.0", "30, 30"],
      ["`petra`", "0, 1", "55.0, 45.0", "50.0", "+15.0", "50.0", "25, 15"],
      ["`petra_lookahead`", "0, 1", "65.0, 60.0", "62.5", "+2.5", "nan", "35, 5"]]
  # The recipe (configs/cifar10_vit_cpu.py) with each row's fields, 6 epochs by default.
  assert [(c.method, c.model.name, tuple(c.model.stage_sizes), c.seed, c.num_epochs)
          for c in fake.configs[::2]] == [("backprop", "vit_tiny", (), 0, 6),
                                          ("petra", "revvit_tiny", (3, 2, 2, 3), 0, 6),
                                          ("petra", "revvit_tiny", (3, 2, 2, 3), 0, 6)]
  assert all(c.optim.name == "adam" and c.optim.learning_rate == 1e-3 for c in fake.configs)
  assert (out / "transformers_study_accuracy.png").stat().st_size > 1000
  monkeypatch.setattr(studies.train, "train_and_evaluate", fake)
  assert studies.main(["transformers", "--rows=petra_magic", f"--out={tmp_path}"]) == 1
  assert studies.main(["transformers", "--recipe=no/such.py", f"--out={tmp_path}"]) == 1


def test_config_override_sets_dotted_fields_and_rejects_unknown_ones():
  from petra_jax import config as config_lib
  c = config_lib.override(config_lib.get_config(), {"optim.name": "muon", "seed": 3})
  assert (c.optim.name, c.seed) == ("muon", 3)
  with pytest.raises(KeyError, match="optim.nme"):
    config_lib.override(c, {"optim.nme": "adam"})


@pytest.mark.long
def test_transformers_study_reads_back_finished_runs(cifar10_dir, tmp_path, capsys):
  """Real tiny runs (the recipe's :runlocal variant): the table shows the accuracy each run
  logged, and a second call reads the finished runs back instead of training them again."""
  argv = ["transformers", "--rows=backprop,petra_lookahead", "--seeds=0", "--epochs=1",
          "--steps-per-epoch=2", f"--recipe={REPO}/configs/cifar10_vit_cpu.py:runlocal",
          f"--data-dir={cifar10_dir}", f"--out={tmp_path / 'docs'}",
          f"--workdir={tmp_path / 'runs'}"]
  assert studies.main(argv) == 0
  first = (tmp_path / "docs" / "transformers_study.md").read_text()
  for row in _table_rows(first):
    name = row[0].strip("`") + "_s0"
    with open(tmp_path / "runs" / name / "metrics.jsonl", encoding="utf-8") as f:
      last = [json.loads(line) for line in f if "test_accuracy" in line][-1]
    assert row[2] == f"{100 * last['test_accuracy']:.1f}"
  capsys.readouterr()
  assert studies.main(argv) == 0
  assert capsys.readouterr().out.count("already finished") == 2
  assert (tmp_path / "docs" / "transformers_study.md").read_text() == first


def test_a_study_writes_to_its_run_directory_unless_asked(monkeypatch, tmp_path):
  """Run from a repository root (issue 39, item 8): without --out the page goes to
  runs/studies/<study>, and docs/ is left exactly as it was; --out=docs writes there."""
  monkeypatch.chdir(tmp_path)
  (tmp_path / "docs").mkdir()
  (tmp_path / "docs" / "ksweep.md").write_text("the committed page")
  fake = FakeTrainer(lambda config: _records([2.0, 1.0], [(5.0, 0.3)]))
  monkeypatch.setattr(studies.train, "train_and_evaluate", fake)
  assert studies.main(["ksweep", "--ks=2", "--width=4", "--batch-size=16"]) == 0
  assert (tmp_path / "docs" / "ksweep.md").read_text() == "the committed page"
  assert sorted(p.name for p in (tmp_path / "docs").iterdir()) == ["ksweep.md"]
  assert "`petra_k2`" in (tmp_path / "runs" / "studies" / "ksweep" / "ksweep.md").read_text()
  assert (tmp_path / "runs" / "ksweep" / "petra_k2" / "metrics.jsonl").exists()
  assert studies.main(["ksweep", "--ks=2", "--width=4", "--batch-size=16", "--out=docs"]) == 0
  assert "`petra_k2`" in (tmp_path / "docs" / "ksweep.md").read_text()


def test_every_study_is_a_module_of_the_package():
  import importlib
  for name, (module, function) in studies.STUDIES.items():
    assert callable(getattr(importlib.import_module(f"petra_jax.studies.{module}"), function)), name


def test_depth_gaps_staleness_and_simulated_time_by_hand(monkeypatch, tmp_path):
  """Rows as data: the gap to the best revprop reference (same seeds), the delayed-versus-petra
  split, and the simulated time to the reference's accuracy from stage costs given here
  (every stage 3 ms per micro-batch, messages free: PETRA 3 k ms per update, GPipe and 1F1B
  recomputing 3 (k + J - 1) ms)."""
  from petra_jax.studies import depth, depth_time
  monkeypatch.setattr(depth_time, "message_bytes", lambda stages, *a, **kw: {
      key: [0] * len(stages) for key in ("forward", "stream_backward", "stored_backward")})
  accs = {("revprop", "adam"): [(10.0, 0.5), (20.0, 0.7)], ("revprop", "muon"): [(10.0, 0.6),
                                                                                 (20.0, 0.65)],
          ("petra", "adam"): [(10.0, 0.6), (20.0, 0.72)], ("delayed", "adam"): [(10.0, 0.5),
                                                                                (20.0, 0.68)]}

  def records(config):
    evals = accs[(config.method, config.optim.name)]
    out = _records([2.0, 1.0], evals, recon=(1e-3, 3e-3) if config.method == "petra" else ())
    for r, step in zip([r for r in out if "test_accuracy" in r], (100, 200)):
      r["step"] = step
    return out
  fake = FakeTrainer(records)
  work = tmp_path / "runs"
  work.mkdir()
  (work / "stage_ms_petra_J8_k2_adamw.json").write_text(json.dumps(
      {"stream": [[1.0] * 8, [2.0] * 7 + [3.0]], "stored": [[1.0] * 8, [2.0] * 7 + [3.0]]}))
  out = _run(monkeypatch, tmp_path, fake, [
      "depth", "--rows=revprop_adamw,revprop_muon,petra_J8_k2_adamw,delayed_J8_k2_adamw"])
  text = (out / "depth.md").read_text()
  rows = _table_rows(text)
  # Best reference: revprop_adamw (70.0 > 65.0). D_0 = 2 (8 - 1) / 2 = 7.
  assert rows[0][:8] == ["`revprop_adamw`", "1", "-", "0.00", "0", "70.0", "70.0", "-"]
  assert rows[2][:8] == ["`petra_J8_k2_adamw`", "8", "2", "7.00", "0", "72.0", "72.0", "-2.0"]
  assert rows[2][9] == "2.00e-03"
  assert rows[3][:8] == ["`delayed_J8_k2_adamw`", "8", "2", "7.00", "0", "68.0", "68.0", "+2.0"]
  staleness = [l for l in text.splitlines() if l.startswith("| 8 | 2 |")]
  assert [c.strip() for c in staleness[0].strip("|").split("|")] == [
      "8", "2", "adamw", "0", "+2.0", "-2.0", "-4.0", "2.00e-03"]
  # PETRA reaches 70 % (and the reference's final 70 %) at update 200, as the reference:
  # 200 * 6 ms = 1.2 s; GPipe and 1F1B recomputing 200 * 27 ms = 5.4 s; one evaluation an epoch.
  # (messages free: every link's table is the same)
  sim = {r[4]: r for r in rows if r[0] == "`petra_J8_k2_adamw`" and len(r) == 11}
  assert sim["PETRA"][1:] == ["0", "1 / 1", "`revprop_adamw` 70.0", "PETRA", "6.0", "1",
                              "never", "never", "never", "1"]
  for name in ("GPipe, recomputing", "1F1B, recomputing"):
    assert sim[name][5:] == ["27.0", "5", "never", "never", "never", "5"]
  configs = {c.method: c for c in fake.configs}
  assert tuple(configs["petra"].model.stage_sizes) == (2, 1, 1, 1, 1, 1, 1, 2)
  assert configs["petra"].accumulation_steps == 2 and configs["revprop"].model.depth == 4
  assert (out / "depth_accuracy.png").stat().st_size > 1000
  monkeypatch.setattr(studies.train, "train_and_evaluate", fake)
  assert studies.main(["depth", "--rows=petra_J5_k2_adamw", f"--out={tmp_path}"]) == 1
  assert depth.describe("delayed_J16_k4_muon_error_feedback") == {
      "J": 16, "k": 4, "method": "delayed", "optimizer": "muon_error_feedback", "depth": 8,
      "reference": False}


def test_depth_staleness_split_uses_only_the_seeds_both_methods_ran():
  """PETRA on seeds 0 and 1, its ``delayed`` twin on seed 0 only: the split is taken on seed 0
  (reference 80, delayed 77, PETRA 75: gaps +3.0 and +5.0, reconstruction's share +2.0),
  not on PETRA's mean over both seeds (70)."""
  from petra_jax.studies import depth

  def run(row, seed, acc, recon=()):
    return dict(depth.describe(row), row=row, seed=seed, test_accuracy=acc,
                records=_records([1.0], [(1.0, acc)], recon))
  results = [run("revprop_muon", 0, 0.80), run("revprop_muon", 1, 0.80),
             run("petra_J8_k4_muon_prediction", 0, 0.75, recon=(1e-3,)),
             run("petra_J8_k4_muon_prediction", 1, 0.65, recon=(5e-3,)),
             run("delayed_J8_k4_muon_prediction", 0, 0.77)]
  lines = depth.staleness_table(results)
  assert len(lines) == 3
  assert [c.strip() for c in lines[2].strip("|").split("|")] == [
      "8", "4", "muon_prediction", "0", "+3.0", "+5.0", "+2.0", "1.00e-03"]


def test_depth8_recipe_is_the_depth_study_row_and_keeps_the_default():
  """configs/cifar10_vit_cpu.py:depth8 is the study's row petra_J8_k4_muon_prediction; the
  recipe's default (its documented result) is unchanged: 4 stages, k = 8, gamma by run_max."""
  from petra_jax import config as config_lib
  from petra_jax.studies import depth, transformers
  from petra_jax.training import validation
  path = f"{REPO}/configs/cifar10_vit_cpu.py"
  row = transformers.recipe(path)
  config_lib.override(row, depth.ROWS["petra_J8_k4_muon_prediction"])
  variant = transformers.recipe(path + ":depth8")
  assert variant.to_json() == row.to_json()
  validation.validate_config(variant, 1)
  default = transformers.recipe(path)
  assert (tuple(default.model.stage_sizes), default.accumulation_steps,
          default.compensation.name, default.compensation.lookahead_rule) == (
              (3, 2, 2, 3), 8, "adam_lookahead", "run_max")


def test_language_model_means_gaps_and_delays_by_hand(monkeypatch, tmp_path):
  """Per row: J, k, stage 0's delay in updates D_0 = 2 (J - 1) / k, the probes behind its
  setting (13 knobs of the reference's, 5 of PETRA's), validation nats per character per seed;
  on validation, test and nanoGPT's validation text the mean, the mean gap to the reference
  (revprop, or a re-tuned one by --reference) over the same seeds and the spread (max - min)
  of the per-seed gaps."""
  from petra_jax.studies import language_model  # pylint: disable=g-import-not-at-top
  from petra_jax.training import evaluate  # pylint: disable=g-import-not-at-top
  val = {("revprop", 0): 1.80, ("revprop", 1): 1.90, ("petra", 0): 1.85, ("petra", 1): 2.00,
         ("delayed", 0): 1.70, ("backprop", 0): 1.75}
  test = {("revprop", 0): 1.90, ("revprop", 1): 2.00, ("petra", 0): 2.00, ("petra", 1): 2.06,
          ("delayed", 0): 1.81, ("backprop", 0): 1.95}
  nanogpt = {"revprop_s0": 1.70, "revprop_s1": 1.74, "petra_j8_k4_lookahead_own_s0": 1.72,
             "petra_j8_k4_lookahead_own_s1": 1.80, "delayed_j2_k1_s0": 1.76,
             "revprop_lr0.003_s0": 1.60, "revprop_lr0.003_s1": 1.70}

  def records(config):  # the reference at rate 3e-3: 0.1 lower on validation
    loss = val[(config.method, config.seed)] - 0.1 * (config.optim.learning_rate == 3e-3)
    return [{"step": 1, "epoch": 1.0, "train_loss": 3.0},
            {"step": 1, "epoch": 1.0, "val_loss": loss + 0.5, "wall_time": 5.0},
            {"step": 2, "epoch": 2.0, "val_loss": loss, "wall_time": 9.0},
            {"step": 2, "epoch": 2.0, "test_loss": test[(config.method, config.seed)],
             "test_accuracy": 0.0, "wall_time": 9.0}]

  def text_losses(workdir, texts, data_dir=None):
    """The checkpoint's scores by hand; backprop_gpt has no checkpoint."""
    assert texts == ["nanogpt_val"]  # validation and test come from metrics.jsonl
    if os.path.basename(workdir) not in nanogpt:
      raise evaluate.NoModelError("no checkpoint")
    return {"nanogpt_val": nanogpt[os.path.basename(workdir)]}
  fake = FakeTrainer(records)
  monkeypatch.setattr(studies.train, "train_and_evaluate", fake)
  monkeypatch.setattr(language_model.evaluate, "text_losses", text_losses)
  out = tmp_path / "docs"
  pages = {}
  for rows, seeds, reference in (
      ("revprop,petra_j8_k4_lookahead_own", "0,1", "revprop"),
      ("delayed_j2_k1,backprop_gpt", "0", "revprop"), ("revprop,delayed_j2_k1", "0", "revprop"),
      ("revprop_lr0.003,petra_j8_k4_lookahead_own", "0,1", "revprop_lr0.003")):
    assert studies.main(["language_model", f"--rows={rows}", f"--seeds={seeds}", f"--out={out}",
                         f"--workdir={tmp_path / 'runs'}", f"--reference={reference}"]) == 0
    pages[rows] = _table_rows((out / "language_model_study.md").read_text())
  # val. gaps 0.05, 0.10; test gaps 0.10, 0.06; nanoGPT val gaps 0.02, 0.06.
  assert pages["revprop,petra_j8_k4_lookahead_own"] == [
      ["`revprop`", "4", "4", "0", "13", "0, 1", "1.800, 1.900", "1.850", "ref.", "ref.",
       "1.950", "ref.", "ref.", "1.720", "ref.", "ref.", "9, 9"],
      ["`petra_j8_k4_lookahead_own`", "8", "4", "3.5", "5", "0, 1", "1.850, 2.000", "1.925",
       "+0.075", "0.050", "2.030", "+0.080", "0.040", "1.760", "+0.040", "0.040", "9, 9"]]
  # Against the re-tuned reference: val. gaps 0.15, 0.20; test as before; nanoGPT val 0.12, 0.10.
  assert pages["revprop_lr0.003,petra_j8_k4_lookahead_own"] == [
      ["`revprop_lr0.003`", "4", "4", "0", "13", "0, 1", "1.700, 1.800", "1.750", "ref.", "ref.",
       "1.950", "ref.", "ref.", "1.650", "ref.", "ref.", "9, 9"],
      ["`petra_j8_k4_lookahead_own`", "8", "4", "3.5", "5", "0, 1", "1.850, 2.000", "1.925",
       "+0.175", "0.050", "2.030", "+0.080", "0.040", "1.760", "+0.110", "0.020", "9, 9"]]
  # Without revprop in the page there is no gap to show; backprop_gpt was not scored.
  assert pages["delayed_j2_k1,backprop_gpt"] == [
      ["`delayed_j2_k1`", "2", "1", "2", "5", "0", "1.700", "1.700", "no reference",
       "no reference", "1.810", "no reference", "no reference", "1.760", "no reference",
       "no reference", "9"],
      ["`backprop_gpt`", "1", "1", "0", "-", "0", "1.750", "1.750", "no reference",
       "no reference", "1.950", "no reference", "no reference", "n/a", "n/a", "n/a", "9"]]
  # One seed: a gap, no spread.
  assert pages["revprop,delayed_j2_k1"][1] == [
      "`delayed_j2_k1`", "2", "1", "2", "5", "0", "1.700", "1.700", "-0.100", "one seed",
      "1.810", "-0.090", "one seed", "1.760", "+0.060", "one seed", "9"]
  assert "max - min of those per-seed gaps" in (out / "language_model_study.md").read_text()
  # The recipe (configs/shakespeare_cpu.py) with each row's fields: split, k, method, look-ahead.
  assert [(c.method, c.model.name, tuple(c.model.stage_sizes), c.accumulation_steps,
           c.compensation.name, c.seed) for c in fake.configs[:6]] == [
      ("revprop", "revgpt_nano", (3, 2, 2, 3), 4, "none", 0),
      ("revprop", "revgpt_nano", (3, 2, 2, 3), 4, "none", 1),
      ("petra", "revgpt_nano", (2, 1, 1, 1, 1, 1, 1, 2), 4, "adam_lookahead", 0),
      ("petra", "revgpt_nano", (2, 1, 1, 1, 1, 1, 1, 2), 4, "adam_lookahead", 1),
      ("delayed", "revgpt_nano", (5, 5), 1, "none", 0),
      ("backprop", "gpt_nano", (), 1, "none", 0)]
  assert fake.configs[2].compensation.lookahead_rule == "own_delay"
  assert (out / "language_model_study.png").stat().st_size > 1000


def test_depth_finished_only_reads_back_and_trains_nothing_else(monkeypatch, tmp_path):
  """--finished-only: a page from the (row, seed) runs with an evaluation at --epochs; a run
  stopped after epoch 1 of 2 and a run never started are skipped, not trained."""
  work = tmp_path / "runs"
  _write_metrics(work / "revprop_muon_s0", _records([2.0, 1.0], [(5.0, 0.5), (9.0, 0.6)]))
  _write_metrics(work / "revprop_muon_s1", _records([2.0, 1.0], [(5.0, 0.4)]))
  _write_metrics(work / "petra_J8_k2_muon_s0", _records([2.0, 1.0], [(5.0, 0.5), (9.0, 0.6)]))
  from petra_jax.studies import depth  # pylint: disable=g-import-not-at-top

  def no_measuring(*args, **kwargs):
    raise AssertionError("--finished-only measured stage costs")
  monkeypatch.setattr(depth.depth_time, "measure_stage_ms", no_measuring)
  fake = FakeTrainer(lambda config: _records([2.0, 1.0], [(5.0, 0.5), (9.0, 0.6)]))
  out = _run(monkeypatch, tmp_path, fake, ["depth", "--rows=revprop_muon,petra_J8_k2_muon",
                                           "--seeds=0,1,2", "--epochs=2", "--finished-only"])
  assert [(c.method, c.seed) for c in fake.configs] == [("revprop", 0), ("petra", 0)]
  text = (out / "depth.md").read_text()
  rows = _table_rows(text)
  assert [r[:7] for r in rows] == [["`revprop_muon`", "1", "-", "0.00", "0", "60.0", "60.0"],
                                   ["`petra_J8_k2_muon`", "8", "2", "7.00", "0", "60.0", "60.0"]]
  assert "No stage costs stored for `petra_J8_k2_muon`" in text
  monkeypatch.setattr(studies.train, "train_and_evaluate", fake)
  assert studies.main(["depth", "--rows=revprop_adamw", "--epochs=2", "--finished-only",
                       f"--workdir={work}", f"--out={tmp_path / 'x'}"]) == 1
  assert len(fake.configs) == 2


def test_references_get_at_least_as_many_probes_as_petra():
  # Issue 48: the references of each depth together get at least as many variants on the
  # tuning seed as PETRA's most-probed row set (8 stages, k = 4: one row per optimizer).
  from petra_jax.studies import depth
  petra_probes = sum(1 for r in depth.ROWS if r.startswith("petra_J8_k4_"))
  for deep in (False, True):
    probes = [r for r in depth.PROBED_REFERENCES if ("depth8" in r) == deep]
    assert len(probes) >= petra_probes, (deep, len(probes), petra_probes)
  row = depth.ROWS["revprop_muon_depth8_lr0.04"]
  assert row["optim.muon_learning_rate"] == 0.04 and row["model.depth"] == 8
  assert depth.describe("revprop_adamw_b2_0.99")["reference"]
  assert depth.ROWS["revprop_adamw_b2_0.99"]["optim.adam_b2"] == 0.99
  assert depth.ROWS["revprop_adamw_b2_0.99"]["optim.learning_rate"] == depth.REFERENCE_ADAMW_LR


def test_every_reference_probe_changes_its_reference():
  """A probe whose fields the recipe already has would train the reference again and count
  as a probe without being one (Muon's AdamW rate 1e-3 was the recipe's)."""
  from petra_jax.studies import common, depth

  class Args:
    recipe = os.path.join(REPO, "configs", "cifar10_vit_cpu.py")
    epochs, steps_per_epoch, data_dir = 1, 5, ""
  for name, fields in depth.PROBED_REFERENCES.items():
    base = next(r for r in depth.REFERENCES if name.startswith(r + "_")
                and name[len(r) + 1:] in depth.REFERENCE_PROBES[r.split("_")[1]])
    probe = common.row_config(Args, fields, 100).to_dict()
    assert probe != common.row_config(Args, depth.REFERENCES[base], 100).to_dict(), name
