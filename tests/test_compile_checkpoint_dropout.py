"""torch.compile with activation checkpointing and attention dropout (the paper configs' recipe).

Under compile, the checkpoint used to drop the context_fn that replays the TP-region RNG tracker, so
the backward's recompute drew other attention-dropout masks than the forward: the gradient was not the
derivative of the loss the forward computed. Checked by a directional finite difference in float64,
with both RNG streams reset before each evaluation; central differences at eps 1e-6 agree with a
correct gradient to ~1e-7 relative, a wrong mask is off by O(1). Also: `repro selftest` keeps a NaN
from any rank."""

from __future__ import annotations

import math

import pytest
import torch

from repro.models.config import ModelConfig
from repro.models.gpt import GPT
from repro.parallel.random import RNGTracker
from repro.parallel.selftest import merge
from repro.train.engine import compiled

CFG = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=2, seq_length=8, vocab_size=64,
                  hidden_dropout=0.1, attention_dropout=0.1, activation_checkpointing=True)


def directional_check(scope: str, cfg: ModelConfig = CFG, pg=None) -> tuple[float, float]:
    """(grad . d, finite difference of the loss along d) for one compile scope, serial or on this
    rank of `pg` (TP: each rank's shards move along their own direction, summed over the TP group)."""
    import torch.distributed as dist

    from repro.parallel.layers import is_tensor_parallel

    torch._dynamo.reset()
    tp_group, tp_rank = (pg.tp_group, pg.tp_rank) if pg is not None else (None, 0)
    ids = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length), generator=torch.Generator().manual_seed(0))
    model = GPT(cfg, tp_group, rng=RNGTracker(1, tp_rank), seed=3).double().train()
    run = model if scope == "eager" else compiled(model, model, scope)
    tracker_state = model.rng.get_state()

    def loss() -> torch.Tensor:
        torch.manual_seed(12)
        model.rng.set_state(tracker_state)
        return run(ids, ids).mean()

    loss().backward()
    params = list(model.parameters())
    gen, shard_gen = torch.Generator().manual_seed(1), torch.Generator().manual_seed(100 + tp_rank)
    direction = [torch.randn(p.shape, generator=shard_gen if is_tensor_parallel(p) else gen, dtype=p.dtype)
                 for p in params]
    sharded = sum((p.grad * d).sum() for p, d in zip(params, direction) if is_tensor_parallel(p))
    along = torch.as_tensor(sharded, dtype=torch.float64)
    if tp_group is not None:
        dist.all_reduce(along, group=tp_group)
    along = along.item() + sum((p.grad * d).sum() for p, d in zip(params, direction) if not is_tensor_parallel(p)).item()
    eps = 1e-6
    with torch.no_grad():
        for p, d in zip(params, direction):
            p.add_(eps * d)
        plus = loss().item()
        for p, d in zip(params, direction):
            p.sub_(2 * eps * d)
        minus = loss().item()
    return along, (plus - minus) / (2 * eps)


@pytest.mark.parametrize("scope", ["objective", "blocks"])
def test_compiled_checkpointed_gradient_is_the_forwards_derivative(scope):
    along, finite_difference = directional_check(scope)
    assert along == pytest.approx(finite_difference, rel=1e-5)


def _directional_check_tp2(scope: str) -> tuple[float, float]:
    from repro.parallel.groups import ParallelDims, build_process_groups

    return directional_check(scope, pg=build_process_groups(ParallelDims.from_world(2, 2)))


@pytest.mark.parametrize("scope", ["objective", "blocks"])
def test_at_tp2_the_trackers_eager_checkpoint_replays_the_masks_under_compile(scope):
    """At TP > 1 attention dropout forks the TP-region tracker, whose checkpoint runs eagerly: the
    compiled gradient (summed over both ranks' shards) is still the forward's derivative."""
    from repro.parallel.spawn import run_ranks

    for along, finite_difference in run_ranks(_directional_check_tp2, 2, scope, timeout=300):
        assert along == pytest.approx(finite_difference, rel=1e-5)


@pytest.mark.parametrize("family", ["gpt", "bert"])
def test_at_tp1_attention_dropout_keeps_the_compiled_step_one_graph(family):
    """One TP rank has no TP-region stream to tell apart: attention dropout draws from the default stream,
    so dynamo traces every layer, checkpointed or not, into one graph. (The tracker's fork cut the graph
    twice a layer: 7 breaks for 3 layers; compiled, that step took 1.26x the time of the unbroken one,
    4-layer h=128 GPT on one CPU thread, 2026-12-07.)"""
    from dataclasses import replace

    from repro.models.bert import BERT

    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    for checkpointing in (False, True):
        cfg = replace(CFG, num_layers=3, activation_checkpointing=checkpointing)
        torch._dynamo.reset()
        if family == "gpt":
            model = GPT(cfg, rng=RNGTracker(1, 0), seed=3).train()
            explanation = torch._dynamo.explain(model.loss)(ids, ids)
        else:
            model = BERT(replace(cfg, num_tokentypes=2), rng=RNGTracker(1, 0), seed=3).train()
            explanation = torch._dynamo.explain(model.encode)(ids, torch.zeros_like(ids), torch.ones_like(ids))
        assert explanation.graph_break_count == 0, explanation.break_reasons


def test_a_block_without_attention_dropout_is_traced_into_the_compiled_graph():
    """Without attention dropout the models pass no tracker, so the checkpoint stays in the graph
    (no eager fallback) and the gradient is still exact."""
    from dataclasses import replace

    no_attention_dropout = replace(CFG, attention_dropout=0.0)
    along, finite_difference = directional_check("objective", no_attention_dropout)
    assert along == pytest.approx(finite_difference, rel=1e-5)
    ids = torch.zeros(1, 8, dtype=torch.long)
    model = GPT(no_attention_dropout, rng=RNGTracker(1, 0), seed=3).train()
    explanation = torch._dynamo.explain(model)(ids, ids)
    assert explanation.graph_break_count == 0, explanation.break_reasons


def test_selftest_merge_keeps_a_nan_from_any_rank():
    good = {"name": "tp2", "max_error": 3e-7, "tolerance": 1e-5, "passed": True}
    bad = dict(good, max_error=float("nan"), passed=False)
    for order in ([[good], [bad]], [[bad], [good]]):
        (row,) = merge(order)
        assert math.isnan(row["max_error"]) and not row["passed"]
    (row,) = merge([[good], [dict(good, max_error=2e-6)]])
    assert row["max_error"] == 2e-6 and row["passed"]


def test_auto_compiles_per_layer_when_the_checkpoint_replays_the_tracker():
    """At TP > 1 the tracker's checkpoint is eager: in one graph its layers would not compile; per layer
    they do. At TP = 1 no tracker is forked, and the step is one graph."""
    from pathlib import Path

    from repro.train.config import load_config
    from repro.train.engine import compile_scope

    tiny = str(Path(__file__).resolve().parents[1] / "experiments/tiny/gpt_tiny.yaml")

    def scope(tp: int = 1, **settings) -> str:
        return compile_scope(load_config(tiny, [f"{k}={v}" for k, v in settings.items()]), 1, tp)

    assert scope(**{"model.activation_checkpointing": "true", "model.attention_dropout": 0.1}) == "objective"  # TP 1
    assert scope(2, **{"model.activation_checkpointing": "true", "model.attention_dropout": 0.1}) == "blocks"
    assert scope(2, **{"model.activation_checkpointing": "true", "model.attention_dropout": 0.0}) == "objective"
    assert scope(2, **{"model.activation_checkpointing": "false", "model.attention_dropout": 0.1}) == "objective"
