"""The trainer's RNG wiring (paper Appendix B.2): build_engine seeds the default generator identically
on every rank, so replicated activations (embedding and residual dropout) drop the same elements on
every TP rank, as serially; and gives each TP rank its own TP-region stream (attention dropout over
its own heads), the same on every DP replica of that TP rank, as Megatron's model-parallel seed."""

from __future__ import annotations

from pathlib import Path

import torch

from repro.parallel.spawn import run_ranks

TINY = str(Path(__file__).resolve().parents[1] / "experiments/tiny/gpt_tiny.yaml")


def _engine_streams(tp: int) -> dict:
    """This rank's layout and its two RNG streams right after the engine the trainer builds
    (repro.train.loop.train calls build_engine so), and a TP-region dropout mask drawn from it."""
    import torch.distributed as dist

    from repro.parallel.groups import ParallelDims, build_process_groups
    from repro.train.config import derive, load_config
    from repro.train.engine import build_engine

    cfg = load_config(TINY, [f"parallel.tp={tp}", "train.micro_batch_size=2", "model.attention_dropout=0.1"])
    pg = build_process_groups(ParallelDims.from_world(tp, dist.get_world_size()))
    eng = build_engine(cfg, derive(cfg, pg.dims.world_size), pg)
    default, region = torch.get_rng_state(), eng.rng.get_state()
    with eng.rng.fork():
        mask = torch.nn.functional.dropout(torch.ones(256), 0.5) > 0
    assert torch.equal(torch.get_rng_state(), default)  # the fork gives the default stream back untouched
    return {"tp_rank": pg.tp_rank, "dp_rank": pg.dp_rank, "default": default, "region": region, "mask": mask}


def test_tp_ranks_share_the_default_stream_and_own_their_tp_region_stream():
    """TP=2 x DP=2 (4 gloo ranks): the default generator's state is the same on all 4 ranks and equals
    a serial (1-rank) engine's, so TP training drops what serial training drops; the TP-region states
    differ between TP ranks (and so do masks drawn from them), are equal between the DP replicas of a
    TP rank, and differ from the default stream."""
    serial = run_ranks(_engine_streams, 1, 1)[0]["default"]
    ranks = run_ranks(_engine_streams, 4, 2, timeout=300)
    assert sorted((r["tp_rank"], r["dp_rank"]) for r in ranks) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert all(torch.equal(r["default"], serial) for r in ranks)
    by_tp = {tp: [r for r in ranks if r["tp_rank"] == tp] for tp in (0, 1)}
    for replicas in by_tp.values():  # same tp_rank, other dp_rank: the same model-parallel stream
        assert torch.equal(replicas[0]["region"], replicas[1]["region"])
        assert torch.equal(replicas[0]["mask"], replicas[1]["mask"])
    assert not torch.equal(by_tp[0][0]["region"], by_tp[1][0]["region"])
    assert not torch.equal(by_tp[0][0]["mask"], by_tp[1][0]["mask"])
    assert not any(torch.equal(r["region"], serial) for r in ranks)
