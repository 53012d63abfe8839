"""Bad input to `repro train` and `repro checkpoint`: exit 2, a message naming the problem and the fix,
and nothing already written changed (file bytes and mtimes compared before and after)."""

from __future__ import annotations

import importlib.util
import json
import math
import re
import shutil
from pathlib import Path

import pytest

from conftest import require
from repro.cli import main
from repro.parallel.spawn import run_ranks
from repro.train.commands import train_rank
from repro.train.config import load_config, resume_differences, to_yaml
from train_fixtures import corpus, data_dir, data_mirror, tiny_overrides  # noqa: F401

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "experiments/tiny/gpt_tiny.yaml")
DONE = {"train.train_iters": 2, "train.save_interval": 1, "train.log_interval": 1, "train.eval_iters": 1}


def _snapshot(root: Path) -> dict[str, tuple]:
    """Every file's bytes and mtime and every directory under root."""
    return {str(p.relative_to(root)): (p.read_bytes(), p.stat().st_mtime_ns) if p.is_file() else None
            for p in sorted(root.rglob("*"))}


def _train(capfd, corpus, run_dir: Path, *args: str, **extra) -> tuple[int, str]:
    """`repro train TINY --set ...` in this process (with --nproc, ranks are spawned): (rc, output)."""
    sets = [a for o in tiny_overrides(corpus, run_dir, **{**DONE, **extra}) for a in ("--set", o)]
    rc = main(["train", TINY, *sets, *args])
    out, err = capfd.readouterr()
    return rc, out + err


@pytest.fixture(scope="module")
def finished(corpus, tmp_path_factory) -> Path:
    """A run trained to its train_iters=2, with checkpoints at iterations 1 and 2."""
    run_dir = tmp_path_factory.mktemp("finished")
    run_ranks(train_rank, 1, TINY, tiny_overrides(corpus, run_dir, **DONE))
    return run_dir


@pytest.fixture
def run(finished, tmp_path) -> Path:
    """A private copy of the finished run (tests may damage it)."""
    return Path(shutil.copytree(finished, tmp_path / "run"))


# ---- 1: reshard never destroys an existing directory; tp >= 1 ----------------------------------

def test_reshard_refuses_an_existing_out_and_a_bad_tp(run, tmp_path, capfd):
    user_dir = tmp_path / "mine"
    user_dir.mkdir()
    (user_dir / "notes.txt").write_text("keep me")
    before = _snapshot(tmp_path)
    for out in (run, run / "checkpoints" / "iter_0000002", user_dir):
        assert main(["checkpoint", "reshard", str(run), "--tp", "2", "--out", str(out)]) == 2
        err = capfd.readouterr().err
        assert f"--out {out} already exists: choose a new directory" in err, err
    for tp in ("-2", "0"):
        assert main(["checkpoint", "reshard", str(run), "--tp", tp, "--out", str(tmp_path / "new")]) == 2
        assert f"tp={tp} must be a positive integer" in capfd.readouterr().err
    assert _snapshot(tmp_path) == before
    assert main(["checkpoint", "reshard", str(run), "--tp", "2", "--out", str(tmp_path / "new")]) == 0
    assert sorted(p.name for p in (tmp_path / "new").iterdir()) == ["meta.json", "model_tp00.pt", "model_tp01.pt"]
    assert not list(tmp_path.glob(".new*")), "the temporary sibling was left behind"


def test_export_hf_refuses_an_occupied_out(run, tmp_path, capfd):
    user_dir = tmp_path / "mine"
    user_dir.mkdir()
    (user_dir / "notes.txt").write_text("keep me")
    before = _snapshot(tmp_path)
    assert main(["checkpoint", "export-hf", str(run), "--out", str(user_dir)]) == 2
    assert f"--out {user_dir} already exists" in capfd.readouterr().err
    assert _snapshot(tmp_path) == before
    assert main(["checkpoint", "export-hf", str(run), "--out", str(tmp_path / "hf")]) == 0
    assert (tmp_path / "hf" / "config.json").is_file() and not list(tmp_path.glob(".hf*"))


# ---- 2: a finished run launched again is a no-op that says so -------------------------------------

def test_finished_run_trains_nothing_and_keeps_its_files(run, corpus, capfd):
    before = _snapshot(run)
    rc, out = _train(capfd, corpus, run, "--nproc", "1")
    assert rc == 0, out
    assert "already at iteration 2 (train.train_iters=2): nothing to train; raise train.train_iters" in out
    assert _snapshot(run) == before



def test_run_stopped_before_its_final_metrics_is_finished_without_training(run, corpus, capfd):
    """Checkpoint at train_iters but no final_metrics.json (a crash in the final evaluation): a relaunch
    evaluates and writes the final metrics, and leaves the checkpoints alone."""
    final_path = run / "final_metrics.json"
    first = json.loads(final_path.read_text())
    final_path.unlink()
    checkpoints = _snapshot(run / "checkpoints")
    rc, out = _train(capfd, corpus, run, "--nproc", "1")
    assert rc == 0, out
    assert "has no final_metrics.json: it stopped before finishing" in out
    assert "iteration      1/" not in out and "iteration      2/" not in out, "it trained again"
    again = json.loads(final_path.read_text())
    assert again["iteration"] == 2 and again["valid_loss"] == pytest.approx(first["valid_loss"], rel=1e-6)
    assert _snapshot(run / "checkpoints") == checkpoints
    rc, out = _train(capfd, corpus, run, "--nproc", "1")
    assert rc == 0 and "nothing to train" in out, out

# ---- 3, 4, 9: resume refuses a changed config or TP degree, naming every key ---------------------

@pytest.mark.parametrize("sets, lines", [
    ({"train.global_batch_size": 8, "optim.lr": 5e-3},
     ["optim.lr: 0.001 -> 0.005", "train.global_batch_size: 4 -> 8"]),
    ({"model.hidden_size": 128}, ["model.hidden_size: 64 -> 128"]),  # 9: no size-mismatch traceback
])
def test_resume_with_a_changed_config_is_refused(run, corpus, capfd, sets, lines):
    before = _snapshot(run)
    rc, out = _train(capfd, corpus, run, "--nproc", "1", **{**sets, "train.train_iters": 4})
    assert rc == 2, out
    assert "was saved with a different config" in out and all(line in out for line in lines), out
    assert "resume with the saved config" in out and "--set run_dir=NEW_DIR" in out
    assert "Traceback" not in out and _snapshot(run) == before


def test_resume_may_change_length_reporting_and_locations(run, corpus):
    saved = load_config(TINY, tiny_overrides(corpus, run, **DONE))
    moved = load_config(TINY, tiny_overrides(corpus, run / "elsewhere", **{
        **DONE, "train.train_iters": 50, "train.log_interval": 7, "train.eval_interval": 5,
        "tracking.paper_ref": "again", "name": "renamed"}))
    assert resume_differences(to_yaml(saved), moved) == {}


def test_resume_at_another_tp_names_the_saved_tp_not_reshard(run, corpus, capfd):
    before = _snapshot(run)
    rc, out = _train(capfd, corpus, run, "--nproc", "2", **{"parallel.tp": 2, "train.train_iters": 4})
    assert rc == 2, out
    assert "saved at tp=1 but this run has tp=2" in out and "--set parallel.tp=1" in out, out
    assert "model weights only" in out and "--out DIR" not in out
    assert _snapshot(run) == before


def _zero_checkpoint(run_dir: Path, dp: int, zero_stage: int = 1) -> None:
    """The meta.json and `latest` of a checkpoint saved at tp=1 x dp=`dp` (nothing else: never loaded)."""
    ckpt = run_dir / "checkpoints" / "iter_0000002"
    ckpt.mkdir(parents=True)
    meta = {"tp": 1, "dp": dp, "world_size": dp, "zero_stage": zero_stage, "iteration": 2, "consumed_samples": 8}
    (ckpt / "meta.json").write_text(json.dumps(meta))
    (run_dir / "checkpoints" / "latest").write_text(ckpt.name)


def test_resume_of_a_zero_run_at_another_dp_is_refused_before_anything_is_built(corpus, tmp_path, capfd):
    """DeepSpeed cannot repartition ZeRO's optimizer state: the --nproc preflight, and train() itself
    (srun/torchrun), refuse naming the saved and current world and dp sizes, before building anything.
    The plain trainer resumes at any dp."""
    from repro.parallel.groups import ProcessGroups
    from repro.train.checkpoint import CheckpointError
    from repro.train.engine_state import resume_meta
    from repro.train.loop import train

    _zero_checkpoint(tmp_path / "run", dp=2)
    before = _snapshot(tmp_path)
    zero = {"train.zero_stage": 1, "train.train_iters": 4}
    rc, out = _train(capfd, corpus, tmp_path / "run", "--nproc", "1", **zero)
    needle = "saved by DeepSpeed ZeRO-1 at world size 2 (tp=1 x dp=2) but this launch has world size 1 (dp=1)"
    assert rc == 2 and needle in out and "resume on 2 ranks (--nproc 2" in out and "Traceback" not in out, out
    cfg = load_config(TINY, tiny_overrides(corpus, tmp_path / "run", **{**DONE, **zero}))
    with pytest.raises(CheckpointError, match=re.escape(needle)):
        train(cfg, ProcessGroups.single())
    assert _snapshot(tmp_path) == before
    assert resume_meta(cfg, 1, 2)[0].name == "iter_0000002"  # at the saved dp it resumes
    _zero_checkpoint(tmp_path / "plain", dp=2, zero_stage=0)
    plain = load_config(TINY, tiny_overrides(corpus, tmp_path / "plain", **DONE))
    assert resume_meta(plain, 1, 1)[0].name == "iter_0000002"


@pytest.mark.parametrize("device", ["gpu", "cuda:0", "CUDA"])
def test_an_unknown_train_device_is_refused_naming_the_choices(corpus, tmp_path, capfd, device):
    """Before, any value but cuda/auto trained silently on the CPU (on a GPU node with NCCL picked)."""
    rc, out = _train(capfd, corpus, tmp_path / "fresh", **{"train.device": device})
    assert rc == 2 and f"train.device={device!r}: use auto (cuda when available), cpu or cuda" in out, out
    assert "--set train.device=cuda" in out and not (tmp_path / "fresh").exists()


def test_negative_loader_workers_are_refused_and_the_default_follows_the_family(corpus, tmp_path, capfd):
    from repro.train.config import RunConfig
    from repro.train.objectives import loader_workers

    rc, out = _train(capfd, corpus, tmp_path / "fresh", **{"data.num_workers": -1})
    assert rc == 2 and "data.num_workers=-1: use 0" in out and not (tmp_path / "fresh").exists(), out
    assert loader_workers(RunConfig(family="bert"), "cuda") == 2
    assert loader_workers(RunConfig(family="bert"), "cpu") == loader_workers(RunConfig(family="gpt"), "cuda") == 0
    explicit = RunConfig(family="gpt")
    explicit.data.num_workers = 3
    assert loader_workers(explicit, "cpu") == 3


@pytest.mark.parametrize("overrides, needle", [
    ({"optim.lr_decay_iters": 2, "optim.lr_warmup_iters": 2}, "optim.lr_decay_iters=2 is not above optim.lr_warmup_iters=2"),
    ({"train.exit_duration_minutes": -1}, "train.exit_duration_minutes=-1.0 must be >= 0"),
])
def test_a_schedule_or_time_limit_that_cannot_work_is_refused(corpus, tmp_path, capfd, overrides, needle):
    """A decay that ends before warm-up does (the lr would fall to min_lr at once), a negative exit
    duration: refused before anything is written."""
    rc, out = _train(capfd, corpus, tmp_path / "fresh", **overrides)
    assert rc == 2 and needle in out and not (tmp_path / "fresh").exists(), out


# ---- 5, 6: counts are validated before anything is written ---------------------------------------

@pytest.mark.parametrize("key, value, args", [
    ("train.train_iters", -1, ()), ("train.log_interval", 0, ()), ("train.global_batch_size", 0, ()),
    ("parallel.tp", 0, ()), ("parallel.tp", 0, ("--nproc", "2")),
])
def test_non_positive_counts_are_refused_before_anything_is_written(corpus, tmp_path, capfd, key, value, args):
    run_dir = tmp_path / "fresh"
    rc, out = _train(capfd, corpus, run_dir, *args, **{key: value})
    assert rc == 2, out
    assert f"{key}={value} must be a positive integer: set {key} >= 1" in out, out
    assert not run_dir.exists()


@pytest.mark.parametrize("key, value, needle", [
    ("optim.lr", -1, "optim.lr=-1.0 must be positive"),  # was torch's ValueError from a rank, a traceback
    ("optim.min_lr", 1, "optim.min_lr=1.0 must be between 0 and optim.lr=0.001"),  # the decay climbed to 1.0
    ("optim.weight_decay", -0.1, "optim.weight_decay=-0.1 must be >= 0"),  # trained, growing the weights
    ("optim.clip_grad", -1, "optim.clip_grad=-1.0 must be >= 0"),  # trained without clipping
    ("optim.adam_beta1", 1.5, "optim.adam_beta1=1.5 must be in [0, 1)"),
    ("precision.initial_loss_scale", 0, "0 < min_loss_scale <= initial_loss_scale"),
    ("train.seed", -1, "train.seed=-1: use a seed in [0, 2**31)"),  # was numpy's ValueError from the data
])
def test_optimizer_values_out_of_range_are_refused_before_anything_is_written(corpus, tmp_path, capfd, key, value,
                                                                              needle):
    rc, out = _train(capfd, corpus, tmp_path / "fresh", "--nproc", "1", **{key: value})
    assert rc == 2 and needle in out and "Traceback" not in out, out
    assert not (tmp_path / "fresh").exists()
    assert main(["plan", TINY, "--gpus", "1", "--set", f"{key}={value}"]) == 2  # and before a plan
    assert needle in capfd.readouterr().err


def test_a_loss_scale_deepspeed_would_round_is_refused_under_zero():
    """DeepSpeed takes the initial loss scale as a power of two (3000 would start at 4096, the plain
    trainer at 3000): refused under ZeRO with the power to give, accepted without ZeRO and as 2**k."""
    from repro.train.config import RunConfigError, derive

    fp16 = ["precision.precision=fp16", "train.zero_stage=1", "train.micro_batch_size=2"]
    with pytest.raises(RunConfigError, match=r"initial_loss_scale=3000 under ZeRO.*--set precision.initial_loss_scale=4096"):
        derive(load_config(TINY, fp16 + ["precision.initial_loss_scale=3000"]), 2)
    derive(load_config(TINY, fp16 + ["precision.initial_loss_scale=4096"]), 2)
    derive(load_config(TINY, fp16[:1] + ["precision.initial_loss_scale=3000"]), 2)


def test_slurm_check_refuses_zero_tasks(capfd):
    assert main(["slurm", "check", TINY, "--ntasks", "0"]) == 2
    assert "world size 0: launch at least one rank" in capfd.readouterr().err


def test_negative_nproc_is_refused(corpus, tmp_path, capfd):
    rc, out = _train(capfd, corpus, tmp_path / "fresh", "--nproc", "-1")
    assert rc == 2 and "--nproc -1: give a positive number of ranks" in out, out
    assert not (tmp_path / "fresh").exists()


# ---- 7, 8: config files and overrides ------------------------------------------------------------

@pytest.mark.parametrize("name, text, needle", [
    ("bad.yaml", "train:\n  a: [1\n b: 2\n", "is not valid YAML (line 3, column 3"),
    ("list.yaml", "- a\n- b\n", "holds a YAML list, not a mapping"),
    ("dir.yaml", None, "is a directory: give a YAML file"),
    ("empty.yaml", "# nothing yet\n", "is empty (no sections, or only comments)"),  # trained the defaults before
    ("braces.yaml", "{}\n", "is empty (no sections, or only comments)"),
    ("wrong.yaml", "train:\n  train_iters: ten\n", "train.train_iters: Value 'ten'"),
])
def test_config_file_errors_name_the_file_and_problem(tmp_path, capfd, name, text, needle):
    path = tmp_path / name
    path.mkdir() if text is None else path.write_text(text)
    assert main(["train", str(path)]) == 2
    err = capfd.readouterr().err
    assert err.startswith(f"error: {path}") or f"config {path}" in err, err
    assert needle in err and "Traceback" not in err, err


@pytest.mark.parametrize("override, needle", [
    ("train.train_iters=ten", "--set train.train_iters=ten: train.train_iters: Value 'ten'"),
    ("train.trian_iters=3", "--set train.trian_iters=3: train.trian_iters: Key 'trian_iters' not in"),
    ("train.train_iters", "--set train.train_iters: expected KEY=VALUE"),
    ("run_dir=/runs/gpt2 #2", "YAML reads the value as '/runs/gpt2' (' #' starts a comment"),  # trained elsewhere
    ("name=run ", "YAML reads the value as 'run'"),
])
def test_override_errors_name_the_override(capfd, override, needle):
    assert main(["train", TINY, "--set", override, "--nproc", "2"]) == 2
    err = capfd.readouterr().err
    assert needle in err and "RunConfigError" not in err, err


# ---- 10: damaged checkpoint files ----------------------------------------------------------------

@pytest.mark.parametrize("name, keep, reason", [("meta.json", 100, ""),  # read here
                                                ("model_tp00.pt", 1000, " (PytorchStreamReader")])  # by a rank
def test_damaged_checkpoint_file_names_the_file_and_the_way_back(run, corpus, capfd, name, keep, reason):
    damaged = run / "checkpoints" / "iter_0000002" / name
    damaged.write_bytes(damaged.read_bytes()[:keep])
    before = _snapshot(run)
    rc, out = _train(capfd, corpus, run, "--nproc", "1", **{"train.train_iters": 4})
    assert rc == 2, out
    err = out.splitlines()[-1]
    assert err.startswith(f"error: checkpoint file {damaged} is damaged{reason}"), out
    assert "CheckpointError" not in err and f"echo iter_0000001 > {run / 'checkpoints' / 'latest'}" in out
    assert _snapshot(run) == before


def test_a_resume_on_another_training_split_is_refused_a_moved_one_is_not(run, corpus, capfd, tmp_path):
    """The checkpoint's consumed_samples is a position in the split it trained on: a resume on other
    data (here the valid split) exits 2 naming what differs, before anything is written; the same
    files under another path resume."""
    before = _snapshot(run)
    rc, out = _train(capfd, corpus, run, **{"train.train_iters": 3, "data.train_prefix": corpus["valid"]})
    assert rc == 2, out
    err = out.splitlines()[-1]
    assert "iter_0000002 was trained on other data than data.train_prefix=" in err and "tokens " in err, out
    assert "Fix: point data.train_prefix at the split it was trained on" in err
    assert _snapshot(run) == before
    moved = tmp_path / "moved"
    moved.mkdir()
    for suffix in (".bin", ".idx"):
        shutil.copy(corpus["train"] + suffix, moved / f"train{suffix}")
    rc, out = _train(capfd, corpus, run, **{"train.train_iters": 3, "data.train_prefix": str(moved / "train")})
    assert rc == 0 and "resumed from" in out, out


def test_train_without_a_config_names_the_missing_argument(capfd):
    """Before, `repro train` alone blamed an empty data.train_prefix."""
    assert main(["train"]) == 2
    out = "".join(capfd.readouterr())
    assert "no config given" in out and "experiments/" in out and "train_prefix" not in out


def test_a_command_that_started_a_process_group_destroys_it(corpus, tmp_path, capfd):
    """`repro train` in one process builds its own group (torchrun and srun do too) and the CLI ends it
    after the command (NCCL warns, or hangs a peer, at exit with a live group); a group the caller
    had stays (a test or notebook calling main() inside its own ranks)."""
    import torch.distributed as dist

    rc, out = _train(capfd, corpus, tmp_path / "run")
    assert rc == 0 and not dist.is_initialized(), out


def test_a_failed_in_process_train_ends_the_group_it_started(corpus, tmp_path):
    """train_rank's own group ends even when training fails (before, the next in-process call took the
    leftover group for a caller's and trained in it)."""
    import torch.distributed as dist

    from repro.train.checkpoint import CheckpointError

    with pytest.raises(CheckpointError, match="data.train_prefix is empty"):
        train_rank(TINY, tiny_overrides(corpus, tmp_path, **{**DONE, "data.train_prefix": ""}))
    assert not dist.is_initialized()


# ---- a diverged run stops before it saves non-finite weights ----------------------------------

@pytest.mark.parametrize("precision,layout", [("bf16", {"parallel.tp": 2}), ("fp32", {"parallel.tp": 2}),
                                              ("bf16", {"train.zero_stage": 1})])
def test_a_diverged_step_stops_the_run_before_it_saves(corpus, tmp_path, capfd, precision, layout):
    """lr 1e30 makes step 1's weights ~1e30, so step 2's loss is not finite. bf16 and fp32 have no loss
    scale to lower: the run must stop there on both ranks (TP=2, whose step left inf/nan weights, and
    DeepSpeed at DP=2, which skips such a step and would skip every one after it), exit 2 naming the
    iteration and the last checkpoint, with iteration 1's checkpoint still `latest` and nothing later.
    (Before, both finished with exit 0 and a nan loss at every iteration from 2 on.)"""
    rc, out = _train(capfd, corpus, tmp_path, "--nproc", "2", **{
        "train.train_iters": 4, "optim.lr": 1e30, "optim.min_lr": 0.0, "optim.lr_warmup_iters": 0,
        "precision.precision": precision, **layout})
    assert rc == 2, out
    assert re.search(r"iteration 2: loss (nan|inf), gradient norm", out), out
    assert "iteration 1, saved before it" in out and "optim.override_schedule=true" in out
    checkpoints = tmp_path / "checkpoints"
    assert (checkpoints / "latest").read_text() == "iter_0000001"
    assert sorted(p.name for p in checkpoints.glob("iter_*")) == ["iter_0000001"]
    assert not (tmp_path / "final_metrics.json").exists()


@pytest.mark.parametrize("zero_stage", [0, 1], ids=["ours", "deepspeed"])
def test_fp16_stops_at_an_overflow_the_minimum_loss_scale_cannot_answer(corpus, tmp_path, capfd, zero_stage):
    """From 2^32 the tiny model's gradients overflow until the scale is 2^28. With min_loss_scale 2^30
    and hysteresis 2, iteration 4 overflows at 2^30 with the hysteresis used up: both scalers stop the
    run there with the DivergedError, at DP=2. (Before, our scaler skipped every step to the end and
    exited 0 having trained nothing; DeepSpeed's raised its own bare Exception, a traceback.)"""
    if zero_stage:
        require(importlib.util.find_spec("deepspeed") is not None, "DeepSpeed")
    rc, out = _train(capfd, corpus, tmp_path, "--nproc", "2", **{
        "train.train_iters": 6, "train.log_interval": 1, "train.zero_stage": zero_stage,
        "precision.precision": "fp16", "precision.initial_loss_scale": 2.0**32,
        "precision.min_loss_scale": 2.0**30})
    assert rc == 2, out
    assert "iteration 4: loss" in out and "minimum loss scale (precision.min_loss_scale=1.07374e+09)" in out, out
    assert "iteration 3, saved before it" in out and "Traceback" not in out, out
    assert (tmp_path / "checkpoints" / "latest").read_text() == "iter_0000003"
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["loss_scale"] for r in rows if "loss_scale" in r] == [2.0**32, 2.0**32, 2.0**31, 2.0**30]


def test_the_advice_after_a_divergence_works(corpus, tmp_path, capfd, monkeypatch):
    """Following the DivergedError's fix after iteration 2 diverged (a nan loss injected) with iteration
    1's checkpoint sound: a resume with a lower lr is refused without optim.override_schedule (naming
    it), and with it trains on from iteration 1 at the new lr. The diverged launch's rows after the
    checkpoint (iteration 2's nan) move aside, so metrics.jsonl holds each step once, all finite.
    (Before, the advised resume was refused, and a resume kept the nan row in place of the redone one.)"""
    import dataclasses

    from repro.train import loop

    real_step, calls = loop.train_step, []

    def diverging_at_2(eng, batches):
        calls.append(1)
        result = real_step(eng, batches)
        return dataclasses.replace(result, loss=float("nan")) if len(calls) == 2 else result

    monkeypatch.setattr(loop, "train_step", diverging_at_2)
    run = {"train.train_iters": 4, "optim.min_lr": 0.0, "optim.lr_warmup_iters": 0}
    rc, out = _train(capfd, corpus, tmp_path, **{**run, "optim.lr": 1e-3})
    assert rc == 2 and "Fix: resume from it (or from an earlier one" in out, out
    monkeypatch.setattr(loop, "train_step", real_step)
    rc, out = _train(capfd, corpus, tmp_path, **{**run, "optim.lr": 1e-4})
    assert rc == 2 and "optim.lr: 0.001 -> 0.0001" in out and "--set optim.override_schedule=true" in out, out
    rc, out = _train(capfd, corpus, tmp_path, **{**run, "optim.lr": 1e-4, "optim.override_schedule": "true"})
    assert rc == 0 and "new schedule from iteration 2: optim.lr 0.001 -> 0.0001" in out, out
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    losses = [(row["step"], row["loss"]) for row in rows if "loss" in row]
    assert [step for step, _ in losses] == [1, 2, 3, 4] and all(math.isfinite(v) for _, v in losses), losses
    lrs = [row["lr"] for row in rows if "lr" in row]  # cosine from the peak to 0 over 4 iterations
    assert lrs == pytest.approx([1e-3 * 0.5 * (1 + math.cos(math.pi / 4))] +
                                [1e-4 * 0.5 * (1 + math.cos(math.pi * k / 4)) for k in (2, 3, 4)]), lrs
    aside = list(tmp_path.glob("metrics.jsonl.before-*"))
    assert len(aside) == 1 and '"step": 2' in aside[0].read_text()


@pytest.mark.parametrize("workers", [0, 2])
def test_a_gpt_corpus_in_another_vocabulary_is_a_data_error_naming_the_fix(corpus, tmp_path, capfd, workers):
    """Token ids past the model's vocabulary (a corpus prepared with a bigger tokenizer): exit 2 naming the
    corpus, the id and the fix. Before, the embedding's bounds check raised a RuntimeError traceback in
    the first forward (exit 1; a device-side assert on a GPU); from a DataLoader worker (data.num_workers
    > 0) the error came wrapped in the worker's traceback."""
    import numpy as np

    from repro.data.indexed_dataset import IndexedDatasetWriter

    with IndexedDatasetWriter(tmp_path / "wide", np.int32) as writer:
        for doc in np.random.default_rng(0).integers(0, 100_000, (50, 200)):
            writer.add_document([doc])
    rc, out = _train(capfd, {**corpus, "train": str(tmp_path / "wide")}, tmp_path / "fresh",
                     **{"data.num_workers": workers})
    assert rc == 2, out
    assert re.search(r"wide: sample \d+ of epoch 0 holds token id \d+, outside the model's 50,257-id vocabulary",
                     out), out
    assert "Fix: prepare it again with `repro data prepare --tokenizer gpt2`" in out and "Traceback" not in out, out


def test_a_bert_sequence_too_short_for_a_sentence_pair_is_refused(tmp_path, capfd):
    """model.seq_length < 8 for BERT: a config error naming the key, before anything is written (was a
    ValueError traceback from the dataset, exit 1)."""
    bert = str(ROOT / "experiments/bert/tiny_cpu.yaml")
    rc = main(["train", bert, "--set", "model.seq_length=6", "--set", f"run_dir={tmp_path / 'fresh'}",
               "--set", "tracking.enabled=false"])
    out, err = capfd.readouterr()
    assert rc == 2 and "model.seq_length=6 is too short for a BERT sentence pair: set model.seq_length >= 8" in err
    assert "Traceback" not in out + err and not (tmp_path / "fresh").exists()
