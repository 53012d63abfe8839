"""`python -m repro.perf.precision_study`: four real training runs, one per precision recipe."""

from __future__ import annotations

import pandas as pd

from repro.perf.precision_study import RECIPES, main
from train_fixtures import corpus, data_dir, data_mirror  # noqa: F401


def test_precision_study_writes_curves_and_table(corpus, tmp_path):  # noqa: F811
    prefix = corpus["train"].removesuffix("_train")
    assert main(["--out", str(tmp_path), "--data-prefix", prefix, "--iters", "3",
                 "--runs-dir", str(tmp_path / "runs")]) == 0
    losses = pd.read_csv(tmp_path / "losses.csv")
    assert sorted(losses["recipe"].unique()) == sorted(RECIPES) and len(losses) == 3 * len(RECIPES)
    wide = losses.pivot(index="step", columns="recipe", values="loss")
    assert (wide.sub(wide["fp32"], axis=0).abs().max() < 5e-3).all(), wide  # bf16 recipes track fp32
    assert len(set(wide.iloc[-1])) > 1  # the recipes really ran differently
    table = (tmp_path / "table.md").read_text()
    assert all(f"| {name} |" in table for name in RECIPES)
    assert (tmp_path / "curves.png").read_bytes()[:4] == b"\x89PNG"
    studies = list((tmp_path / "runs").glob("study-*"))  # its own folder: a rerun never reuses finished runs
    assert len(studies) == 1 and sorted(p.name for p in studies[0].glob("recipe*")) == [f"recipe{i}" for i in range(4)]


def test_precision_study_refuses_a_run_shorter_than_the_warmup(corpus, tmp_path, capsys):  # noqa: F811
    prefix = corpus["train"].removesuffix("_train")
    assert main(["--out", str(tmp_path / "out"), "--data-prefix", prefix, "--iters", "2"]) == 2
    assert "warms up for 2 iterations" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_precision_study_names_missing_data(tmp_path, capsys):
    assert main(["--out", str(tmp_path / "out"), "--data-prefix", str(tmp_path / "nothing")]) == 2
    assert "make demo" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
