"""Issue 6 through the shared trainer: BERT pretraining (MLM + SOP) at TP=2 gives the TP=1 losses."""

from __future__ import annotations

from pathlib import Path

import pytest

from repro.parallel.spawn import run_ranks
from repro.train.commands import train_rank
from bert_fixtures import bert_corpus, check_loss_parts, data_dir, data_mirror  # noqa: F401

ROOT = Path(__file__).resolve().parents[1]
TINY_BERT = str(ROOT / "experiments/bert/tiny_cpu.yaml")


def _run(world: int, prefix: str, run_dir: Path, data_dir: Path, **extra) -> list[float]:  # noqa: F811
    from repro.tracking.run_dir import read_metrics

    over = {"data.train_prefix": f"{prefix}_train", "data.valid_prefix": f"{prefix}_valid",
            "data.vocab_dir": str(data_dir), "data.cache_dir": str(run_dir / "cache"), "run_dir": str(run_dir),
            "tracking.enabled": "false", "train.train_iters": 10, "model.hidden_dropout": 0.0,
            "model.attention_dropout": 0.0, "model.seq_length": 64, **extra}
    run_ranks(train_rank, world, TINY_BERT, [f"{k}={v}" for k, v in over.items()], timeout=600)
    rows = read_metrics(run_dir)
    check_loss_parts(rows)  # 2 micro batches per step: the parts are averaged like the total
    return [row["loss"] for row in rows if "loss" in row]


@pytest.mark.parametrize("order", ["pre", "post"])
def test_bert_pretraining_tp2_matches_tp1(bert_corpus, data_dir, tmp_path, order):  # noqa: F811
    """fp32, dropout off, 10 steps: per-step MLM+SOP loss at TP=2 within 1e-5 relative of TP=1."""
    serial = _run(1, bert_corpus, tmp_path / "tp1", data_dir, **{"model.layernorm_order": order})
    tp2 = _run(2, bert_corpus, tmp_path / "tp2", data_dir, **{"model.layernorm_order": order, "parallel.tp": 2})
    assert len(serial) == len(tp2) == 10
    assert max(abs(a - b) / b for a, b in zip(tp2, serial)) < 1e-5
    assert serial[-1] < serial[0]
    _check_finetune_can_load(tmp_path / "tp1", tmp_path / "tp2")


def _check_finetune_can_load(tp1_run: Path, tp2_run: Path) -> None:
    """`repro finetune race --checkpoint RUN_DIR` reads trainer checkpoints of any TP degree: the
    TP=2 run's merged weights fit a serial BERT exactly as the trainer's own resharding loads them."""
    import torch

    from repro.models.bert import BERT
    from repro.models.bert_checkpoint import load_full_state_dict, read_bert
    from repro.parallel.groups import ProcessGroups
    from repro.train.reshard import load_model_for_eval

    cfg, two = read_bert(tp2_run)
    model = BERT(cfg)
    load_full_state_dict(model, two)  # strict: every name and shape fits
    reference = load_model_for_eval(tp2_run, ProcessGroups.single()).state_dict()
    assert all(torch.equal(t, reference[n]) for n, t in model.state_dict().items())
    assert read_bert(tp1_run)[0].layernorm_order == cfg.layernorm_order


def test_bert_half_params_tp2_follow_fp32(bert_corpus, data_dir, tmp_path):  # noqa: F811
    """bf16 parameters with fp32 masters (precision.params=half) at TP=2: the fp32 TP=1 losses to
    5e-3 nats (bf16 rounding; see tests/test_train_half_params.py for the tolerance)."""
    serial = _run(1, bert_corpus, tmp_path / "fp32", data_dir)
    half = _run(2, bert_corpus, tmp_path / "half", data_dir, **{"parallel.tp": 2, "precision.precision": "bf16",
                                                               "precision.params": "half"})
    assert len(half) == 10 and max(abs(a - b) for a, b in zip(half, serial)) < 5e-3, (serial, half)


def test_bert_half_params_dp2_equal_dp1(bert_corpus, data_dir, tmp_path):  # noqa: F811
    """bf16 BERT with fp32 main grads at DP=2 (one micro batch per rank) against DP=1 summing both:
    bit-identical per-step MLM+SOP losses, as for GPT (tests/test_train_main_grads.py)."""
    half = {"precision.precision": "bf16", "precision.params": "half"}
    dp1 = _run(1, bert_corpus, tmp_path / "dp1", data_dir, **half)
    dp2 = _run(2, bert_corpus, tmp_path / "dp2", data_dir, **half)
    assert len(dp1) == 10 and dp2 == dp1, (dp1, dp2)
