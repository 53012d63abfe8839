"""The learning-rate schedule: Megatron-LM's AnnealingLR one iteration on, and kept on resume."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from repro.parallel.spawn import run_ranks
from repro.train.commands import train_rank
from repro.train.config import OptimConfig
from repro.train.optim import lr_at
from train_fixtures import corpus, data_dir, data_mirror, tiny_overrides  # noqa: F401

TINY = str(Path(__file__).resolve().parents[1] / "experiments/tiny/gpt_tiny.yaml")


def megatron_annealing_lr(num_iters: int, cfg: OptimConfig, end_iter: int) -> float:
    """Megatron-LM (2020) AnnealingLR.get_lr, written from its rule: num_iters counts the steps taken
    before the one this lr is for; warm-up start_lr * num_iters / warmup_iter up to warmup_iter,
    then the decay over the iterations after warm-up, floored at min_lr."""
    warmup = cfg.lr_warmup_iters
    if warmup > 0 and num_iters <= warmup:
        return cfg.lr * num_iters / warmup
    after = num_iters - warmup
    span = end_iter - warmup
    if cfg.lr_decay_style == "linear":
        lr = cfg.lr * (span - after) / span
    else:
        lr = cfg.lr / 2.0 * (math.cos(math.pi * after / span) + 1)
    return max(lr, cfg.min_lr) if cfg.lr_decay_style == "linear" else cfg.min_lr + (lr / cfg.lr) * (cfg.lr - cfg.min_lr)


@pytest.mark.parametrize("style", ["cosine", "linear"])
@pytest.mark.parametrize("warmup, decay", [(3, 10), (0, 7), (100, 1000)])
def test_schedule_is_megatrons_one_iteration_on(style, warmup, decay):
    """Iteration i runs AnnealingLR's lr after i + 1 steps: warm-up lr/W ... lr with the peak once,
    then the decay, which reaches min_lr on the last iteration of lr_decay_iters and stays there.
    (Without warm-up the first iteration is one step into the decay, as AnnealingLR's second is.)"""
    cfg = OptimConfig(lr=1.0, min_lr=0.1 if style == "cosine" else 0.0, lr_warmup_iters=warmup,
                      lr_decay_style=style)
    ours = [lr_at(i, cfg, decay) for i in range(decay + 3)]
    assert ours == pytest.approx([megatron_annealing_lr(min(i + 1, decay), cfg, decay) for i in range(decay + 3)],
                                 rel=1e-12, abs=1e-12)
    assert ours.count(max(ours)) == 1 and (max(ours) == 1.0) == (warmup > 0)
    assert ours[decay - 1:] == pytest.approx([cfg.min_lr] * 4) and ours[decay - 2] > cfg.min_lr
    assert all(a < b for a, b in zip(ours[:warmup], ours[1:warmup]))
    assert all(a > b for a, b in zip(ours[max(warmup - 1, 0):decay - 1], ours[max(warmup, 1):decay]))


@pytest.mark.parametrize("world, zero_stage", [(1, 0), (2, 1)])
def test_a_resume_that_raises_train_iters_follows_the_new_schedule_from_its_first_step(
        corpus, tmp_path, world, zero_stage):  # noqa: F811
    """4 iterations of a 4-iteration schedule, then the same run raised to 8: every resumed step,
    the first included, runs at the 8-iteration schedule's lr (the checkpoint's optimizer holds the old
    one's), plain trainer and DeepSpeed ZeRO-1 alike."""
    from repro.tracking.run_dir import read_metrics

    extra = {"train.log_interval": 1, "train.zero_stage": zero_stage, "train.micro_batch_size": 2}

    def lrs(run: str, iters: int) -> dict[int, float]:
        run_ranks(train_rank, world, TINY, tiny_overrides(corpus, tmp_path / run, **extra, **{"train.train_iters": iters}),
                  timeout=600)
        return {r["step"]: r["lr"] for r in read_metrics(tmp_path / run) if "lr" in r}

    lrs("part", 4)
    resumed = lrs("part", 8)
    cfg = OptimConfig(lr=1.0e-3, min_lr=1.0e-4, lr_warmup_iters=2, lr_decay_style="cosine")
    expected = {step: lr_at(step - 1, cfg, 8) for step in range(5, 9)}
    assert {step: resumed[step] for step in range(5, 9)} == pytest.approx(expected, rel=1e-6)
    assert resumed[4] == pytest.approx(lr_at(3, cfg, 4), rel=1e-6) == 1.0e-4  # the 4-iteration run ended at min_lr
