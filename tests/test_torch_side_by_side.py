"""``torch_side_by_side --model=gpt_nano``: flags, arithmetic, shapes and our side (no torch)."""

import functools
import math

import pytest

from petra_jax.benchmarks import torch_side_by_side as sbs


def test_the_parser_takes_the_model_and_its_defaults():
  gpt = sbs.parse_args(["--model=gpt_nano"])
  assert (gpt.model, gpt.batch_size, gpt.iters, gpt.petra_repo) == ("gpt_nano", 12, 20, None)
  revnet = sbs.parse_args(["--petra-repo=/x"])
  assert (revnet.model, revnet.batch_size, revnet.iters) == ("revnet18", 64, 5)
  assert sbs.parse_args(["--model=gpt_nano", "--batch-size=3", "--iters=2"]).batch_size == 3
  with pytest.raises(SystemExit):
    sbs.parse_args(["--model=gpt_huge"])


def test_gpt_mode_needs_no_authors_export_but_revnet_mode_does():
  with pytest.raises(SystemExit, match="--torch-python is required"):
    sbs.main(["--model=gpt_nano"])
  with pytest.raises(SystemExit, match="--petra-repo is required with --model=revnet18"):
    sbs.main(["--torch-python=python3"])


def test_gpt_brackets_have_the_backprop_ratios_by_hand():
  theirs = [{"ms_per_step": {"backprop": b}} for b in (40.0, 60.0, 20.0)]
  ours = [{"ms_per_step": {"backprop": 45.0, "petra": 54.0}},
          {"ms_per_step": {"backprop": 30.0, "petra": 42.0}}]
  rows = sbs.brackets(theirs, ours)
  assert set(rows[0]) - {"theirs_before", "ours", "theirs_after"} == {
      "ratio_backprop_ours_theirs", "ratio_petra_backprop_ours"}
  assert rows[0]["ratio_backprop_ours_theirs"] == pytest.approx(45 / 50)
  assert rows[1]["ratio_backprop_ours_theirs"] == pytest.approx(30 / 40)
  assert rows[1]["ratio_petra_backprop_ours"] == pytest.approx(42 / 30)
  assert sbs.summary(rows) == pytest.approx({
      "ratio_backprop_ours_theirs": (0.9 + 0.75) / 2, "ratio_petra_backprop_ours": (1.2 + 1.4) / 2})
  medians = sbs.run_medians(theirs, ours)
  assert medians == pytest.approx({"theirs_backprop": 40.0, "ours_backprop": 37.5,
                                   "ours_petra": 48.0})
  assert sbs.tokens_per_second({"a": 48.0}, 12 * 64) == pytest.approx({"a": 768 / 0.048})


def test_gpt_shapes_are_nanogpts_cpu_model_and_the_parameters_its_layout():
  shapes = sbs.gpt_shapes()
  assert shapes == {"layers": 4, "heads": 4, "dim": 128, "context": 64, "vocab": 65}
  L, D, T, V = 4, 128, 64, 65
  block = (2 * 2 * D               # two LayerNorms
           + 3 * D * D + 3 * D     # q, k, v
           + D * D + D             # attention output
           + D * 4 * D + 4 * D     # MLP in
           + 4 * D * D + D)        # MLP out
  assert block == 12 * D * D + 13 * D
  nanogpt_untied = V * D + T * D + L * block + 2 * D + D * V + V  # head with a bias, untied
  assert sbs.gpt_params()["backprop"] == nanogpt_untied == 818241


def test_gpt_torch_command_passes_the_shapes(monkeypatch):
  monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
  args = sbs.parse_args(["--model=gpt_nano", "--torch-python=py", "--threads=3"])
  command, env = sbs._gpt_command(args)
  assert command[0] == "py" and command[1].endswith("torch_side_by_side/gpt.py")
  assert set(command[2:]) == {"--layers=4", "--heads=4", "--dim=128", "--context=64",
                              "--vocab=65", "--batch-size=12", "--iters=20", "--warmup=1",
                              "--threads=3"}
  assert env["OMP_WAIT_POLICY"] == "PASSIVE"
  monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
  assert sbs._gpt_command(args)[1]["OMP_WAIT_POLICY"] == "ACTIVE"


def test_gpt_report_refuses_a_torch_model_of_another_size():
  args = sbs.parse_args(["--model=gpt_nano"])
  theirs = [{"ms_per_step": {"backprop": 1.0}, "params": 5, "torch": "t"}]
  with pytest.raises(SystemExit, match="the torch decoder has 5 parameters"):
    sbs._gpt_report(args, theirs, [{"ms_per_step": {"backprop": 1.0}, "jax": "j"}])


def test_the_torch_worker_imports_without_torch():
  from petra_jax.benchmarks.torch_side_by_side import gpt as torch_gpt
  a = torch_gpt._parser().parse_args(["--layers=1", "--heads=2", "--dim=8", "--context=4",
                                      "--vocab=5", "--batch-size=2"])
  assert (a.layers, a.batch_size, a.iters, a.threads) == (1, 2, 5, 2)


def test_our_gpt_side_runs_one_step_at_a_tiny_size(monkeypatch):
  from petra_jax.benchmarks import cli
  monkeypatch.setattr(sbs, "GPT_WIDTH", 2)  # 4 heads x 2 = 8 features
  # One layer (embedding, attention, MLP, head), PETRA in 4 stages of one block each.
  monkeypatch.setattr(cli, "build", functools.partial(cli.build, depth=1))
  monkeypatch.setattr(sbs, "GPT_STAGE_SIZES", (1, 1, 1, 1))
  args = sbs.parse_args(["--model=gpt_nano", "--batch-size=2", "--iters=1", "--warmup=0"])
  ms = sbs._ours_gpt(args)["ms_per_step"]
  assert set(ms) == {"backprop", "petra"}
  assert all(math.isfinite(v) and v > 0 for v in ms.values())
