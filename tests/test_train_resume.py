"""Issue 4: exact resume, SIGTERM, kill -9 during a checkpoint write, reshard and HF export."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from repro.parallel.spawn import run_ranks
from repro.train import checkpoint as ck
from repro.train import reshard as rs
from repro.tracking.run_dir import read_metrics
from repro.train.commands import train_rank
from train_fixtures import corpus, data_dir, data_mirror, tiny_overrides  # noqa: F401

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "experiments/tiny/gpt_tiny.yaml")
WITH_DROPOUT = {"model.hidden_dropout": 0.1, "model.attention_dropout": 0.1, "optim.lr_decay_iters": 40}


def _losses(run_dir: Path) -> dict[int, float]:
    from repro.tracking.run_dir import read_metrics

    return {row["step"]: row["loss"] for row in read_metrics(run_dir) if "loss" in row}


def _final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    latest = ck.latest_checkpoint(run_dir / "checkpoints")
    return rs.load_full_model_state(latest)[1]


def _cli(*args, env_extra=None, **kwargs) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env_extra or {})}
    return subprocess.Popen([sys.executable, "-m", "repro.cli", *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kwargs)


@pytest.fixture(scope="module")
def uninterrupted(corpus, tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("full")
    run_ranks(train_rank, 2, TINY, tiny_overrides(corpus, run_dir, **{"parallel.tp": 2, **WITH_DROPOUT,
                                                                     "train.train_iters": 40}))
    return run_dir


@pytest.fixture(scope="module")
def fifteen_iterations(corpus, tmp_path_factory):
    """A copier: copy(run_dir) fills run_dir with `uninterrupted`'s first 15 iterations, trained once
    as their own launch (train_iters=15, the schedule still over 40: optim.lr_decay_iters) and copied
    per test (each resumes or damages its copy)."""
    import shutil

    made = tmp_path_factory.mktemp("fifteen")
    run_ranks(train_rank, 2, TINY, tiny_overrides(corpus, made, **{"parallel.tp": 2, **WITH_DROPOUT,
                                                                   "train.train_iters": 15}))
    return lambda run_dir: shutil.copytree(made, run_dir, dirs_exist_ok=True)


def test_stop_and_resume_is_bit_identical(uninterrupted, fifteen_iterations, corpus, tmp_path):
    """TP=2 with dropout: 15 iterations, a new launch to 40 == one launch of 40, bit for bit."""
    over = tiny_overrides(corpus, tmp_path, **{"parallel.tp": 2, **WITH_DROPOUT})
    fifteen_iterations(tmp_path)
    run_ranks(train_rank, 2, TINY, over + ["train.train_iters=40"])
    assert _losses(tmp_path) == _losses(uninterrupted)
    want, got = _final_weights(uninterrupted), _final_weights(tmp_path)
    assert all(torch.equal(want[n], got[n]) for n in want)


@pytest.mark.parametrize("params", ["fp32", "half", "half_flat"])
def test_tp2_dp2_resume_is_bit_identical(corpus, tmp_path, params):
    """TP=2 x DP=2 (4 ranks): TP rank 1's shard is written and read by DP replica 1, TP rank 0's by
    replica 0, and broadcast to the other replica on resume; 4 iterations, then a new launch to 8,
    == one launch of 8, bit for bit (fp32; the bf16 model with fp32 masters and main grads; and that
    with the flat AdamW, whose saved masters and moments are views of its flat buffers)."""
    flat = params == "half_flat"
    over = tiny_overrides(corpus, tmp_path / "full", **{"parallel.tp": 2, **WITH_DROPOUT, "train.train_iters": 8,
                                                        "train.micro_batch_size": 2,
                                                        "precision.params": "half" if flat else params,
                                                        "precision.precision": "fp32" if params == "fp32" else "bf16",
                                                        "optim.flat_step": flat})
    run_ranks(train_rank, 4, TINY, over)
    split = [o.replace(str(tmp_path / "full"), str(tmp_path / "split")) for o in over]
    run_ranks(train_rank, 4, TINY, split + ["train.train_iters=4"])
    run_ranks(train_rank, 4, TINY, split)
    assert _losses(tmp_path / "split") == _losses(tmp_path / "full") and len(_losses(tmp_path / "full")) == 8
    want, got = _final_weights(tmp_path / "full"), _final_weights(tmp_path / "split")
    assert all(torch.equal(want[n], got[n]) for n in want)


def test_a_missing_latest_pointer_resumes_from_the_newest_complete_checkpoint(uninterrupted, fifteen_iterations,
                                                                            corpus, tmp_path):
    """`checkpoints/latest` gone (a kill between the first save's rename and its pointer, or only the
    iter_* directories copied): the relaunch resumes from the newest complete iter_* with a warning,
    == one launch of 40, every step logged once. Before, it trained again from iteration 0 and
    overwrote the earlier checkpoints."""
    over = tiny_overrides(corpus, tmp_path, **{"parallel.tp": 2, **WITH_DROPOUT})
    fifteen_iterations(tmp_path)
    (tmp_path / "checkpoints" / "latest").unlink()
    with pytest.warns(UserWarning, match="latest is missing but .*iter_0000015 is a complete checkpoint"):
        assert ck.latest_checkpoint(tmp_path / "checkpoints").name == "iter_0000015"
    run_ranks(train_rank, 2, TINY, over + ["train.train_iters=40"])
    steps = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()
             if "loss" in json.loads(line)]
    assert steps == list(range(1, 41)) and _losses(tmp_path) == _losses(uninterrupted)


def test_an_extended_run_killed_before_its_new_final_metrics_finishes_on_relaunch(corpus, tmp_path, capsys):
    """A finished run (final_metrics.json at iteration 2) extended to 4 and killed after its iteration-4
    checkpoint but before final_metrics.json was rewritten: the relaunch runs the final evaluation at 4.
    Before, the old file's presence meant "nothing to train" and the analysis kept iteration 2's numbers.
    Its valid_loss is logged at step 4 once (before, a resumed launch dropped every row of a step the
    earlier launch had logged, so the held-out loss was in final_metrics.json but not in metrics.jsonl
    or MLflow)."""
    over = tiny_overrides(corpus, tmp_path, **{"train.eval_iters": 1})
    assert train_rank(TINY, over + ["train.train_iters=2"])["iteration"] == 2
    at_two = (tmp_path / "final_metrics.json").read_text()
    train_rank(TINY, over + ["train.train_iters=4", "train.eval_interval=3"])
    out = capsys.readouterr().out
    assert "resumed from" in out and "iter_0000002 at iteration 2" in out and "validation at iteration 3: valid_loss" in out
    (tmp_path / "final_metrics.json").write_text(at_two)  # as a kill during the final evaluation leaves it
    rows = (tmp_path / "metrics.jsonl").read_text().splitlines(keepends=True)
    (tmp_path / "metrics.jsonl").write_text("".join(r for r in rows if not ('"step": 4,' in r and "valid_loss" in r)))
    final = train_rank(TINY, over + ["train.train_iters=4"])
    assert not final.get("nothing_to_train") and final["iteration"] == 4 and "valid_loss" in str(final), final
    assert json.loads((tmp_path / "final_metrics.json").read_text())["iteration"] == 4
    assert train_rank(TINY, over + ["train.train_iters=4"])["nothing_to_train"]  # now it is finished
    logged = [(row["step"], row["valid_loss"]) for row in read_metrics(tmp_path) if "valid_loss" in row]
    assert logged == [(2, logged[0][1]), (3, logged[1][1]), (4, final["valid_loss"])], logged
    assert [row["step"] for row in read_metrics(tmp_path) if "loss" in row] == [1, 2, 3, 4]


def test_the_last_steps_periodic_evaluation_is_the_final_one(corpus, tmp_path, capsys):
    """train_iters a multiple of eval_interval (every paper config: 300,000 / 1,000): the last step's
    periodic evaluation is the final one, run and logged once. Before, the final evaluation ran it
    again and logged a second, identical valid_loss row at the last step."""
    final = train_rank(TINY, tiny_overrides(corpus, tmp_path, **{"train.train_iters": 4, "train.eval_interval": 2,
                                                                  "train.eval_iters": 1}))
    assert capsys.readouterr().out.count("validation at iteration") == 2
    logged = [(row["step"], row["valid_loss"]) for row in read_metrics(tmp_path) if "valid_loss" in row]
    assert [step for step, _ in logged] == [2, 4] and logged[-1][1] == final["valid_loss"], logged
    assert json.loads((tmp_path / "final_metrics.json").read_text())["valid_loss"] == final["valid_loss"]


def _resume_error(config: str, overrides: list[str]) -> str:
    try:
        train_rank(config, overrides)
    except ck.CheckpointError as err:
        return str(err)
    return "no error"


ZERO1 = "train.zero_stage=1"
DAMAGED_SHARDS = [("parallel.tp=1", "optim_tp00.pt", 100), ("parallel.tp=2", "model_tp01.pt", 100),
                  ("parallel.tp=2", "rng_rank00001.pt", 0),
                  (ZERO1, "deepspeed/zero/zero_pp_rank_1_mp_rank_00_optim_states.pt", 300),
                  (ZERO1, "deepspeed/zero/zero_pp_rank_0_mp_rank_00_optim_states.pt", None)]


@pytest.fixture(scope="module")
def trained_two_iterations(corpus, tmp_path_factory):
    """layout -> a run dir trained 2 iterations on 2 ranks, made once per layout (tests copy it)."""
    made: dict[str, Path] = {}

    def run_dir(layout: str) -> Path:
        if layout not in made:  # recorded once trained: a failed run is not handed to the next test
            run_dir = tmp_path_factory.mktemp("two_iterations")
            over = tiny_overrides(corpus, run_dir, **{"train.micro_batch_size": 2}) + [layout]
            run_ranks(train_rank, 2, TINY, over + ["train.train_iters=2"])
            made[layout] = run_dir
        return made[layout]
    return run_dir


@pytest.mark.parametrize("layout, damaged_file, keep", DAMAGED_SHARDS, ids=lambda v: str(v).split("/")[-1])
def test_a_damaged_shard_stops_every_rank_with_the_file_named(corpus, tmp_path, trained_two_iterations, layout,
                                                              damaged_file, keep):
    """At DP=2 only the owner replica reads the optimizer file and broadcasts it; at TP=2 each TP rank
    reads its own model file; each rank its RNG file; under ZeRO each DP rank its DeepSpeed optimizer
    partition. When one file is cut short (to `keep` bytes) or missing (None), every rank raises a
    CheckpointError naming it and the way back (the owner's peers and the other ranks too) instead of
    waiting in a collective, or, for ZeRO, a raw DeepSpeed traceback on one rank."""
    import shutil

    shutil.copytree(trained_two_iterations(layout), tmp_path, dirs_exist_ok=True)
    over = tiny_overrides(corpus, tmp_path, **{"train.micro_batch_size": 2}) + [layout]
    damaged = ck.latest_checkpoint(tmp_path / "checkpoints") / damaged_file
    if keep is None:
        damaged.unlink()
    else:
        damaged.write_bytes(damaged.read_bytes()[:keep])
    errors = run_ranks(_resume_error, 2, TINY, over + ["train.train_iters=4"], timeout=120)
    assert all(str(damaged) in e and "damaged" in e and "start again in a new run_dir" in e for e in errors), errors


def _replicated(path: str) -> dict:
    from repro.parallel.groups import ParallelDims, build_process_groups

    pg = build_process_groups(ParallelDims(tp=1, dp=2))
    return ck.load_replicated(Path(path), pg, torch.device("cpu"))


def test_replicated_load_sends_views_whole_and_keeps_state_dict_metadata(tmp_path):
    from collections import OrderedDict

    state = OrderedDict(w=torch.arange(6.0).reshape(2, 3).t(), step=torch.tensor(3.0), betas=(0.9, 0.95))
    state._metadata = OrderedDict({"": {"version": 2}})
    torch.save(state, tmp_path / "s.pt")
    for got in run_ranks(_replicated, 2, str(tmp_path / "s.pt")):
        assert torch.equal(got["w"], state["w"]) and got["step"] == 3.0 and got["betas"] == (0.9, 0.95)
        assert type(got) is OrderedDict and got._metadata == state._metadata


# A sitecustomize.py for `repro train --nproc 2`: every process imports it at startup, the fork server
# the ranks fork from too, so each rank holds in its third training step until the test, having sent
# its signals, creates `go`. The signal then lands during step 3 whatever the machine's load (sent
# when 3 metrics rows had appeared, it raced the run to its last step, and a slow start to a deadline).
_HOLD_IN_STEP_3 = """
import os, time, warnings
from pathlib import Path

if os.environ.get("HOLD_DIR"):
    # runpy's note when `-m repro.cli` (or the fork server's copy of it) runs after this imported it
    warnings.filterwarnings("ignore", message="'repro.cli' found in sys.modules")
    from repro.train import loop

    step, hold, calls = loop.train_step, Path(os.environ["HOLD_DIR"]), []

    def held_step(eng, batches):
        calls.append(None)
        if len(calls) == 3:
            (hold / f"tmp{eng.pg.rank}").write_text(str(os.getpid()))  # rank<r> holds its pid, whole
            os.replace(hold / f"tmp{eng.pg.rank}", hold / f"rank{eng.pg.rank}")
            while not (hold / "go").exists():
                time.sleep(0.01)
        return step(eng, batches)

    loop.train_step = held_step
"""


@pytest.mark.parametrize("signame, workers", [("SIGTERM", 0), ("SIGTERM", 2), ("SIGUSR1", 2)])
def test_a_stop_signal_saves_and_resumes(uninterrupted, corpus, tmp_path, signame, workers):
    """SIGTERM, or Slurm's USR1 warning, to every process (srun delivers USR1 to every process of the
    step, loader workers too; a batch step's TERM reaches them all) during step 3: a checkpoint at 3,
    clean exit (0); the next launch finishes identically. With workers, this run's samples come from
    2 loader processes per rank, the uninterrupted run's from none: the same losses."""
    hold = tmp_path / "hold"
    hold.mkdir()
    (hold / "sitecustomize.py").write_text(_HOLD_IN_STEP_3)
    pythonpath = os.pathsep.join(p for p in (str(hold), os.environ.get("PYTHONPATH")) if p)
    over = tiny_overrides(corpus, tmp_path / "run", **{"parallel.tp": 2, **WITH_DROPOUT, "train.train_iters": 40,
                                                          "data.num_workers": workers})
    proc = _cli("train", TINY, "--nproc", "2", *sum((["--set", o] for o in over), []),
                env_extra={"HOLD_DIR": str(hold), "PYTHONPATH": pythonpath})
    deadline = time.time() + 240
    while not all((hold / f"rank{r}").exists() for r in (0, 1)) and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    assert proc.poll() is None and time.time() < deadline, "the ranks never reached step 3"
    for child in _children(proc.pid):
        os.kill(child, getattr(signal, signame))  # every process: ranks (and their loader workers)
    (hold / "go").touch()
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out
    assert ck.latest_checkpoint(tmp_path / "run" / "checkpoints").name == "iter_0000003", out
    assert (tmp_path / "run" / "stopped_by_signal").read_text() == "3"
    run_ranks(train_rank, 2, TINY, over)
    assert _losses(tmp_path / "run") == _losses(uninterrupted)



def test_the_exit_duration_checkpoints_and_the_next_launch_finishes_identically(uninterrupted, corpus, tmp_path,
                                                                                capfd):
    """train.exit_duration_minutes (Megatron's --exit-duration-in-mins) stops like Slurm's warning:
    a checkpoint after the step in which the time ran out, the requeue marker, exit 0; the next
    launch, without the limit (safe to change on resume), finishes as if never stopped."""
    over = tiny_overrides(corpus, tmp_path, **{"parallel.tp": 2, **WITH_DROPOUT, "train.train_iters": 40})
    finals = run_ranks(train_rank, 2, TINY, over + ["train.exit_duration_minutes=1e-9"])
    assert [(f["stopped_by_signal"], f["iteration"]) for f in finals] == [(True, 1), (True, 1)]
    assert "stopping at iteration 1 (train.exit_duration_minutes=1e-09 passed)" in capfd.readouterr().out
    assert (tmp_path / "stopped_by_signal").read_text() == "1"
    run_ranks(train_rank, 2, TINY, over)
    assert _losses(tmp_path) == _losses(uninterrupted)


def _stop_views(exit_after_s: list[float]) -> tuple[bool, bool]:
    """(this rank's own view, the agreed one) of a StopSignal whose exit duration is this rank's entry."""
    import torch.distributed as dist

    from repro.train.loop import StopSignal

    with StopSignal(dist.group.WORLD, exit_after_s[dist.get_rank()]) as stop:
        time.sleep(0.01)
        return stop.due(), stop.agreed(torch.device("cpu"))


def test_one_ranks_exit_duration_stops_every_rank():
    """The ranks' clocks and start times differ: the first rank past its duration stops them all."""
    assert run_ranks(_stop_views, 2, [1e-6, 3600.0]) == [(True, True), (False, True)]
    assert run_ranks(_stop_views, 2, [0.0, 3600.0]) == [(False, False), (False, False)]


def test_resuming_under_other_code_says_so(corpus, tmp_path, capfd):
    over = tiny_overrides(corpus, tmp_path, **{"train.train_iters": 2})
    run_ranks(train_rank, 1, TINY, over)
    meta_path = ck.latest_checkpoint(tmp_path / "checkpoints") / "meta.json"
    meta = json.loads(meta_path.read_text())
    meta["git_sha"] = "0" * 40
    meta_path.write_text(json.dumps(meta))
    capfd.readouterr()
    run_ranks(train_rank, 1, TINY, tiny_overrides(corpus, tmp_path, **{"train.train_iters": 3}))
    out = capfd.readouterr().out
    assert f"(written at git {'0' * 40}) with code at git" in out, out


def test_resuming_at_another_dp_size_says_it_is_close_not_exact(corpus, tmp_path, capfd):
    """Saved at dp=1, resumed at dp=2 (no dropout: the masks are what would differ): the note, and the
    losses of the resumed iterations within 1e-4 of a dp=1 run's (fp32; only the summation order of the
    gradient all-reduce and of the micro batches differs)."""
    over = tiny_overrides(corpus, tmp_path / "one", **{"train.train_iters": 4, "train.micro_batch_size": 2})
    run_ranks(train_rank, 1, TINY, over)
    moved = [o.replace(str(tmp_path / "one"), str(tmp_path / "moved")) for o in over]
    run_ranks(train_rank, 1, TINY, moved + ["train.train_iters=2"])
    capfd.readouterr()
    run_ranks(train_rank, 2, TINY, moved)
    out = capfd.readouterr().out
    assert "note: saved at dp=1, resumed at dp=2" in out and "closely, not exactly" in out, out
    want, got = _losses(tmp_path / "one"), _losses(tmp_path / "moved")
    assert sorted(got) == [1, 2, 3, 4] and all(abs(got[i] - want[i]) < 1e-4 for i in want), (want, got)


def _signalled_when_called(target: str, config: str, overrides: list[str]) -> dict:
    """A rank that gets SIGUSR1 as `target` ("module:function") is called: before the trainer exists
    (repro.train.config:load_config) or while its engine is built (repro.train.loop:build_engine).
    Slurm's warning can come that early."""
    import importlib

    module_name, name = target.split(":")
    module = importlib.import_module(module_name)
    original = getattr(module, name)

    def signal_then_call(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGUSR1)  # the default action would kill the process
        return original(*args, **kwargs)

    setattr(module, name, signal_then_call)
    return train_rank(config, overrides)


def test_a_signal_during_setup_checkpoints_after_the_first_step(corpus, tmp_path):
    over = tiny_overrides(corpus, tmp_path, **{"train.train_iters": 10})
    final = run_ranks(_signalled_when_called, 1, "repro.train.loop:build_engine", TINY, over)[0]
    assert final["stopped_by_signal"] and final["iteration"] == 1
    assert (tmp_path / "stopped_by_signal").read_text() == "1"
    assert ck.latest_checkpoint(tmp_path / "checkpoints").name == "iter_0000001"


def test_a_signal_before_the_trainer_starts_is_kept_until_it_can_checkpoint(corpus, tmp_path):
    over = tiny_overrides(corpus, tmp_path, **{"train.train_iters": 10})
    final = run_ranks(_signalled_when_called, 1, "repro.train.config:load_config", TINY, over, timeout=90)[0]
    assert final["stopped_by_signal"] and final["iteration"] == 1
    assert ck.latest_checkpoint(tmp_path / "checkpoints").name == "iter_0000001"


def _signalled_during_step_3(config: str, overrides: list[str]) -> dict:
    """A rank that gets SIGUSR1 during its third training step."""
    from repro.train import loop

    step, calls = loop.train_step, []

    def step_and_signal(eng, batches):
        calls.append(None)
        if len(calls) == 3:
            os.kill(os.getpid(), signal.SIGUSR1)
        return step(eng, batches)

    loop.train_step = step_and_signal
    return train_rank(config, overrides)


def test_a_stop_signal_skips_the_due_evaluation_and_checkpoints(corpus, tmp_path):
    # Evaluation is due at iteration 3; the signal came during that step: straight to the checkpoint.
    over = tiny_overrides(corpus, tmp_path, **{"train.train_iters": 10, "train.eval_interval": 3,
                                                 "train.eval_iters": 4})
    final = run_ranks(_signalled_during_step_3, 1, TINY, over)[0]
    assert final["stopped_by_signal"] and final["iteration"] == 3
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert not [r for r in rows if "valid_loss" in r], rows
    assert ck.latest_checkpoint(tmp_path / "checkpoints").name == "iter_0000003"


def _signalled_during_a_periodic_save(config: str, overrides: list[str]) -> tuple[list[int], dict]:
    """A rank that gets SIGUSR1 while its iteration-4 periodic checkpoint is being written."""
    from repro.train import loop

    save, calls = loop.save, []

    def save_and_signal(eng, state, run_id):
        calls.append(state.iteration)
        if state.iteration == 4:
            os.kill(os.getpid(), signal.SIGUSR1)
        return save(eng, state, run_id)

    loop.save = save_and_signal
    return calls, train_rank(config, overrides)


def test_a_signal_during_a_periodic_save_does_not_save_that_iteration_again(corpus, tmp_path):
    """The stop path skips the save when `latest` already names the iteration (as the end of training
    does): no second full write in Slurm's grace period, and no rewrite of the checkpoint `latest` names."""
    over = tiny_overrides(corpus, tmp_path, **{"train.train_iters": 10, "train.save_interval": 2})
    calls, final = run_ranks(_signalled_during_a_periodic_save, 1, TINY, over)[0]
    assert calls == [2, 4] and final["stopped_by_signal"] and final["iteration"] == 4
    ckpts = tmp_path / "checkpoints"
    assert ck.latest_checkpoint(ckpts).name == "iter_0000004" and (tmp_path / "stopped_by_signal").read_text() == "4"
    assert sorted(p.name for p in ckpts.iterdir()) == ["iter_0000002", "iter_0000004", "latest"]


class _Killed(BaseException):
    """Stands for a SIGKILL landing right after a deletion."""


@pytest.mark.parametrize("killed_after", [1, 2])
def test_saving_the_iteration_latest_names_again_always_leaves_a_complete_one(tmp_path, monkeypatch, killed_after):
    """finish_save over the checkpoint `latest` names renames the old copy aside and deletes it only
    after the new one is in place and `latest` rewritten: a kill after any deletion leaves `latest`
    naming a complete checkpoint (before, it deleted the old copy first: `latest` named nothing)."""
    import json
    import shutil

    from repro.parallel.groups import ProcessGroups

    pg, root = ProcessGroups.single(), tmp_path / "checkpoints"
    for version in ("old", "new"):
        tmp = ck.begin_save(root, 4, pg)
        (tmp / "meta.json").write_text(json.dumps({"tp": 1, "version": version}))
        if version == "old":
            ck.finish_save(root, 4, pg)
    rmtree, deleted = shutil.rmtree, []

    def rmtree_then_killed(path, *args, **kwargs):
        rmtree(path, *args, **kwargs)
        deleted.append(path)
        if len(deleted) == killed_after:
            raise _Killed

    monkeypatch.setattr(ck.shutil, "rmtree", rmtree_then_killed)
    with pytest.raises(_Killed):
        ck.finish_save(root, 4, pg)
    monkeypatch.undo()
    assert ck.read_meta(ck.latest_checkpoint(root))["version"] == ("old", "new")[killed_after - 1]
    tmp = ck.begin_save(root, 4, pg)  # and the next save of it cleans up
    (tmp / "meta.json").write_text(json.dumps({"tp": 1, "version": "newer"}))
    ck.finish_save(root, 4, pg)
    assert ck.read_meta(ck.latest_checkpoint(root))["version"] == "newer"
    assert sorted(p.name for p in root.iterdir()) == ["iter_0000004", "latest"]


def test_a_save_is_on_disk_before_latest_names_it_and_clears_what_kills_left(tmp_path, monkeypatch):
    """finish_save fsyncs every file and directory of the new checkpoint before `latest` is rewritten
    (os.fsync watched, not replaced: the calls are real), then removes the .tmp/.old directories of
    other iterations that kills left behind (they used to stay, a full checkpoint's size each)."""
    import json

    from repro.parallel.groups import ProcessGroups

    pg, root = ProcessGroups.single(), tmp_path / "checkpoints"
    for leftover in ("iter_0000002.tmp", "iter_0000003.old", "iter_0000009.tmp"):
        (root / leftover / "deepspeed").mkdir(parents=True)
        (root / leftover / "deepspeed" / "part.pt").write_bytes(b"half")
    tmp = ck.begin_save(root, 4, pg)
    (tmp / "deepspeed").mkdir()
    for name in ("meta.json", "model_tp00.pt", "deepspeed/zero.pt"):
        (tmp / name).write_text(json.dumps({"tp": 1}))
    fsync, synced = os.fsync, []

    def watched(fd):
        fsync(fd)
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))

    monkeypatch.setattr(ck.os, "fsync", watched)
    ck.finish_save(root, 4, pg)
    monkeypatch.undo()
    files = {str(tmp / n) for n in ("meta.json", "model_tp00.pt", "deepspeed/zero.pt", "deepspeed")} | {str(tmp)}
    assert files <= set(synced[:len(files)]), synced  # all before the rename that publishes them
    latest_tmp = next(i for i, path in enumerate(synced) if Path(path).name.startswith(".latest."))  # write_atomic's
    assert latest_tmp > len(files)
    assert sorted(p.name for p in root.iterdir()) == ["iter_0000004", "latest"]


def _fake_save(root: Path, iteration: int, keep: int) -> None:
    from repro.parallel.groups import ProcessGroups

    pg = ProcessGroups.single()
    tmp = ck.begin_save(root, iteration, pg)
    (tmp / "meta.json").write_text('{"tp": 1}')
    ck.finish_save(root, iteration, pg, keep=keep)


def test_keep_checkpoints_removes_all_but_the_newest_once_a_save_is_complete(tmp_path):
    root = tmp_path / "checkpoints"
    for iteration in range(1, 6):
        _fake_save(root, iteration, keep=2)
    assert sorted(p.name for p in root.iterdir()) == ["iter_0000004", "iter_0000005", "latest"]
    _fake_save(root, 6, keep=0)  # 0: keep every one
    _fake_save(root, 7, keep=1)
    assert sorted(p.name for p in root.iterdir()) == ["iter_0000007", "latest"]


def test_keep_checkpoints_leaves_those_past_the_checkpoint_latest_was_pointed_back_to(tmp_path):
    """`echo iter_0000002 > latest` (back before a divergence), then saves at 3 and 4 with keep 1: the
    abandoned 5 and 6 stay (counted out; saves at 5 and 6 would replace them), 2 and 3 go."""
    root = tmp_path / "checkpoints"
    for iteration in (2, 5, 6):
        _fake_save(root, iteration, keep=0)
    (root / "latest").write_text("iter_0000002")
    for iteration in (3, 4):
        _fake_save(root, iteration, keep=1)
    assert sorted(p.name for p in root.iterdir()) == ["iter_0000004", "iter_0000005", "iter_0000006", "latest"]
    assert ck.latest_checkpoint(root) == root / "iter_0000004"


def test_a_checkpoint_keep_checkpoints_cannot_remove_stays_with_a_warning(tmp_path):
    """The save is complete when pruning starts: a checkpoint that cannot be removed (here a stray file
    where it would be set aside) is left with a warning, never a failed run after a good save."""
    root = tmp_path / "checkpoints"
    _fake_save(root, 1, keep=0)
    (root / "iter_0000001.old").write_text("not a directory")
    with pytest.warns(UserWarning, match=r"keep_checkpoints=1: could not remove .*iter_0000001 .*it stays"):
        _fake_save(root, 2, keep=1)
    assert ck.latest_checkpoint(root) == root / "iter_0000002" and (root / "iter_0000001" / "meta.json").is_file()


def test_a_run_keeping_two_checkpoints_resumes_from_the_newest(corpus, tmp_path):
    from repro.parallel.groups import ProcessGroups
    from repro.train.config import load_config
    from repro.train.loop import train

    def launch(iters: int) -> dict:
        over = tiny_overrides(corpus, tmp_path, **{"train.train_iters": iters, "train.save_interval": 1,
                                                   "train.keep_checkpoints": 2, "train.eval_iters": 1})
        return train(load_config(TINY, over), ProcessGroups.single())

    assert launch(4)["iteration"] == 4
    root = tmp_path / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["iter_0000003", "iter_0000004", "latest"]
    assert launch(6)["iteration"] == 6
    assert sorted(p.name for p in root.iterdir()) == ["iter_0000005", "iter_0000006", "latest"]


def test_a_checkpoint_of_a_newer_format_is_refused_naming_the_fix(tmp_path):
    (tmp_path / "meta.json").write_text('{"tp": 1, "format": 2}')
    with pytest.raises(ck.CheckpointError, match="format 2 is newer than this checkout reads.*git pull"):
        ck.read_meta(tmp_path)


def test_the_callers_signal_handlers_are_back_after_training(corpus, tmp_path):
    """The trainer takes SIGTERM/SIGUSR1 only while it trains (a notebook or a sweep calling train()
    keeps its own handlers)."""
    from repro.parallel.groups import ProcessGroups
    from repro.train.config import load_config
    from repro.train.loop import train

    def mine(signum, frame):
        pass

    saved = {sig: signal.signal(sig, mine) for sig in (signal.SIGTERM, signal.SIGUSR1)}
    try:
        final = train(load_config(TINY, tiny_overrides(corpus, tmp_path, **{"train.train_iters": 2})),
                      ProcessGroups.single())
        assert final["iteration"] == 2
        assert signal.getsignal(signal.SIGTERM) is mine and signal.getsignal(signal.SIGUSR1) is mine
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)

def _children(pid: int) -> list[int]:
    import psutil

    return [c.pid for c in psutil.Process(pid).children(recursive=True)]


# Run `repro train` in a child that SIGKILLs itself right after the first file of checkpoint
# iteration `KILL_AT` lands in its .tmp directory: a real kill -9 mid-write, at a fixed point (polling
# from outside raced the rename on a loaded CI machine).
_DIE_MID_SAVE = """
import os, signal, sys, torch
from pathlib import Path
from repro.cli import main
from repro.train.checkpoint import iter_name

target, save = iter_name(int(os.environ["KILL_AT"])) + ".tmp", torch.save

def save_then_die(obj, f, *args, **kwargs):
    save(obj, f, *args, **kwargs)
    if Path(str(f)).parent.name == target:
        os.kill(os.getpid(), signal.SIGKILL)

torch.save = save_then_die
sys.exit(main(sys.argv[1:]))
"""


def test_kill_9_during_checkpoint_write_leaves_previous_loadable(corpus, tmp_path):
    run_dir, kill_at = tmp_path / "run", 3
    over = tiny_overrides(corpus, run_dir, **{"train.save_interval": 1, "train.train_iters": 6})
    env = {**os.environ, "OMP_NUM_THREADS": "1", "KILL_AT": str(kill_at)}
    done = subprocess.run([sys.executable, "-c", _DIE_MID_SAVE, "train", TINY, *sum((["--set", o] for o in over), [])],
                          env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == -signal.SIGKILL, done.stdout[-2000:] + done.stderr[-2000:]
    ckpts = run_dir / "checkpoints"
    latest = ck.latest_checkpoint(ckpts)
    assert latest is not None and latest.name == ck.iter_name(kill_at - 1)
    assert [p.name for p in ckpts.glob("iter_*.tmp")] == [ck.iter_name(kill_at) + ".tmp"]  # the half-written one
    assert ck.read_meta(latest)["iteration"] == kill_at - 1
    from repro.parallel.groups import ProcessGroups

    model = rs.load_model_for_eval(latest, ProcessGroups.single())
    assert model(torch.zeros(1, 8, dtype=torch.long))[..., :50257].isfinite().all()
    run_ranks(train_rank, 1, TINY, over + [f"train.train_iters={kill_at + 1}"])  # the run resumes from it
    assert ck.latest_checkpoint(ckpts).name == ck.iter_name(kill_at + 1) and not list(ckpts.glob("iter_*.tmp"))
    steps = [row["step"] for row in read_metrics(run_dir) if "loss" in row]
    assert steps == list(range(1, kill_at + 2))  # the redone iteration logged once (a row per step)


def _logits_worker(ckpt: str, tp: int) -> list:
    import torch.distributed as dist

    from repro.parallel.groups import ParallelDims, build_process_groups
    from repro.parallel.mappings import gather_from_tensor_parallel_region

    pg = build_process_groups(ParallelDims(tp, dist.get_world_size() // tp))
    model = rs.load_model_for_eval(ckpt, pg)
    ids = torch.arange(32).view(2, 16) * 97 % 50257
    with torch.no_grad():
        return gather_from_tensor_parallel_region(model(ids), pg.tp_group)[..., :50257].tolist()


def test_reshard_and_hf_export_keep_outputs(uninterrupted, tmp_path):
    """TP=2 -> TP=1 -> TP=2 and the Hugging Face export: logits equal within 1e-5 (fp32 sums)."""
    src = ck.resolve(uninterrupted)
    assert ck.resolve(uninterrupted / "checkpoints" / "latest") == src  # the README's spelling
    ref = torch.tensor(run_ranks(_logits_worker, 2, str(src), 2)[0])
    one = rs.reshard(src, tmp_path / "tp1", 1)
    two = rs.reshard(one, tmp_path / "tp2", 2)
    tp1 = torch.tensor(run_ranks(_logits_worker, 1, str(one), 1)[0])
    tp2 = torch.tensor(run_ranks(_logits_worker, 2, str(two), 2)[0])
    scale = ref.abs().max()
    assert (tp1 - ref).abs().max() / scale < 1e-5 and (tp2 - ref).abs().max() / scale < 1e-5
    proc = _cli("checkpoint", "export-hf", str(src), "--out", str(tmp_path / "hf"))
    assert proc.wait(timeout=300) == 0, proc.stdout.read()
    from transformers import GPT2LMHeadModel

    hf = GPT2LMHeadModel.from_pretrained(tmp_path / "hf").eval()
    with torch.no_grad():
        theirs = hf(torch.arange(32).view(2, 16) * 97 % 50257).logits
    assert (theirs - ref).abs().max() / scale < 1e-5


def test_latest_falls_back_to_the_copy_set_aside(tmp_path):
    """A kill between finish_save's two renames leaves `latest` naming a missing directory and the
    complete copy at iter_N.old: resume reads that copy instead of failing."""
    root = tmp_path / "checkpoints"
    (root / "iter_0000004.old").mkdir(parents=True)
    (root / "iter_0000004.old" / "meta.json").write_text("{}")
    (root / "latest").write_text("iter_0000004")
    assert ck.latest_checkpoint(root) == root / "iter_0000004.old"
    (root / "iter_0000004.old" / "meta.json").unlink()
    with pytest.raises(ck.CheckpointError, match="no meta.json"):
        ck.latest_checkpoint(root)


# `repro train` as a launched rank (RANK/WORLD_SIZE set, as srun's task.sh and torchrun set them) that
# gets SIGUSR1 the moment it starts importing torch: Slurm's warning, or a manual stop, in the first
# seconds of a (requeued) step. Deterministic: the signal is sent by an import hook, not a timer.
_SIGNAL_AT_TORCH_IMPORT = """
import importlib.abc, os, signal, sys

class SignalOnTorch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "torch":
            sys.meta_path.remove(self)
            os.kill(os.getpid(), signal.SIGUSR1)
        return None

sys.meta_path.insert(0, SignalOnTorch())
from repro.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_a_signal_while_torch_imports_is_kept_until_the_rank_can_checkpoint(corpus, tmp_path):
    """Building the CLI's parser imports torch (seconds; minutes from shared storage on 512 ranks):
    a USR1 then killed every rank, so the job FAILED with no checkpoint and no requeue. The launched
    rank now records it from main()'s first line and stops after the first step, checkpointed."""
    from repro.parallel.spawn import free_port

    run_dir = tmp_path / "run"
    over = tiny_overrides(corpus, run_dir, **{"train.train_iters": 10})
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    done = subprocess.run([sys.executable, "-c", _SIGNAL_AT_TORCH_IMPORT, "train", TINY,
                           *sum((["--set", o] for o in over), [])], env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, (done.returncode, done.stdout[-2000:] + done.stderr[-2000:])
    assert (run_dir / "stopped_by_signal").read_text() == "1"
    assert ck.latest_checkpoint(run_dir / "checkpoints").name == "iter_0000001"
