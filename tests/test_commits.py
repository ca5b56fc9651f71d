"""The side-by-side comparison of two commits' step times (benchmarks.commits)."""

import pytest

from petra_jax.benchmarks import commits


def test_change_is_of_the_medians():
  runs = {"old": [{"backprop": 100.0, "revprop": 10.0, "petra": 50.0},
                  {"backprop": 300.0, "revprop": 30.0, "petra": 70.0}],
          "new": [{"backprop": 220.0, "revprop": 20.0, "petra": 60.0},
                  {"backprop": 220.0, "revprop": 20.0, "petra": 60.0}]}
  rows = {r["method"]: r for r in commits.compare(runs)}
  assert rows["backprop"]["change_pct"] == pytest.approx(10.0)  # 220 against (100 + 300) / 2
  assert rows["revprop"]["change_pct"] == pytest.approx(0.0)
  assert rows["petra"]["old"] == [50.0, 70.0] and rows["petra"]["change_pct"] == pytest.approx(0.0)


def test_the_first_run_of_a_pair_alternates():
  assert commits.order(["old", "new"], 4) == ["old", "new", "new", "old"] * 2
  assert commits.order(["old", "new"], 1) == ["old", "new"]


def test_a_commit_against_itself_keeps_two_runs():
  assert commits.labels("abc", "abc") == ("abc", "abc@2")
  assert commits.labels("abc", "def") == ("abc", "def")
