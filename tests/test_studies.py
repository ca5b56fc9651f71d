"""The small-scale study commands write their table and figure."""

from petra_jax import studies


def test_ksweep_writes_markdown_and_png(cifar10_dir, tmp_path):
  out, work = tmp_path / "docs", tmp_path / "runs"
  rc = studies.main(["ksweep", "--ks=2", "--width=4", "--batch-size=16", "--steps-per-epoch=4",
                     "--log-every=1", f"--data-dir={cifar10_dir}", f"--out={out}",
                     f"--workdir={work}"])
  assert rc == 0
  text = (out / "ksweep.md").read_text()
  assert "| `backprop` | 1 | 16 |" in text and "| `petra_k2` | 2 | 8 |" in text
  assert "python -m petra_jax.studies ksweep --ks=2 --width=4" in text
  assert (out / "ksweep.png").stat().st_size > 1000
  assert (work / "petra_k2" / "metrics.jsonl").exists()


def test_unknown_study_is_rejected(capsys):
  try:
    studies.main(["table5"])
  except SystemExit as e:
    assert e.code != 0
  assert "invalid choice" in capsys.readouterr().err
