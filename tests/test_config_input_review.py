"""Numbers a run's config or command line must refuse (found by a bad-input review): an infinite learning
rate, weight decay, Adam epsilon or loss scale trained to NaN weights with exit 0; a negative or NaN
init_method_std crashed in a rank, a NaN layernorm_epsilon was blamed on the learning rate; a `--timeout`
of 0, nan or inf ended a launch in a traceback."""

from __future__ import annotations

from pathlib import Path

import pytest

from repro.cli import main

TINY = str(Path(__file__).resolve().parents[1] / "experiments/tiny/gpt_tiny.yaml")


@pytest.mark.parametrize("setting, named", [
    ("optim.lr=inf", "optim.lr=inf is not a finite number"),
    ("optim.weight_decay=inf", "optim.weight_decay=inf is not a finite number"),
    ("optim.adam_eps=inf", "optim.adam_eps=inf is not a finite number"),
    ("precision.initial_loss_scale=inf", "precision.initial_loss_scale=inf is not a finite number"),
    ("train.exit_duration_minutes=nan", "train.exit_duration_minutes=nan is not a finite number"),
    ("model.init_method_std=-1", "init_method_std=-1.0 must be a finite number >= 0"),
    ("model.init_method_std=nan", "init_method_std=nan must be a finite number >= 0"),
    ("model.layernorm_epsilon=nan", "layernorm_epsilon=nan must be a finite number > 0"),
    ("model.layernorm_epsilon=0", "layernorm_epsilon=0.0 must be a finite number > 0"),
])
def test_a_setting_that_is_not_a_usable_number_is_refused_before_training(setting, named, capsys, tmp_path):
    """Refused by the config check every launch path runs (`repro train`, `repro plan`, `slurm check`),
    before any rank starts or any file is written."""
    run = tmp_path / "run"
    assert main(["train", TINY, "--set", setting, "--set", f"run_dir={run}", "--set", "tracking.enabled=false"]) == 2
    assert named in capsys.readouterr().err
    assert main(["plan", TINY, "--gpus", "1", "--set", setting]) == 2
    assert named in capsys.readouterr().err
    assert not run.exists()


@pytest.mark.parametrize("command", [["train", TINY, "--nproc", "1"], ["selftest"]])
@pytest.mark.parametrize("timeout", ["0", "-5", "nan", "inf", "ten"])
def test_a_timeout_that_is_not_a_positive_number_of_seconds_is_refused(command, timeout, capsys):
    with pytest.raises(SystemExit) as stopped:
        main([*command, "--timeout", timeout])
    assert stopped.value.code == 2
    assert f"argument --timeout: {timeout!r} is not a positive, finite number of seconds" in capsys.readouterr().err


def test_a_demo_run_dir_that_cannot_be_a_directory_is_refused_before_the_data_steps(tmp_path, capsys):
    """`repro demo --run-dir FILE/x` fetched and prepared the data (minutes) before training refused it."""
    (tmp_path / "afile").write_text("")
    assert main(["demo", "--smoke", "--run-dir", str(tmp_path / "afile" / "x")]) == 2
    out, err = capsys.readouterr()
    assert f"{tmp_path / 'afile'} is not a directory this user can write into" in err and "Fix:" in err
    assert "1/5 fetch data" not in out


def test_a_failed_demo_step_passes_its_exit_code_on(tmp_path, monkeypatch):
    """A step that refused bad input (exit 2: here a mirror without the data) made the demo exit 1."""
    monkeypatch.setenv("REPRO_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("REPRO_DATA_MIRROR", str(tmp_path / "empty mirror"))
    (tmp_path / "empty mirror").mkdir()
    with pytest.raises(SystemExit) as stopped:
        main(["demo", "--smoke", "--run-dir", str(tmp_path / "run")])
    assert stopped.value.code == 2


@pytest.mark.parametrize("given, named", [
    (["--output-prefix", "PREFIX/"], "names a directory, and a prefix names files"),
    (["--output-prefix", "PREFIX/c", "--workers", "0"], "--workers 0: give a positive number"),
    (["--output-prefix", "PREFIX/c", "--workers", "-3"], "--workers -3: give a positive number"),
])
def test_prepare_refuses_a_directory_prefix_and_no_workers(tmp_path, capsys, given, named):
    """`--output-prefix DIR/` wrote DIR/_train.bin, DIR/_prepare.json ...; --workers 0 or -3 ran as 1."""
    (tmp_path / "in.jsonl").write_text('{"text": "a short document"}\n')
    argv = ["data", "prepare", "--input", str(tmp_path / "in.jsonl"),
            *[a.replace("PREFIX", str(tmp_path / "out")) for a in given]]
    assert main(argv) == 2
    assert named in capsys.readouterr().err
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())
