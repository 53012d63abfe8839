"""Issue 4: fp16 loss scaling with an injected overflow, bf16, MLflow tracking and sync, bad input."""

from __future__ import annotations

import importlib.util
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import require
from repro.parallel.spawn import free_port, run_ranks
from repro.train.commands import train_rank
from repro.train.step import train_step
from train_fixtures import corpus, data_dir, data_mirror, tiny_engine, tiny_overrides  # noqa: F401

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "experiments/tiny/gpt_tiny.yaml")


def test_fp16_overflow_skips_step_and_lowers_scale(corpus, tmp_path):
    """Three injected inf gradients: every step skipped (weights untouched); the scale halves at the
    second (hysteresis 2) and again at the third (Megatron-LM's rule: the used-up hysteresis comes back
    only when the scale grows), and training then continues with finite losses. The skipped steps leave
    the learning-rate schedule where it was (Megatron-LM's rule, and DeepSpeed's): the first real update
    runs at the first step's learning rate."""
    eng, batches = tiny_engine(corpus, tmp_path, **{"precision.precision": "fp16", "precision.initial_loss_scale": 1024,
                                                    "optim.lr_warmup_iters": 10})
    start_scale, start_lr = eng.scaler.scale, eng.optimizer.param_groups[0]["lr"]
    weight = eng.model.transformer.wpe.weight
    hook = weight.register_hook(lambda g: g * float("inf"))
    before = weight.detach().clone()
    first, second = train_step(eng, batches()), train_step(eng, batches())
    assert first.skipped and second.skipped and eng.scaler.scale == start_scale / 2
    third = train_step(eng, batches())
    hook.remove()
    assert third.skipped and torch.equal(weight, before)
    assert eng.scaler.scale == start_scale / 4 and eng.scaler.skipped == 3
    assert eng.scheduler.last_epoch == 0 and eng.optimizer.param_groups[0]["lr"] == start_lr
    after = [train_step(eng, batches()) for _ in range(3)]
    assert [r.lr for r in after] == pytest.approx([start_lr, 2 * start_lr, 3 * start_lr], rel=1e-12) and start_lr > 0
    assert not any(r.skipped for r in after) and all(math.isfinite(r.loss) for r in after)
    assert not torch.equal(weight, before)



def _logged_scales(corpus: dict, run: Path, zero_stage: int) -> list[tuple[float, float]]:
    """(loss scale, skipped iterations) of each logged iteration of a 6-iteration fp16 run at DP=2
    that starts at a scale of 2^32, so that the first iterations overflow."""
    import json

    run_ranks(train_rank, 2, TINY, tiny_overrides(corpus, run, **{
        "train.zero_stage": zero_stage, "precision.precision": "fp16", "precision.initial_loss_scale": 2.0**32,
        "train.train_iters": 6, "train.log_interval": 1}), timeout=600)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [(r["loss_scale"], r["skipped_iters"]) for r in rows if "loss_scale" in r]


def test_deepspeed_fp16_logs_the_loss_scale_its_step_used_as_our_scaler_does(corpus, tmp_path):
    """Under ZeRO-1 DeepSpeed's scaler runs the step; each iteration logs the scale its losses were
    multiplied by, before the step's update, as our scaler's path does (before, DeepSpeed's runs
    logged the scale after the update, one halving ahead). Both scalers (hysteresis 2) keep 2^32
    through the first overflow and halve it at each overflow after."""
    require(importlib.util.find_spec("deepspeed") is not None, "DeepSpeed")
    ours, deepspeeds = _logged_scales(corpus, tmp_path / "ours", 0), _logged_scales(corpus, tmp_path / "zero1", 1)
    assert ours == deepspeeds, (ours, deepspeeds)
    assert [scale for scale, _ in ours] == [2.0**32, 2.0**32, 2.0**31, 2.0**30, 2.0**29, 2.0**28]
    assert [skipped for _, skipped in ours] == [1, 2, 3, 4, 5, 6]


def _overflow_on_rank_1(corpus: dict, run_dir: str, fused: bool) -> tuple[bool, float, bool]:
    """TP=2 fp16 step with an inf gradient on TP rank 1 only: (skipped, new scale, weights untouched)."""
    import torch.distributed as dist

    from repro.data.gpt_dataset import GPTDataset, gpt_loader
    from repro.parallel.groups import ParallelDims, build_process_groups
    from repro.train.config import derive, load_config
    from repro.train.engine import build_engine

    cfg = load_config(TINY, tiny_overrides(corpus, Path(run_dir), **{"parallel.tp": 2, "precision.precision": "fp16",
                                                                       "precision.initial_loss_scale": 1024,
                                                                       "precision.hysteresis": 1,
                                                                       "optim.fused": fused}))
    eng = build_engine(cfg, derive(cfg, 2), build_process_groups(ParallelDims(2, 1)))
    loader = iter(gpt_loader(GPTDataset(cfg.data.train_prefix, cfg.model.seq_length, cache_dir=run_dir), 2))
    weight = eng.model.transformer.wpe.weight  # replicated on both TP ranks
    if dist.get_rank() == 1:
        weight.register_hook(lambda g: g * float("inf"))
    before = weight.detach().clone()
    result = train_step(eng, [next(loader) for _ in range(2)])
    return result.skipped, eng.scaler.scale, torch.equal(weight, before)


@pytest.mark.parametrize("fused", [False, True], ids=["foreach", "fused"])
def test_an_overflow_on_one_rank_skips_the_step_on_every_rank(corpus, tmp_path, fused):
    """Ranks agree over the world group: TP rank 0 saw finite gradients but skips too, with the same
    halved scale (hysteresis 1), so the replicated weights stay identical. The fused step finds the
    overflow too, although the global norm counts replicated gradients on TP rank 0 only."""
    results = run_ranks(_overflow_on_rank_1, 2, corpus, str(tmp_path), fused)
    assert results == [(True, 512.0, True), (True, 512.0, True)]

class _MegatronScaler:
    """Megatron-LM's DynamicGradScaler.update (megatron/core/optimizer/grad_scaler.py), transcribed:
    the hysteresis tracker is reset only when the scale grows."""

    def __init__(self, scale: float, window: int, hysteresis: int) -> None:
        self.scale, self.window, self.hysteresis = scale, window, hysteresis
        self.growth_tracker, self.hysteresis_tracker = 0, hysteresis

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self.growth_tracker = 0
            self.hysteresis_tracker -= 1
            if self.hysteresis_tracker <= 0:
                self.scale = max(self.scale * 0.5, 1.0)
        else:
            self.growth_tracker += 1
            if self.growth_tracker == self.window:
                self.growth_tracker, self.hysteresis_tracker = 0, self.hysteresis
                self.scale *= 2.0


def test_loss_scaler_hysteresis_is_megatrons():
    """From 2^32 with hysteresis 2, 12 overflows in a row: the 2nd halves the scale and so does every
    one after it (2^21 at the 12th, not 2^26 as when each halving needed 2 overflows); a clean step
    does not restore the hysteresis, a growth does. A random overflow pattern with window 3 follows
    Megatron-LM's DynamicGradScaler step by step."""
    import random

    from repro.train.optim import DynamicLossScaler

    ours = DynamicLossScaler(2.0**32, 1000, 2, 1.0, overflows_left=2)
    log2 = []
    for _ in range(12):
        ours.update(True)
        log2.append(math.log2(ours.scale))
    assert log2 == [32, 31, 30, 29, 28, 27, 26, 25, 24, 23, 22, 21] and ours.skipped == 12
    ours.update(False)
    ours.update(True)
    assert ours.scale == 2.0**20  # one clean step: the next overflow still halves
    rng = random.Random(0)
    ours, megatron = DynamicLossScaler(2.0**16, 3, 2, 1.0, overflows_left=2), _MegatronScaler(2.0**16, 3, 2)
    for _ in range(2000):
        overflow = rng.random() < 0.3
        ours.update(overflow)
        megatron.update(overflow)
        assert ours.scale == megatron.scale


def test_fp16_paper_scale_comes_down_from_2_pow_32(corpus, tmp_path):
    """From the paper's 2^32 the scale halves at the `hysteresis`-th overflow and at every one after
    it, until steps succeed."""
    eng, batches = tiny_engine(corpus, tmp_path, **{"precision.precision": "fp16"})
    results = [train_step(eng, batches())]
    while results[-1].skipped and len(results) < 50:  # fp16 on CPU is slow: stop at the first success
        results.append(train_step(eng, batches()))
    assert results[0].skipped and eng.scaler.scale < 2.0**32
    assert not results[-1].skipped and math.isfinite(results[-1].loss), len(results)


def _skipped_iters(run_dir: Path) -> dict[int, float]:
    from repro.tracking.run_dir import read_metrics

    return {row["step"]: row["skipped_iters"] for row in read_metrics(run_dir) if "skipped_iters" in row}


def test_skipped_iters_continue_across_a_resume(corpus, tmp_path):
    """fp16 from 2^32 skips its first steps: 2 iterations then a new launch to 4 logs the same
    skipped_iters as one launch of 4 (the checkpointed scaler's count, not a per-launch one)."""
    fp16 = {"precision.precision": "fp16", "train.log_interval": 1, "optim.lr_decay_iters": 4,
            "data.valid_prefix": ""}
    run_ranks(train_rank, 1, TINY, tiny_overrides(corpus, tmp_path / "full", **fp16, **{"train.train_iters": 4}))
    split = tiny_overrides(corpus, tmp_path / "split", **fp16)
    run_ranks(train_rank, 1, TINY, split + ["train.train_iters=2"])
    run_ranks(train_rank, 1, TINY, split + ["train.train_iters=4"])
    full = _skipped_iters(tmp_path / "full")
    assert _skipped_iters(tmp_path / "split") == full and full[4] > full[2] > 0, full


def test_skipped_iters_under_zero_is_deepspeeds_checkpointed_count():
    from types import SimpleNamespace

    from repro.train.loop import skipped_iters

    assert skipped_iters(SimpleNamespace(deepspeed=True, wrapped=SimpleNamespace(skipped_steps=7))) == 7
    scaler = SimpleNamespace(skipped=3)
    assert skipped_iters(SimpleNamespace(deepspeed=False, scaler=scaler)) == 3
    assert skipped_iters(SimpleNamespace(deepspeed=False, scaler=None)) == 0


def _slow_eval_and_save(config: str, overrides: list[str], seconds: float) -> dict:
    """Training whose evaluations and checkpoints each take `seconds` longer."""
    import time

    from repro.train import loop

    evaluate, save = loop.evaluate, loop.save

    def slow(fn):
        def run(*args, **kwargs):
            time.sleep(seconds)
            return fn(*args, **kwargs)
        return run

    loop.evaluate, loop.save = slow(evaluate), slow(save)
    return train_rank(config, overrides)


def test_throughput_leaves_out_evaluation_and_checkpoint_time(corpus, tmp_path):
    """Evaluation and a checkpoint after iterations 2 and 4, each 3 s long: the next interval's
    ms/iter (hence tokens/s, TFLOP/s, MFU) is the steps' own (before, 3 s per iteration was added), and
    the two durations are logged as eval_seconds and save_seconds."""
    from repro.tracking.run_dir import read_metrics

    over = tiny_overrides(corpus, tmp_path, **{"train.train_iters": 6, "train.log_interval": 2,
                                               "train.eval_interval": 2, "train.save_interval": 2})
    run_ranks(_slow_eval_and_save, 1, TINY, over, 3.0)
    rows = read_metrics(tmp_path)
    ms = {r["step"]: r["ms_per_iter"] for r in rows if "ms_per_iter" in r}
    assert set(ms) == {2, 4, 6} and ms[4] < 1500 and ms[6] < 1500, ms  # before: over 3000
    assert [r["step"] for r in rows if r.get("eval_seconds", 0) >= 3] == [2, 4, 6]
    assert [r["step"] for r in rows if r.get("save_seconds", 0) >= 3] == [2, 4, 6]


def test_bf16_trains(corpus, tmp_path):
    eng, batches = tiny_engine(corpus, tmp_path, **{"precision.precision": "bf16"})
    losses = [train_step(eng, batches()).loss for _ in range(15)]
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0] - 0.3


def _run_with_tracking(corpus, run_dir: Path, uri: str) -> dict:
    os.environ["MLFLOW_TRACKING_URI"] = uri
    try:
        over = tiny_overrides(corpus, run_dir, **{"tracking.enabled": "true", "parallel.tp": 2,
                                                  "tracking.experiment": "test-gpt2"})
        return run_ranks(train_rank, 2, TINY, over)[0]
    finally:
        del os.environ["MLFLOW_TRACKING_URI"]


def _check_run(uri: str, run_id: str) -> None:
    import mlflow

    client = mlflow.MlflowClient(uri)
    run = client.get_run(run_id)
    p = run.data.params
    assert (p["tp"], p["dp"], p["world_size"], p["precision"], p["zero_stage"]) == ("2", "1", "2", "fp32", "0")
    assert p["git_sha"] and p["model.num_layers"] == "2" and "flop_formula" in p
    assert run.data.tags["family"] == "test-gpt2"
    history = client.get_metric_history(run_id, "loss")
    assert [m.step for m in history] == list(range(1, 21))
    assert {"tokens_per_s", "tflops_per_device", "mfu", "hw_tflops_per_device", "hfu", "valid_loss", "grad_norm",
            "lr"} <= set(run.data.metrics)
    artifacts = {a.path for a in client.list_artifacts(run_id)}
    assert {"config.yaml", "final_metrics.json"} <= artifacts


def test_mlflow_holds_params_metrics_and_artifacts(corpus, tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    import mlflow

    mlflow.MlflowClient(uri).search_experiments()  # create the store once, before the ranks start
    final = _run_with_tracking(corpus, tmp_path / "run", uri)
    mlflow.set_tracking_uri(uri)
    found = mlflow.search_runs(experiment_names=["test-gpt2"], output_format="list")
    assert [r.info.run_id for r in found] == [final["mlflow_run_id"]]
    _check_run(uri, final["mlflow_run_id"])



def test_training_inside_a_users_active_mlflow_run_gets_its_own_run(corpus, tmp_path, monkeypatch):
    """A notebook with an active MLflow run calls train(): the trainer logs to a run of its own and
    leaves the user's run active and untouched (it holds no process-global MLflow state)."""
    import mlflow

    from repro.parallel.groups import ProcessGroups
    from repro.train.config import load_config
    from repro.train.loop import train

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    mlflow.set_tracking_uri(uri)
    mlflow.set_experiment("the user's notebook")  # the fluent API's current experiment, in this store
    over = tiny_overrides(corpus, tmp_path / "run", **{"tracking.enabled": "true", "train.train_iters": 2,
                                                      "tracking.experiment": "test-notebook"})
    with mlflow.start_run(run_name="the user's") as mine:
        final = train(load_config(TINY, over), ProcessGroups.single())
        assert mlflow.active_run().info.run_id == mine.info.run_id
    client = mlflow.MlflowClient(uri)
    assert final["mlflow_run_id"] != mine.info.run_id
    run = client.get_run(final["mlflow_run_id"])
    assert run.info.status == "FINISHED" and run.data.params["tp"] == "1" and "loss" in run.data.metrics
    from repro.data.gpt_dataset import GPTDataset

    cfg = load_config(TINY, over)
    samples = len(GPTDataset(cfg.data.train_prefix, cfg.model.seq_length, cache_dir=tmp_path / "cache"))
    assert run.data.params["data_train_samples_per_epoch"] == str(samples)
    assert float(run.data.params["data_epochs"]) == pytest.approx(2 * cfg.train.global_batch_size / samples, abs=1e-4)
    assert client.get_run(mine.info.run_id).data.metrics == {}

def test_unreachable_server_then_sync(corpus, tmp_path):
    """Tracking URI at a closed port: the run completes, JSONL holds every metric, sync uploads it."""
    run_dir = tmp_path / "run"
    final = _run_with_tracking(corpus, run_dir, f"http://127.0.0.1:{free_port()}")
    assert final.get("mlflow_run_id") is None and not (run_dir / "mlflow_run_id").exists()
    from repro.tracking.run_dir import read_metrics

    assert [r["step"] for r in read_metrics(run_dir) if "loss" in r] == list(range(1, 21))
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    out = subprocess.run([sys.executable, "-m", "repro.cli", "tracking", "sync", str(run_dir)],
                         env={**os.environ, "MLFLOW_TRACKING_URI": uri}, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    _check_run(uri, (run_dir / "mlflow_run_id").read_text())


def _repro(*args, timeout=300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "repro.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "OMP_NUM_THREADS": "1"})


# The command's threads before and after `repro.cli.main`, in-process: a command that fails with a
# UserError leaves its gloo group in the traceback's reference cycle, and a gloo worker still alive at
# interpreter shutdown aborts the process (rc -6, about 1 run in 100) unless main frees the group
_THREADS_AROUND_MAIN = """
import os, sys
import torch.distributed
from repro.cli import main
before = len(os.listdir("/proc/self/task"))
code = main(sys.argv[1:])
print("threads", before, len(os.listdir("/proc/self/task")))
sys.exit(code)
"""


def _threads_around_main(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", _THREADS_AROUND_MAIN, *args], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})


@pytest.mark.parametrize("override, needle", [
    ("train.no_such_key=1", "Key 'no_such_key' not in 'TrainConfig'"),
    ("train.train_iters=many", "could not be converted to Integer"),
    ("parallel.tp=3", "tp=3 does not divide world size 1"),
    ("train.global_batch_size=5", "global_batch_size=5 is not a multiple of micro_batch_size=2"),
])
def test_bad_config_is_a_clear_error(corpus, tmp_path, override, needle):
    out = _repro("train", TINY, *sum((["--set", o] for o in tiny_overrides(corpus, tmp_path) + [override]), []))
    assert out.returncode == 2 and needle in out.stderr, out.stderr[-2000:]
    assert "Traceback" not in out.stderr


def test_missing_shard_and_tp_mismatch_are_clear_errors(corpus, tmp_path):
    over = tiny_overrides(corpus, tmp_path, **{"parallel.tp": 2, "train.train_iters": 2})
    run_ranks(train_rank, 2, TINY, over)
    more = sum((["--set", o] for o in over[:-1] + ["train.train_iters=4"]), [])
    mismatch = _repro("train", TINY, *more, "--set", "parallel.tp=1")
    assert mismatch.returncode == 2 and "saved at tp=2 but this run has tp=1" in mismatch.stderr
    assert "repro checkpoint reshard" in mismatch.stderr
    threads = _threads_around_main("train", TINY, *more, "--set", "parallel.tp=1")
    assert threads.returncode == 2, threads.stderr[-2000:]
    assert threads.stdout.split() == ["threads", "1", "1"], threads.stdout  # gloo's joined: see below
    latest = tmp_path / "checkpoints" / (tmp_path / "checkpoints" / "latest").read_text()
    (latest / "model_tp01.pt").unlink()
    missing = _repro("train", TINY, *more, "--nproc", "2")
    assert missing.returncode == 2 and "model_tp01.pt is missing" in missing.stderr, missing.stderr[-2000:]
