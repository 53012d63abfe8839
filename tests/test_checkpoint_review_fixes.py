"""Checkpoint review fixes: a file that is not a torch archive (text, stray bytes, empty) is a damaged
checkpoint file on resume and eval, and a damaged Megatron-LM rank file is named with the fix; meta.json
is checked before a model is built from it; a damaged file of a resharded or imported copy names the
command that made it, and a zip archive cut short says so instead of `[Errno 22] Invalid argument`."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from repro.cli import main
from repro.parallel.checks import tiny_config
from repro.parallel.spawn import run_ranks
from repro.train import reshard as rs
from repro.train.commands import train_rank
from test_checkpoint_review import _training_run, _write_checkpoint
from test_cli_errors_train import DONE, TINY, _train
from test_train_resume import _resume_error
from train_fixtures import corpus, data_dir, data_mirror, tiny_overrides  # noqa: F401

NOT_TORCH_FILES = {  # bytes torch's legacy reader fails on, and the exception it raised before the fix
    "text (KeyError)": b"hi\n",
    "a pickle STOP (IndexError)": b".",
    "a string of bad UTF-8 (UnicodeDecodeError)": b"X\x02\x00\x00\x00\xff\xfe.",
}


def _error(capfd) -> str:
    out, err = capfd.readouterr()
    return out + err


# ---- 1: bytes that are not a torch archive are a damaged checkpoint file -------------------------

@pytest.fixture(scope="module")
def tp2_run(corpus, tmp_path_factory) -> Path:  # noqa: F811
    """A TP=2 run on 2 ranks trained to iteration 2, with checkpoints at iterations 1 and 2."""
    run_dir = tmp_path_factory.mktemp("tp2_run")
    run_ranks(train_rank, 2, TINY, tiny_overrides(corpus, run_dir, **{**DONE, "parallel.tp": 2}))
    return run_dir


def test_text_over_a_tp2_shard_stops_the_resume_naming_the_file(tp2_run, corpus, tmp_path, capfd):  # noqa: F811
    """The reviewer's repro: `printf 'hi\\n' > iter_0000002/model_tp01.pt`, then resume at TP=2 on two
    ranks; before the fix the reading rank died with `KeyError: 105` (exit 1), the other in gloo."""
    run = Path(shutil.copytree(tp2_run, tmp_path / "run"))
    damaged = run / "checkpoints" / "iter_0000002" / "model_tp01.pt"
    damaged.write_bytes(b"hi\n")
    rc, out = _train(capfd, corpus, run, "--nproc", "2", **{"parallel.tp": 2, "train.train_iters": 4})
    assert rc == 2, out
    err = out.strip().splitlines()[-1]
    assert err.startswith(f"error: checkpoint file {damaged} is damaged (not a torch.save zip archive): "), out
    assert f"`echo iter_0000001 > {run / 'checkpoints' / 'latest'}`" in err, out
    assert "KeyError" not in out and "Traceback" not in out, out
    over = tiny_overrides(corpus, run, **{**DONE, "parallel.tp": 2, "train.train_iters": 4})
    errors = run_ranks(_resume_error, 2, TINY, over, timeout=120)  # each rank raises it, none waits in gloo
    assert all(f"checkpoint file {damaged} is damaged (not a torch.save zip archive)" in e for e in errors), errors


@pytest.mark.parametrize("content", NOT_TORCH_FILES.values(), ids=NOT_TORCH_FILES.keys())
def test_eval_of_a_shard_that_is_not_a_torch_archive_names_the_file(tmp_path, capfd, content):
    """`repro eval` at the saved TP reads the shard directly (load_file without mmap)."""
    ckpt = _write_checkpoint(tmp_path / "ck", tiny_config(1), tp=1)
    damaged = ckpt / "model_tp00.pt"
    damaged.write_bytes(content)
    rc = main(["eval", "wikitext", "--checkpoint", str(ckpt), "--data-dir", str(tmp_path), "--no-mlflow",
               "--out", str(tmp_path / "zero_shot.jsonl")])
    err = _error(capfd)
    assert rc == 2, err
    assert f"error: checkpoint file {damaged} is damaged (not a torch.save zip archive): " in err, err
    assert not (tmp_path / "zero_shot.jsonl").exists()


def test_an_empty_shard_says_it_is_empty(tmp_path):
    ckpt = _write_checkpoint(tmp_path / "ck", tiny_config(1), tp=1)
    (ckpt / "model_tp00.pt").write_bytes(b"")
    for load in (rs.load_full_model_state, lambda c: rs.load_model_for_eval(c, _single())):
        with pytest.raises(rs.CheckpointError, match=r"model_tp00.pt is damaged \(an empty file\): "):
            load(ckpt)


def _single():
    from repro.parallel.groups import ProcessGroups

    return ProcessGroups.single()


# ---- 2: a damaged Megatron-LM rank file ---------------------------------------------------------

@pytest.fixture(scope="module")
def megatron_tp2(tmp_path_factory) -> Path:
    from test_import_megatron import _hf_model, write_megatron

    return write_megatron(tmp_path_factory.mktemp("megatron") / "m", _hf_model(n_layer=1), tp=2)


@pytest.mark.parametrize("damage, reason", [
    (lambda b: b[:100], "PytorchStreamReader failed reading zip archive"),
    (lambda b: b"", "an empty file"),
    (lambda b: b"hi\n", "not a torch.save file"),
], ids=["cut short", "empty", "text"])
def test_a_damaged_megatron_rank_file_is_named_with_the_fix(megatron_tp2, tmp_path, capfd, damage, reason):
    source = Path(shutil.copytree(megatron_tp2, tmp_path / "m"))
    damaged = source / "release" / "mp_rank_01" / "model_optim_rng.pt"
    damaged.write_bytes(damage(damaged.read_bytes()))
    rc = main(["checkpoint", "import-megatron", str(source), "--out", str(tmp_path / "out")])
    err = _error(capfd)
    assert rc == 2, err
    assert f"error: {damaged} is damaged ({reason}" in err, err
    assert "Fix: copy it again from where Megatron-LM saved it" in err, err
    assert not (tmp_path / "out").exists()


# ---- 3: meta.json is checked before a model is built from it ------------------------------------

def _edit_meta(ckpt: Path, edit) -> None:
    meta = json.loads((ckpt / "meta.json").read_text())
    edit(meta)
    (ckpt / "meta.json").write_text(json.dumps(meta))


META_EDITS = {
    "no model": (lambda m: m.pop("model"), "meta.json is damaged (no `model`: it describes no model)"),
    "a newer field": (lambda m: m["model"].update(foo=1),
                      "meta.json: model settings ['foo'] are unknown to this checkout: the checkpoint was written by "
                      "a newer checkout of megatron-repro. Fix: update it"),
    "tp as text": (lambda m: m.update(tp="2"), "meta.json is damaged (`tp` is '2', not a positive integer)"),
    "tp 0": (lambda m: m.update(tp=0), "meta.json is damaged (`tp` is 0, not a positive integer)"),
    "model a list": (lambda m: m.update(model=[1]), "meta.json is damaged (`model` is a list, not a mapping"),
}


@pytest.mark.parametrize("edit, message", META_EDITS.values(), ids=META_EDITS.keys())
def test_a_meta_json_that_cannot_describe_the_model_is_refused(tmp_path, capfd, edit, message):
    ckpt = _write_checkpoint(tmp_path / "ck", tiny_config(2))
    _edit_meta(ckpt, edit)
    for cmd in (["reshard", str(ckpt), "--tp", "1"], ["export-megatron", str(ckpt)], ["export-hf", str(ckpt)]):
        rc = main(["checkpoint", *cmd, "--out", str(tmp_path / "out")])
        err = _error(capfd)
        assert rc == 2 and f"{ckpt / 'meta.json'}" in err and message in err, err
        assert "Traceback" not in err and not (tmp_path / "out").exists(), err
    with pytest.raises(rs.CheckpointError, match="meta.json"):
        rs.load_model_for_eval(ckpt, _single())
    with pytest.raises(rs.CheckpointError, match="meta.json"):  # `repro eval` without --tp reads it first
        from repro.eval.commands import default_eval_tp
        from repro.train.checkpoint import read_meta

        default_eval_tp(ckpt, read_meta(ckpt))


@pytest.mark.parametrize("saved, detail", [
    (lambda state: list(state.values()), "(it holds a list, not a state dict of named tensors)"),
    (lambda state: {**state, "transformer.wte.weight": 3}, "transformer.wte.weight is a int, not ("),
], ids=["a list", "a number for a tensor"])
def test_a_shard_that_is_no_state_dict_of_tensors_does_not_hold_the_model(tmp_path, capfd, saved, detail):
    ckpt = _write_checkpoint(tmp_path / "ck", tiny_config(2))
    shard = ckpt / "model_tp01.pt"
    torch.save(saved(torch.load(shard, weights_only=True)), shard)
    rc = main(["checkpoint", "reshard", str(ckpt), "--tp", "1", "--out", str(tmp_path / "out")])
    err = _error(capfd)
    assert rc == 2 and f"checkpoint file {shard} does not hold the model of" in err and detail in err, err


# ---- 4: the way back from a damaged file of a resharded or imported copy ------------------------

def test_a_damaged_file_of_a_resharded_copy_names_the_reshard_that_made_it(tmp_path, capfd):
    run = _training_run(tmp_path / "run", "run-a")
    copy = rs.reshard(run, tmp_path / "tp1", 1)
    damaged = copy / "model_tp00.pt"
    damaged.write_bytes(damaged.read_bytes()[:5000])  # where torch's zip reader said only `[Errno 22] ...`
    rc = main(["checkpoint", "reshard", str(copy), "--tp", "2", "--out", str(tmp_path / "out")])
    err = _error(capfd)
    src = run / "checkpoints" / "iter_0000002"
    assert rc == 2, err
    assert f"checkpoint file {damaged} is damaged (a torch.save zip archive cut short): re-run the reshard " \
           f"that made it (from {src}): `repro checkpoint reshard {src} --tp 1 --out NEW_DIR`" in err, err
    assert "no earlier checkpoint" not in err and "Errno 22" not in err, err


def test_a_damaged_file_of_an_imported_copy_names_the_import_that_made_it(tmp_path):
    ckpt = _write_checkpoint(tmp_path / "imported", tiny_config(1), tp=1, model_only=True,
                             imported_from="/models/megatron_345m", imported_with="import-megatron")
    (ckpt / "model_tp00.pt").write_bytes(b"hi\n")
    with pytest.raises(rs.CheckpointError, match=r"model_tp00.pt is damaged \(not a torch.save zip archive\): "
                                                 r"re-run the import-megatron that made it \(from "
                                                 r"/models/megatron_345m\) with a new --out$"):
        rs.load_model_for_eval(ckpt, _single())


# ---- a GPU run's RNG states resumed on CPU ------------------------------------------------------------

def test_a_gpu_runs_rng_states_resumed_on_cpu_are_refused_naming_the_fix(tp2_run, corpus, tmp_path, capfd):  # noqa: F811
    """A checkpoint written on GPUs holds CUDA generator states (16 bytes: seed and Philox offset), the
    TP-region tracker's among them. Resumed on CPU (train.device auto on a CPU machine), the tracker took
    that state and the first attention dropout at TP=2 failed with `Expected a CPUGeneratorImplState of
    size 5056`; now the resume is refused before a step, as a CPU run's states on a GPU already were."""
    run = Path(shutil.copytree(tp2_run, tmp_path / "run"))
    saved = run / "checkpoints" / "iter_0000002"
    cuda_state = torch.zeros(16, dtype=torch.uint8)  # the size of CUDAGeneratorImpl's get_state
    for rank_file in sorted(saved.glob("rng_rank*.pt")):
        torch.save({**torch.load(rank_file), "cuda": cuda_state, "tracker": cuda_state}, rank_file)
    rows = (run / "metrics.jsonl").read_bytes()
    rc, out = _train(capfd, corpus, run, "--nproc", "2", **{"parallel.tp": 2, "train.train_iters": 4})
    assert rc == 2, out
    assert f"error: {saved} was saved by a run on cuda and this run is on cpu" in out, out
    assert "Fix: resume on the device type it was saved on (train.device: cuda, on a GPU node)" in out, out
    assert "Traceback" not in out and (run / "metrics.jsonl").read_bytes() == rows


def test_a_cuda_default_state_beside_a_cpu_tracker_state_still_resumes_on_cpu():
    """A CPU run on a GPU node saved the GPU's default state too (before the device was checked): its
    tracker state is a CPU one, which fits."""
    from repro.parallel.random import RNGTracker
    from repro.train.checkpoint import check_rng_device

    tracker = RNGTracker(1, 0, "cpu")
    state = {"cpu": torch.get_rng_state(), "cuda": torch.zeros(16, dtype=torch.uint8), "tracker": tracker.get_state()}
    check_rng_device(state, tracker, torch.device("cpu"), Path("iter_0000001"))
