"""Issue 8, end to end: `make results` (scripts/cpu_results.sh) at smoke length fills a fresh MLflow
store with real tiny CPU runs of every family (the demo, scaling at TP=1, TP=2 and DP=2, a GPT with its
zero-shot evaluations, a BERT pretrained then fine-tuned on RACE, the Fig. 7 pair), and `repro report`
executes every notebook and writes the tables and figures, measured CPU numbers labelled as such.
Every reader of the session's `cpu_results` lives in this module: `make test` runs pytest-xdist
with --dist loadscope, which builds a session fixture once per worker that asks for it."""

from __future__ import annotations

import json
import math
import subprocess

import pytest

from repro.data.documents import is_wikitext_title
from repro.eval.detokenize import wikitext_detokenize
from results_fixtures import SCRIPT, SMOKE_TIMEOUT_S

# the first test to ask for the session's `cpu_results` waits for the whole script
pytestmark = pytest.mark.timeout(SMOKE_TIMEOUT_S + 60)

FIGURES = ("fig_scaling.png", "fig6_valid_ppl.png", "fig7_layernorm_order.png", "bert_fig7_layernorm_order_cpu.png")
TABLES = ("scaling_table", "scaling_appendix_d", "scaling_baseline", "zero_shot_table", "gpt2_table2", "bert_table")


def test_make_results_runs_every_family_and_reports_them(cpu_results):
    out, printed = cpu_results.out, cpu_results.stdout
    for name in TABLES:
        assert (out / f"{name}.csv").exists() and (out / f"{name}.md").exists(), name
    for fig in FIGURES:
        assert (out / fig).stat().st_size > 10_000, fig  # a drawn figure, not an empty canvas
    assert "# Weak scaling" in printed and "# Zero-shot evaluation" in printed and "# BERT" in printed
    assert "store sqlite:///" in printed


def test_the_scaling_rows_are_the_three_cpu_layouts(cpu_results):
    scaling = (cpu_results.out / "scaling_table.md").read_text()
    cpu_rows = [ln for ln in scaling.splitlines() if "CPU, reduced size (not a paper config)" in ln]
    assert [ln.split(" | ")[3] for ln in cpu_rows] == ["1 x 1", "1 x 2", "2 x 1"]
    assert "100.0%" in cpu_rows[0] and all("device=cpu; world=2; precision=fp32" in ln for ln in cpu_rows[1:])
    assert scaling.count("not run") >= 8 * 3  # no paper config was run here


def test_zero_shot_and_training_time_rows_name_their_reduced_protocol(cpu_results):
    zero = (cpu_results.out / "zero_shot_table.md").read_text()
    rows = {ln.split(" | ")[0]: ln for ln in zero.splitlines() if ln.startswith(("| tiny-gpt |", "| gpt-demo |"))}
    assert set(rows) == {"| tiny-gpt", "| gpt-demo"}
    assert "reduced: window=64, stride=32" in rows["| tiny-gpt"] and "window=128" in rows["| gpt-demo"]
    assert all("CPU, reduced size" in ln and "first 64 passages only" in ln for ln in rows.values())
    assert "| gpt2-8.3b | 10.81 | not run | 66.51 | not run |" in zero
    table2 = [ln for ln in (cpu_results.out / "gpt2_table2.md").read_text().splitlines() if "CPU, reduced size" in ln]
    assert sorted(ln.split(" | ")[3] for ln in table2) == ["1", "2"]  # tiny GPT on 1 rank, the demo on 2


def test_the_bert_row_is_fine_tuned_from_the_pretrained_tiny_bert(cpu_results):
    bert = (cpu_results.out / "bert_table.md").read_text()
    assert "| bert-336m | 86.9 | not run |" in bert
    row = next(ln for ln in bert.splitlines() if ln.startswith("| bert-tiny-cpu |"))
    assert "random init" not in row and "MLM val ppl: run" in row and "seeds 1 2 3" in row
    assert float(row.split(" | ")[8].replace(",", "")) > 1.0  # the pretraining run's held-out MLM perplexity
    assert "| bert-3.9b-ensemble | 93.1 | not run |" in bert
    together = next(ln for ln in bert.splitlines() if ln.startswith("| bert-tiny-cpu-ensemble |"))
    assert "3-way ensemble of its seeds' models" in together and "seeds 1 2 3" in together


def test_cpu_results_script_refuses_a_store_that_already_holds_runs(tmp_path):
    """scripts/cpu_results.sh picks runs by recency, so it starts only on a new store: an existing one
    is named in the error and left as it was, and nothing is run."""
    store = tmp_path / "store"
    store.mkdir()
    (store / "mlflow.db").write_bytes(b"earlier runs")
    out = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True,
                         env={"PATH": "/usr/bin:/bin", "STORE_DIR": str(store), "OUT": str(tmp_path / "out")})
    assert out.returncode == 2 and f"{store}/mlflow.db already exists" in out.stderr
    assert "set STORE_DIR to a new directory" in out.stderr
    assert (store / "mlflow.db").read_bytes() == b"earlier runs" and not (tmp_path / "out").exists()


def test_demo_smoke_runs_the_whole_pipeline(cpu_results):
    """`repro demo --smoke` (what `make demo` runs, shortened; here the first step of `make results`
    at smoke length): fetch, prepare, TP=2 training on 2 processes, both zero-shot evaluations and the
    baseline summary, into the given directories."""
    out, data_dir, run_dir = cpu_results, cpu_results.data_dir, cpu_results.demo_run
    assert "held-out loss" in out.stdout and "a unigram model on the same held-out text" in out.stdout
    assert "=== sample 1/1 (" in out.stdout and "The first season of the series" in out.stdout
    final = json.loads((run_dir / "final_metrics.json").read_text())
    assert final["iteration"] == 2 and math.isfinite(final["valid_loss"])
    records = {r["task"]: r for r in map(json.loads, (run_dir / "zero_shot.jsonl").read_text().splitlines())}
    assert records["lambada"]["params"]["max_examples"] == 64 and records["lambada"]["metrics"]["num_examples"] == 64
    assert records["wikitext"]["params"]["max_lines"] == 40 and records["wikitext"]["params"]["window"] == 128
    assert {records[t]["training_run_id"] for t in records} == {(run_dir / "mlflow_run_id").read_text()}
    assert (data_dir / "wt2_gpt_train.idx").is_file() and (data_dir / "wt2_gpt_valid.idx").is_file()
    # the training text went through the evaluation's detokenizer; titles (document boundaries) did not
    source = (data_dir / "wikitext" / "wikitext-2.valid.tokens").read_text(encoding="utf-8").splitlines(keepends=True)
    copied = (data_dir / "wt2_valid_detok.txt").read_text(encoding="utf-8").splitlines(keepends=True)
    assert len(copied) == len(source)
    titles = [i for i, line in enumerate(source) if is_wikitext_title(line)]
    assert len(titles) > 50 and all(copied[i] == source[i] for i in titles)
    body = next(i for i, line in enumerate(source) if " @-@ " in line and not is_wikitext_title(line))
    assert copied[body] == wikitext_detokenize(source[body]) != source[body]
