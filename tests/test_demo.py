"""`repro demo`'s context-free baselines, hand-computed on a 3-token vocab. (The whole pipeline is
tested in test_analysis_report.py, beside the other readers of the session's `cpu_results`.)"""

from __future__ import annotations

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
