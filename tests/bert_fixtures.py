"""Fixtures of the BERT trainer tests: WikiText-2 valid as BERT WordPiece samples, prepared once per session."""

from __future__ import annotations

from pathlib import Path

import pytest

from data_fixtures import data_dir, data_mirror  # noqa: F401  (pytest fixtures)


@pytest.fixture(scope="session")
def bert_corpus(tmp_path_factory, data_dir: Path) -> str:  # noqa: F811
    """Prefix of the prepared corpus (PREFIX_train, PREFIX_valid), one document per article."""
    from repro.data.filters import FilterOptions
    from repro.data.preprocess import PrepareOptions, prepare

    prefix = str(tmp_path_factory.mktemp("bert") / "wt2")
    prepare(PrepareOptions(input=data_dir / "wikitext" / "wikitext-2.valid.tokens", output_prefix=prefix,
                           tokenizer="bert", data_dir=data_dir, workers=1, split="95,5,0", progress=False,
                           filters=FilterOptions(min_tokens=0, dedup=False, eval_overlap=False)))
    return prefix


def check_loss_parts(rows: list[dict]) -> None:
    """Every per-step row of a BERT run's metrics.jsonl has finite `mlm_loss` and `sop_loss` that sum to
    its `loss` (BertObjective: total = MLM + SOP per micro batch, all three averaged alike)."""
    import math

    steps = [r for r in rows if "loss" in r]
    assert steps and all("mlm_loss" in r and "sop_loss" in r for r in steps), steps[:1]
    for r in steps:
        assert math.isfinite(r["mlm_loss"]) and math.isfinite(r["sop_loss"]), r
        assert abs(r["mlm_loss"] + r["sop_loss"] - r["loss"]) <= 1e-5 * r["loss"], r
