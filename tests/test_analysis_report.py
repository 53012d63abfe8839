"""Issue 8, end to end: real tiny CPU runs (scaling at TP=1 and TP=2, a GPT with its zero-shot
evaluation, a tiny BERT on RACE) in a fresh MLflow store; `repro report` executes every notebook
and writes the tables and figures, measured CPU numbers labelled as such."""

from __future__ import annotations

from pathlib import Path

import pytest

from repro.parallel.spawn import run_ranks
from repro.train.commands import train_rank
from train_fixtures import corpus, data_dir, data_mirror, tiny_overrides  # noqa: F401

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "experiments/tiny/gpt_tiny.yaml")
FIGURES = ("fig_scaling.png", "fig6_valid_ppl.png", "fig7_layernorm_order.png")
TABLES = ("scaling_table", "scaling_baseline", "zero_shot_table", "bert_table")


def _train(world: int, corpus, run_dir: Path, **extra) -> dict:
    sets = {"tracking.enabled": "true", "train.train_iters": 10, "train.log_interval": 5, **extra}
    return run_ranks(train_rank, world, TINY, tiny_overrides(corpus, run_dir, **sets), timeout=300)[0]


@pytest.fixture(scope="module")
def store(tmp_path_factory, corpus, data_dir):  # noqa: F811
    """A fresh store with the runs the notebooks read (about a minute on 2 shared cores)."""
    from repro.cli import main

    base = tmp_path_factory.mktemp("report")
    uri = f"sqlite:///{base / 'mlflow.db'}"
    mp = pytest.MonkeyPatch()
    mp.setenv("MLFLOW_TRACKING_URI", uri)
    ref = "Table 1 layout check at CPU size"
    _train(1, corpus, base / "tp1", **{"tracking.experiment": "scaling", "tracking.paper_ref": ref, "name": "tiny-tp1"})
    _train(2, corpus, base / "tp2", **{"tracking.experiment": "scaling", "tracking.paper_ref": ref, "name": "tiny-tp2",
                                       "parallel.tp": 2})
    _train(1, corpus, base / "gpt", **{"tracking.experiment": "gpt2", "train.eval_interval": 5, "name": "tiny-gpt"})
    ckpt = str(base / "gpt" / "checkpoints")
    assert main(["eval", "wikitext", "--checkpoint", ckpt, "--data-dir", str(data_dir), "--window", "64",
                 "--stride", "32", "--max-lines", "40"]) == 0
    assert main(["eval", "lambada", "--checkpoint", ckpt, "--data-dir", str(data_dir), "--batch-size", "32"]) == 0
    assert main(["finetune", "race", "--race-dir", str(ROOT / "tests/fixtures/race"), "--data-dir", str(data_dir),
                 "--model-config", str(ROOT / "experiments/bert/tiny_cpu.yaml"), "--size", "bert-tiny-cpu",
                 "--epochs", "1", "--batch-size", "5", "--seq-length", "64", "--run-dir", str(base / "race")]) == 0
    yield uri, base
    mp.undo()


def test_report_executes_every_notebook_on_tiny_cpu_runs(store, capsys):
    from repro.cli import main

    uri, base = store
    out = base / "results"
    assert main(["report", "--tracking-uri", uri, "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    for name in TABLES:
        assert (out / f"{name}.csv").exists() and (out / f"{name}.md").exists(), name
    for fig in FIGURES:
        assert (out / fig).stat().st_size > 10_000, fig  # a drawn figure, not an empty canvas
    assert "# Weak scaling" in printed and "# Zero-shot evaluation" in printed and "# BERT" in printed

    scaling = (out / "scaling_table.md").read_text()
    cpu_rows = [ln for ln in scaling.splitlines() if "CPU, reduced size (not a paper config)" in ln]
    assert len(cpu_rows) == 2 and "| 1 x 1 |" in cpu_rows[0] and "| 2 x 1 |" in cpu_rows[1]
    assert "100.0%" in cpu_rows[0] and "device=cpu; world=2; precision=fp32" in cpu_rows[1]
    assert scaling.count("not run") >= 8 * 3  # no paper config was run here

    zero = (out / "zero_shot_table.md").read_text()
    tiny = [ln for ln in zero.splitlines() if ln.startswith("| tiny-gpt |")]
    assert len(tiny) == 1 and "CPU, reduced size" in tiny[0] and "reduced: window=64" in tiny[0]
    assert "| gpt2-8.3b | 10.81 | not run | 66.51 | not run |" in zero

    bert = (out / "bert_table.md").read_text()
    assert "| bert-336m | 86.9 | not run |" in bert
    assert any(ln.startswith("| bert-tiny-cpu |") and "random init" in ln for ln in bert.splitlines())


def test_cpu_results_script_refuses_a_store_that_already_holds_runs(tmp_path):
    """scripts/cpu_results.sh (`make results`) picks runs by recency, so it starts only on a new store:
    an existing one is named in the error and left as it was, and nothing is run."""
    import subprocess

    store = tmp_path / "store"
    store.mkdir()
    (store / "mlflow.db").write_bytes(b"earlier runs")
    out = subprocess.run(["bash", str(ROOT / "scripts/cpu_results.sh")], capture_output=True, text=True,
                         env={"PATH": "/usr/bin:/bin", "STORE_DIR": str(store), "OUT": str(tmp_path / "out")})
    assert out.returncode == 2 and f"{store}/mlflow.db already exists" in out.stderr
    assert "set STORE_DIR to a new directory" in out.stderr
    assert (store / "mlflow.db").read_bytes() == b"earlier runs" and not (tmp_path / "out").exists()
