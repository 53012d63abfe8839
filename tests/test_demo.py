"""`repro demo`: its context-free baselines (hand-computed on a 3-token vocab) and the whole pipeline."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from repro.data.documents import is_wikitext_title
from repro.data.indexed_dataset import IndexedDatasetWriter
from repro.demo import unigram_baselines
from repro.eval.detokenize import wikitext_detokenize
from results_fixtures import SMOKE_TIMEOUT_S


def _write(prefix, tokens):
    with IndexedDatasetWriter(prefix, dtype=np.uint16) as w:
        w.add_document([np.array(tokens, dtype=np.uint16)])


def test_unigram_baselines_by_hand(tmp_path):
    _write(tmp_path / "train", [0, 0, 1, 1])  # p = (1/2, 1/2, 0)
    _write(tmp_path / "valid", [0, 2])
    entropy, held_out = unigram_baselines(str(tmp_path / "train"), str(tmp_path / "valid"), vocab_size=3)
    assert math.isclose(entropy, math.log(2))
    smoothed = np.array([3, 3, 1]) / 7  # add-one: (count + 1) / (4 + 3)
    assert math.isclose(held_out, -(math.log(smoothed[0]) + math.log(smoothed[2])) / 2)


@pytest.mark.timeout(SMOKE_TIMEOUT_S + 60)  # it may be the first to ask for the session's `cpu_results`
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
