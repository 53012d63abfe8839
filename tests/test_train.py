"""Issue 4: hybrid TP x DP training reproduces the serial losses; fp16/bf16; resume; reshard."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import require
from repro.parallel.spawn import free_port, run_ranks
from repro.train.commands import train_rank
from train_fixtures import corpus, data_dir, data_mirror, tiny_overrides  # noqa: F401

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "experiments/tiny/gpt_tiny.yaml")


def _metric(run_dir: Path, name: str) -> list[float]:
    """The per-step values of one logged metric (loss, grad_norm) in step order."""
    from repro.tracking.run_dir import read_metrics

    return [row[name] for row in read_metrics(run_dir) if name in row]


def _losses(run_dir: Path) -> list[float]:
    return _metric(run_dir, "loss")


def _worst(got: list[float], want: list[float]) -> float:
    """The largest relative difference of two runs' per-step values (the same number of steps)."""
    assert len(got) == len(want), (len(got), len(want))
    return max(abs(a - b) / abs(b) for a, b in zip(got, want))


def _train_all(world: int, corpus, run_dir: Path, **extra) -> list[dict]:
    return run_ranks(train_rank, world, TINY, tiny_overrides(corpus, run_dir, **extra), timeout=600)


def _train(world: int, corpus, run_dir: Path, **extra) -> dict:
    return _train_all(world, corpus, run_dir, **extra)[0]


def _serial_run(corpus, run_dir: Path, **extra) -> dict:
    final = _train(1, corpus, run_dir, **extra)
    losses = _losses(run_dir)
    assert len(losses) == 20
    return {"losses": losses, "grad_norms": _metric(run_dir, "grad_norm"), "valid_loss": final["valid_loss"]}


@pytest.fixture(scope="module")
def serial(corpus, tmp_path_factory) -> dict:
    """TP=1 x DP=1 (micro batch 2, 2 accumulation steps): per-step losses and gradient norms (before
    clipping), and the final held-out loss."""
    return _serial_run(corpus, tmp_path_factory.mktemp("serial"))


HIDDEN_DROPOUT = {"model.hidden_dropout": 0.1}


@pytest.fixture(scope="module")
def serial_with_dropout(corpus, tmp_path_factory) -> dict:
    """`serial` with embedding and residual dropout (model.hidden_dropout) 0.1."""
    return _serial_run(corpus, tmp_path_factory.mktemp("serial_dropout"), **HIDDEN_DROPOUT)


def _assert_reproduces(serial: dict, run_dir: Path, final: dict) -> None:
    """Each step's loss and gradient norm, and the final held-out loss, within 1e-5 relative of
    serial's. The norm is what shows the gradients' scale: AdamW's update hides a uniform factor
    (a layout dividing by the wrong micro-batch count trains to the same losses)."""
    worst = _worst(_losses(run_dir), serial["losses"])
    assert worst < 1e-5, worst
    worst_norm = _worst(_metric(run_dir, "grad_norm"), serial["grad_norms"])
    assert worst_norm < 1e-5, worst_norm
    assert serial["losses"][-1] < serial["losses"][0] - 0.5  # it is actually learning
    assert abs(final["valid_loss"] - serial["valid_loss"]) / serial["valid_loss"] < 1e-5, (final, serial)


@pytest.fixture(scope="module")
def serial_losses(serial) -> list[float]:
    return serial["losses"]


@pytest.mark.parametrize("tp, world", [(2, 2), (1, 2), (2, 4)])
def test_layouts_reproduce_serial_losses(serial, corpus, tmp_path, tp, world):
    """fp32, same global batch (4): each step's loss and gradient norm within 1e-5 relative of TP=1 x
    DP=1 (only the order of floating-point sums differs; 20 AdamW steps keep it at ~1e-6), and so is
    the final held-out loss: eval_iters counts global batches, so every layout evaluates the same
    10 x 4 samples (before, eval_iters micro batches per rank: 20 samples serially, 40 at DP=2 or at
    micro batch 4). TP=2 runs 1 micro batch of 4 where serial accumulates 2 of 2: the norms check that
    each is divided by the micro-batch count."""
    final = _train(world, corpus, tmp_path, **{"parallel.tp": tp, "train.micro_batch_size": 4 * tp // world})
    _assert_reproduces(serial, tmp_path, final)


def test_tp_with_hidden_dropout_reproduces_serial(serial_with_dropout, serial, corpus, tmp_path):
    """Embedding and residual dropout 0.1 at TP=2 (micro batch 2, as serial): those activations are
    replicated on both TP ranks, whose default generators are seeded alike (paper Appendix B.2), so
    both drop the elements serial drops, in the same order: losses, gradient norms and the held-out
    loss within serial's 1e-5 (fp32 summation order only). Attention dropout stays 0: inside the TP
    region each rank draws from its own stream, which no serial run reproduces (those streams:
    tests/test_engine_rng.py). At DP > 1 the replicas draw the same masks for different samples, so
    serial is not matched there either. (Measured: 1e-7 relative; the dropout moves serial's losses by 2e-3.)"""
    assert _worst(serial_with_dropout["losses"], serial["losses"]) > 1e-4  # the dropout is on
    final = _train(2, corpus, tmp_path, **{"parallel.tp": 2, **HIDDEN_DROPOUT})
    _assert_reproduces(serial_with_dropout, tmp_path, final)


def test_eval_iters_counts_global_batches():
    """Megatron's eval_iters: global batches, split over DP and micro batches; a short split gives
    whole global batches, or whole micro-batch rounds when it is shorter than one."""
    from repro.train.config import load_config
    from repro.train.loop import eval_micro_batches

    cfg = load_config(TINY, ["train.eval_iters=10"])  # micro batch 2, global batch 4
    assert [eval_micro_batches(cfg, dp, 1000) for dp in (1, 2)] == [20, 10]
    assert [eval_micro_batches(cfg, dp, 14) for dp in (1, 2)] == [6, 3]  # 3 global batches of 4
    assert [eval_micro_batches(cfg, dp, 3) for dp in (1, 2)] == [1, 0]


def test_a_held_out_split_shorter_than_one_micro_batch_is_refused(corpus, tmp_path):
    """One held-out sample and micro batch 2: a DataError naming the split and the fix before any step;
    before, every evaluation ran on no micro batch and the run finished without a valid_loss."""
    import numpy as np

    from repro.data.errors import DataError
    from repro.data.indexed_dataset import IndexedDatasetWriter

    with IndexedDatasetWriter(tmp_path / "short_valid") as writer:
        writer.add_document([np.arange(100)])  # 100 tokens: one sample of 64 + 1
    over = tiny_overrides({**corpus, "valid": str(tmp_path / "short_valid")}, tmp_path / "run",
                          **{"train.train_iters": 1})
    with pytest.raises(DataError, match=r"short_valid: the held-out split holds 1 sample.*micro_batch_size=2 x dp=1"):
        train_rank(TINY, over)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.parametrize("tp", [2, 1], ids=["tp2-one-graph", "dp2-per-layer"])
def test_compiled_with_checkpointing_reproduces_serial_losses(serial_losses, corpus, tmp_path, tp):
    """train.compile with activation checkpointing, at TP=2 (collectives inside the compiled graph)
    and at DP=2 (compile_scope auto: each layer compiled, inside torch DDP): the serial eager losses
    within 1e-5 relative (the compiler fuses and reorders float32 sums)."""
    _train(2, corpus, tmp_path, **{"parallel.tp": tp, "train.compile": "true",
                                   "model.activation_checkpointing": "true"})
    losses = _losses(tmp_path)
    assert len(losses) == len(serial_losses)
    assert max(abs(a - b) / abs(b) for a, b in zip(losses, serial_losses)) < 1e-5


@pytest.mark.parametrize("stage, overlap", [(1, False), (2, False), (2, True)])
def test_deepspeed_zero_reproduces_serial_losses(serial, corpus, tmp_path, stage, overlap):
    """Real DeepSpeed ZeRO on gloo at TP=2 x DP=2, fp32 (ZeRO-2 also with its gradient reduction
    overlapped with backward): the serial losses and gradient norms (DeepSpeed's, before clipping;
    one micro batch per DP rank where serial accumulates 2) within 1e-5, and each rank holds half of
    its TP shard's Adam moments (8 bytes/parameter unsharded; DeepSpeed's alignment padding allowed: 1%)."""
    ranks = _train_all(4, corpus, tmp_path, **{"parallel.tp": 2, "train.micro_batch_size": 2,
                                               "train.zero_stage": stage, "train.zero_overlap_comm": overlap})
    worst = _worst(_losses(tmp_path), serial["losses"])
    assert worst < 1e-5, worst
    worst_norm = _worst(_metric(tmp_path, "grad_norm"), serial["grad_norms"])
    assert worst_norm < 1e-5, worst_norm
    for r in ranks:
        unsharded = 8 * r["local_parameters"]
        assert abs(r["optimizer_state_bytes"] / unsharded - 0.5) < 0.01, (r["optimizer_state_bytes"], unsharded)


@pytest.mark.parametrize("main_grads", ["param", "fp32"])
def test_deepspeed_zero_checkpoint_model_holds_fp32_masters(corpus, tmp_path, main_grads):
    """ZeRO-1 bf16 at DP=2: DeepSpeed's module is bf16, but model_tp00.pt (what eval, reshard and
    export read) holds the fp32 masters gathered from both DP ranks' partitions, not bf16-rounded;
    with bf16 gradients (DeepSpeed's ZeRO optimizer) equal to its own zero_to_fp32 consolidation,
    which cannot read the BF16_Optimizer's files that fp32 gradients bring; evaluation loads it, and
    the run resumes exactly."""
    require(importlib.util.find_spec("deepspeed") is not None, "DeepSpeed")
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    from repro.parallel.groups import ProcessGroups
    from repro.train import checkpoint as ck
    from repro.train import reshard as rs

    extra = {"train.zero_stage": 1, "precision.precision": "bf16", "train.micro_batch_size": 2,
             "train.train_iters": 2, "train.eval_iters": 1, "precision.main_grads": main_grads}
    _train(2, corpus, tmp_path, **extra)
    ckpt = ck.latest_checkpoint(tmp_path / "checkpoints")
    saved = torch.load(ckpt / "model_tp00.pt", weights_only=True)
    trained = [n for n, p in rs.load_model_for_eval(ckpt, ProcessGroups.single()).named_parameters()]
    assert all(saved[k].dtype == torch.float32 for k in trained)
    if main_grads == "param":
        masters = get_fp32_state_dict_from_zero_checkpoint(str(ckpt / "deepspeed"), tag="zero")
        assert all(torch.equal(saved[k], masters[f"model.{k}"]) for k in trained)
    assert any(not torch.equal(saved[k], saved[k].bfloat16().float()) for k in trained), "bf16 values, upcast"
    _train(2, corpus, tmp_path, **{**extra, "train.train_iters": 3})  # resumes (DeepSpeed's own fp32 state)
    _train(2, corpus, tmp_path / "full", **{**extra, "train.train_iters": 3})
    assert _losses_by_step(tmp_path) == _losses_by_step(tmp_path / "full") and len(_losses_by_step(tmp_path)) == 3


def _losses_by_step(run_dir: Path) -> dict[int, float]:
    from repro.tracking.run_dir import read_metrics

    return {row["step"]: row["loss"] for row in read_metrics(run_dir) if "loss" in row}


@pytest.mark.parametrize("launch_env", [{}, {"SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_LOCALID": "0",
                                              "SLURM_STEP_ID": "0"}],
                         ids=["repro-train", "srun"])
def test_zero_trains_without_local_rank(corpus, tmp_path, launch_env):
    """Plain `repro train` and `srun -n 1 repro train` set no LOCAL_RANK (only torchrun does), which
    DeepSpeed asserts: the trainer sets it from the launch's local rank (SLURM_LOCALID, else 0)."""
    require(importlib.util.find_spec("deepspeed") is not None, "DeepSpeed")
    launch_vars = ("LOCAL_RANK", "RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_JOB_ID",
                   "SLURM_STEP_ID")
    env = {k: v for k, v in os.environ.items() if k not in launch_vars}
    env.update(launch_env, MASTER_PORT=str(free_port()), OMP_NUM_THREADS="1")
    over = tiny_overrides(corpus, tmp_path, **{"train.zero_stage": 1, "train.train_iters": 1, "data.valid_prefix": ""})
    out = subprocess.run([sys.executable, "-m", "repro.cli", "train", TINY, *sum((["--set", o] for o in over), [])],
                         env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert "iteration      1/1" in out.stdout


def test_deepspeed_zero_resume_is_exact(corpus, tmp_path):
    """ZeRO-1 at DP=2 with dropout: 4 iterations, then a new launch to 8 == one launch of 8 (the
    partitioned optimizer state goes through DeepSpeed's own checkpoint inside ours). Each launch's
    first logged interval is flagged as warm-up, for the tables to drop."""
    from repro.tracking.run_dir import read_metrics

    extra = {"train.zero_stage": 1, "train.micro_batch_size": 2, "optim.lr_decay_iters": 8,
             "model.hidden_dropout": 0.1, "train.log_interval": 2}
    _train(2, corpus, tmp_path / "full", **extra, **{"train.train_iters": 8})
    _train(2, corpus, tmp_path / "part", **extra, **{"train.train_iters": 4})
    _train(2, corpus, tmp_path / "part", **extra, **{"train.train_iters": 8})
    assert (tmp_path / "part" / "checkpoints" / "iter_0000004" / "deepspeed").is_dir()
    assert _losses(tmp_path / "part") == _losses(tmp_path / "full")
    for run, flags in (("full", [1, 0, 0, 0]), ("part", [1, 0, 1, 0])):
        logged = [(r["step"], r["warmup_interval"]) for r in read_metrics(tmp_path / run) if "warmup_interval" in r]
        assert logged == list(zip((2, 4, 6, 8), flags)), (run, logged)
        final = json.loads((tmp_path / run / "final_metrics.json").read_text())
        assert final["iteration"] == 8 and final["warmup_interval"] == 0  # its ms_per_iter is a warm one


def test_compile_with_deepspeed_and_overlap_without_it_are_refused_with_the_fix(corpus, tmp_path):
    from repro.train.config import RunConfigError, derive, load_config

    cfg = load_config(TINY, tiny_overrides(corpus, tmp_path, **{"train.compile": "true", "train.zero_stage": 1}))
    with pytest.raises(RunConfigError, match="set train.zero_stage=0 or train.compile=false"):
        derive(cfg, 1)
    cfg = load_config(TINY, tiny_overrides(corpus, tmp_path, **{"train.compile": "true", "train.compile_scope": "layers"}))
    with pytest.raises(RunConfigError, match="compile_scope='layers': use auto, objective or blocks"):
        derive(cfg, 1)
    cfg = load_config(TINY, tiny_overrides(corpus, tmp_path, **{"train.zero_overlap_comm": "true"}))
    with pytest.raises(RunConfigError, match="zero_overlap_comm is DeepSpeed's: set train.zero_stage=1 or 2"):
        derive(cfg, 1)


@pytest.mark.parametrize("dp, tp, torch_version, scope", [
    (1, 1, "2.6.0+cu124", "objective"), (2, 1, "2.13.0", "blocks"), (1, 2, "2.13.0+cpu", "objective"),
    (1, 2, "2.9.1+cu128", "objective"), (1, 2, "2.6.0+cu124", "blocks"), (1, 2, "2.8.0a0+git1.nv25.05", "blocks")])
def test_auto_compile_scope_compiles_per_layer_where_the_whole_tp_step_fails(corpus, tmp_path, dp, tp,
                                                                            torch_version, scope):
    """auto: per layer at DP > 1 (inside DDP), and at TP > 1 on torch older than 2.9: 2.6.0's inductor
    fails on the whole TP=2 step (UnboundLocalError in its generated code) and compiles it per layer."""
    from repro.train.config import load_config
    from repro.train.engine import compile_scope

    cfg = load_config(TINY, tiny_overrides(corpus, tmp_path, **{"train.compile": "true"}))
    assert compile_scope(cfg, dp, tp, torch_version) == scope
    explicit = load_config(TINY, tiny_overrides(corpus, tmp_path, **{"train.compile": "true",
                                                                     "train.compile_scope": "objective"}))
    assert compile_scope(explicit, dp, tp, torch_version) == "objective"
