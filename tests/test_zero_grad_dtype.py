"""DeepSpeed ZeRO accumulates gradients over micro batches and averages them over DP in the dtype
`precision.main_grads` names (repro.train.engine.zero_grad_dtype): fp32 by default, as the plain
trainer's MainGrads, the half dtype with `main_grads: param`. Before, DeepSpeed's default (the model's
bf16/fp16) applied to both, so a half-precision ZeRO run silently summed in bf16/fp16.

The tiny GPT in bf16 at DP=2, 16 micro batches a rank, first step: the gradient handed to the optimizer
against the plain trainer's fp32 main-grads gradient (the same bf16 model and micro batches), as the L2
norm of the difference over that of the gradient. Measured: ZeRO-1 with fp32 gradients 0 (bit-identical),
ZeRO-2 2.2e-8; bf16 sums 3.5e-3 (the plain trainer's `param` recipe, ZeRO-1's, and ZeRO-1's before the
fix, all three identical), 4.1e-3 (ZeRO-2's, before the fix too). The bounds, 1e-5 and 1e-4, sit
between them with wide margins.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from unittest.mock import patch

import pytest
import torch

from conftest import require
from repro.parallel.spawn import run_ranks
from train_fixtures import corpus, data_dir, data_mirror, tiny_overrides  # noqa: F401

TINY = str(Path(__file__).resolve().parents[1] / "experiments/tiny/gpt_tiny.yaml")
BF16 = {"precision.precision": "bf16", "precision.params": "half", "train.micro_batch_size": 1,
        "train.global_batch_size": 32}
RUNS = {"plain fp32": {}, "plain param": {"precision.main_grads": "param"},
        "zero1 fp32": {"train.zero_stage": 1}, "zero1 param": {"train.zero_stage": 1, "precision.main_grads": "param"},
        "zero2 fp32": {"train.zero_stage": 2}, "zero2 param": {"train.zero_stage": 2, "precision.main_grads": "param"}}
FP16 = {"fp16 zero1 fp32": {"train.zero_stage": 1},
        "fp16 zero2 param": {"train.zero_stage": 2, "precision.main_grads": "param"}}


def _dtypes(eng) -> dict:
    """What DeepSpeed's optimizer accumulates and reduces in (its own buffers and settings), and its class."""
    opt = eng.optimizer
    flat = getattr(opt, "fp32_groups_gradients_flat", None)  # BF16_Optimizer's accumulation buffers
    accumulate = flat[0].dtype if flat else opt.gradient_accumulation_dtype
    reduce = getattr(opt, "communication_data_type", eng.wrapped.communication_data_type)
    return {"accumulate": accumulate, "reduce": reduce, "optimizer": type(opt).__name__}


def _capture_deepspeed(eng, grads: dict) -> None:
    """Record DeepSpeed's reduced gradients as its optimizer step starts (safe_get_full_grad: gathered
    over the DP partitions, in fp32)."""
    from deepspeed.utils import safe_get_full_grad

    named, step = dict(eng.model.named_parameters()), eng.optimizer.step

    def recording_step(*args, **kwargs):
        grads.update({n: safe_get_full_grad(p).float().clone() for n, p in named.items()})
        return step(*args, **kwargs)

    eng.optimizer.step = recording_step


def _capture_plain(eng, grads: dict):
    """A context recording the fp32 masters' gradients the plain trainer's clip-and-step receives."""
    from repro.train import step as st

    names, clip_and_step = {id(m): n for n, m in eng.masters.masters.items()}, st.clip_and_step

    def recording(optimizer, params, *args, **kwargs):
        grads.update({names[id(p)]: p.grad.float().clone() for p in params})
        return clip_and_step(optimizer, params, *args, **kwargs)

    return patch.object(st, "clip_and_step", recording)


def _first_step(corpus: dict, run_dir: str) -> dict[str, tuple[dict, dict[str, torch.Tensor]]]:
    """Each of RUNS and FP16 on this rank: (DeepSpeed's gradient dtypes, the first step's gradient by name)."""
    from repro.data.gpt_dataset import GPTDataset, gpt_loader
    from repro.parallel.groups import ParallelDims, build_process_groups
    from repro.train.config import derive, load_config
    from repro.train.engine import build_engine
    from repro.train.step import train_step

    pg = build_process_groups(ParallelDims.from_world(1, 2))
    out = {}
    for name, extra in RUNS.items():
        cfg = load_config(TINY, tiny_overrides(corpus, Path(run_dir) / name.replace(" ", "_"), **BF16, **extra))
        eng, grads = build_engine(cfg, derive(cfg, 2), pg), {}
        data = GPTDataset(cfg.data.train_prefix, cfg.model.seq_length, cache_dir=run_dir)
        loader = iter(gpt_loader(data, 1, pg.dp_rank, pg.dp_size))
        batches = [next(loader) for _ in range(eng.derived.grad_accum_steps)]
        if eng.deepspeed:
            _capture_deepspeed(eng, grads)
            train_step(eng, batches)
        else:
            with _capture_plain(eng, grads):
                train_step(eng, batches)
        out[name] = (_dtypes(eng) if eng.deepspeed else {}, grads)
    for name, extra in FP16.items():  # built only: DeepSpeed's ZeRO optimizer sums fp16 in fp32 too
        settings = {**BF16, **extra, "precision.precision": "fp16"}
        cfg = load_config(TINY, tiny_overrides(corpus, Path(run_dir) / name.replace(" ", "_"), **settings))
        out[name] = (_dtypes(build_engine(cfg, derive(cfg, 2), pg)), {})
    return out


def _error(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    """L2 norm of the difference over that of `want`, over every parameter."""
    diff = sum(((got[n] - w) ** 2).sum() for n, w in want.items())
    return (diff / sum((w ** 2).sum() for w in want.values())).sqrt().item()


@pytest.fixture(scope="module")
def first_steps(corpus, tmp_path_factory):  # noqa: F811
    require(importlib.util.find_spec("deepspeed") is not None, "DeepSpeed")
    return run_ranks(_first_step, 2, corpus, str(tmp_path_factory.mktemp("zero_grad_dtype")), timeout=600)


def test_zero_accumulates_and_reduces_in_the_main_grads_dtype(first_steps):
    want = {"zero1 fp32": torch.float32, "zero2 fp32": torch.float32, "zero1 param": torch.bfloat16,
            "zero2 param": torch.bfloat16, "fp16 zero1 fp32": torch.float32, "fp16 zero2 param": torch.float16}
    for rank in first_steps:
        got = {name: (rank[name][0]["accumulate"], rank[name][0]["reduce"]) for name in want}
        assert got == {name: (dtype, dtype) for name, dtype in want.items()}, got


def test_zero_gradients_equal_the_plain_trainers_fp32_main_grads(first_steps):
    errors = {name: _error(first_steps[0][name][1], first_steps[0]["plain fp32"][1]) for name in RUNS}
    assert errors["zero1 fp32"] < 1e-5 and errors["zero2 fp32"] < 1e-5, errors
    assert min(errors["plain param"], errors["zero1 param"], errors["zero2 param"]) > 1e-4, errors


def test_the_memory_plan_counts_the_optimizer_deepspeed_picks(first_steps):
    """bf16 ZeRO-1 with fp32 gradients runs on DeepSpeed's BF16_Optimizer: a full fp32 gradient buffer and
    no reduce bucket (repro.perf.plan); the other layouts keep the bucket."""
    from repro.perf.plan import memory_plan, parameters_per_rank
    from repro.train.config import derive, load_config

    for name, extra in RUNS.items():
        dtypes = first_steps[0][name][0]
        if not dtypes:  # the plain trainer
            continue
        cfg = load_config(TINY, [f"{k}={v}" for k, v in {**BF16, **extra}.items()])
        plan = memory_plan(cfg, derive(cfg, 2), "cpu")
        bf16_optimizer = dtypes["optimizer"] == "BF16_Optimizer"
        assert bf16_optimizer == (name == "zero1 fp32"), (name, dtypes)
        assert (plan.reduce_buckets == 0) == bf16_optimizer, name
        assert plan.grad_buffers == (4 * parameters_per_rank(cfg) if bf16_optimizer else 0), name
