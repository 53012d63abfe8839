"""`repro demo`'s context-free baselines, hand-computed on a 3-token vocab. (The whole pipeline is
tested in test_analysis_report.py, beside the other readers of the session's `cpu_results`.)"""

from __future__ import annotations

import argparse
import math

import numpy as np

from repro.data.indexed_dataset import IndexedDatasetWriter
from repro.demo import unigram_baselines


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


def test_relative_run_and_data_dirs_are_the_callers_not_the_steps_cwd(tmp_path, monkeypatch):
    """The steps run in the repository root; a relative --run-dir or REPRO_DATA_DIR given elsewhere
    used to train into <repo>/RUN_DIR, then fail reading ./RUN_DIR/final_metrics.json (a traceback)."""
    import repro.demo as demo

    steps, summaries = [], []
    monkeypatch.setattr(demo, "_step", lambda title, *args: steps.append(args))
    monkeypatch.setattr(demo, "_summary", lambda run_dir, prefix: summaries.append((run_dir, prefix)))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("REPRO_DATA_DIR", "d")
    (tmp_path / "d").mkdir()
    for split in ("train", "valid"):  # prepared already: no detokenized copy, no prepare step
        _write(tmp_path / "d" / f"wt2_gpt_{split}", [0, 1])
    demo._run(argparse.Namespace(run_dir="rel", iters=None, smoke=True))
    assert summaries == [(tmp_path / "rel", str(tmp_path / "d" / "wt2_gpt"))]
    assert all(step[step.index("--data-dir") + 1] == str(tmp_path / "d") for step in steps if step[0] != "train")
    train = next(step for step in steps if step[0] == "train")
    assert f"run_dir={tmp_path / 'rel'}" in train and f"data.train_prefix={tmp_path / 'd' / 'wt2_gpt'}_train" in train
    assert all(step[step.index("--checkpoint") + 1] == str(tmp_path / "rel") for step in steps if "--checkpoint" in step)


def test_iters_below_one_is_refused_before_any_step(monkeypatch, capsys):
    """--iters 0 used to fetch and prepare the data (minutes) before training refused it."""
    import repro.demo as demo

    from repro.cli import main

    steps = []
    monkeypatch.setattr(demo, "_step", lambda title, *args: steps.append(args))
    assert main(["demo", "--iters", "0"]) == 2
    err = capsys.readouterr().err
    assert "--iters 0 trains nothing" in err and "Fix:" in err and steps == []
