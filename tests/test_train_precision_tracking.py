"""Issue 4: fp16 loss scaling with an injected overflow, bf16, MLflow tracking and sync, bad input."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from repro.parallel.spawn import free_port, run_ranks
from repro.train.commands import train_rank
from repro.train.step import train_step
from train_fixtures import corpus, data_dir, data_mirror, tiny_engine, tiny_overrides  # noqa: F401

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "experiments/tiny/gpt_tiny.yaml")


def test_fp16_overflow_skips_step_and_lowers_scale(corpus, tmp_path):
    """Two injected inf gradients: both steps skipped (weights untouched), the scale halves after the
    second (hysteresis 2), and training then continues with finite losses."""
    eng, batches = tiny_engine(corpus, tmp_path, **{"precision.precision": "fp16", "precision.initial_loss_scale": 1024})
    start_scale = eng.scaler.scale
    weight = eng.model.transformer.wpe.weight
    hook = weight.register_hook(lambda g: g * float("inf"))
    before = weight.detach().clone()
    first, second = train_step(eng, batches()), train_step(eng, batches())
    hook.remove()
    assert first.skipped and second.skipped and torch.equal(weight, before)
    assert eng.scaler.scale == start_scale / 2 and eng.scaler.skipped == 2
    after = [train_step(eng, batches()) for _ in range(3)]
    assert not any(r.skipped for r in after) and all(math.isfinite(r.loss) for r in after)
    assert not torch.equal(weight, before)



def _overflow_on_rank_1(corpus: dict, run_dir: str) -> tuple[bool, float, bool]:
    """TP=2 fp16 step with an inf gradient on TP rank 1 only: (skipped, new scale, weights untouched)."""
    import torch.distributed as dist

    from repro.data.gpt_dataset import GPTDataset, gpt_loader
    from repro.parallel.groups import ParallelDims, build_process_groups
    from repro.train.config import derive, load_config
    from repro.train.engine import build_engine

    cfg = load_config(TINY, tiny_overrides(corpus, Path(run_dir), **{"parallel.tp": 2, "precision.precision": "fp16",
                                                                       "precision.initial_loss_scale": 1024,
                                                                       "precision.hysteresis": 1}))
    eng = build_engine(cfg, derive(cfg, 2), build_process_groups(ParallelDims(2, 1)))
    loader = iter(gpt_loader(GPTDataset(cfg.data.train_prefix, cfg.model.seq_length, cache_dir=run_dir), 2))
    weight = eng.model.transformer.wpe.weight  # replicated on both TP ranks
    if dist.get_rank() == 1:
        weight.register_hook(lambda g: g * float("inf"))
    before = weight.detach().clone()
    result = train_step(eng, [next(loader) for _ in range(2)])
    return result.skipped, eng.scaler.scale, torch.equal(weight, before)


def test_an_overflow_on_one_rank_skips_the_step_on_every_rank(corpus, tmp_path):
    """Ranks agree over the world group: TP rank 0 saw finite gradients but skips too, with the same
    halved scale (hysteresis 1), so the replicated weights stay identical."""
    results = run_ranks(_overflow_on_rank_1, 2, corpus, str(tmp_path))
    assert results == [(True, 512.0, True), (True, 512.0, True)]

def test_fp16_paper_scale_comes_down_from_2_pow_32(corpus, tmp_path):
    """From the paper's 2^32 the scale halves every `hysteresis` overflows until steps succeed."""
    eng, batches = tiny_engine(corpus, tmp_path, **{"precision.precision": "fp16"})
    results = [train_step(eng, batches()) for _ in range(50)]
    assert results[0].skipped and eng.scaler.scale < 2.0**32
    assert not results[-1].skipped and math.isfinite(results[-1].loss)


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
    assert final.get("mlflow_run_id") is None and (run_dir / "tracking_unsynced").exists()
    from repro.tracking.logger import read_metrics

    assert [r["step"] for r in read_metrics(run_dir) if "loss" in r] == list(range(1, 21))
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    out = subprocess.run([sys.executable, "-m", "repro.cli", "tracking", "sync", str(run_dir)],
                         env={**os.environ, "MLFLOW_TRACKING_URI": uri}, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    _check_run(uri, (run_dir / "mlflow_run_id").read_text())


def _repro(*args, timeout=300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "repro.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "OMP_NUM_THREADS": "1"})


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
    latest = tmp_path / "checkpoints" / (tmp_path / "checkpoints" / "latest").read_text()
    (latest / "model_tp01.pt").unlink()
    missing = _repro("train", TINY, *more, "--nproc", "2")
    assert missing.returncode == 2 and "model_tp01.pt is missing" in missing.stderr, missing.stderr[-2000:]
