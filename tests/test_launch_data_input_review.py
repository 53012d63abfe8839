"""Bad input to `repro slurm`, `repro data fetch|verify|inspect`, `repro report`, `repro plan` and
`repro checkpoint import-megatron`: exit 2 with the problem and its fix, nothing submitted or written."""

from __future__ import annotations

from pathlib import Path

import pytest
from data_fixtures import data_mirror  # noqa: F401
from test_launch_commands import SCRIPT, _calls, sbatch  # noqa: F401  (a fake sbatch on PATH and its log)

from repro.cli import main

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "experiments" / "tiny" / "gpt_tiny.yaml")


def _refused(argv: list[str], capsys, *words: str) -> str:
    """Run `repro argv`: exit 2, and the error holds every one of `words`."""
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and all(word in err for word in words), err
    return err


@pytest.mark.parametrize("uri, words", [
    ("bogus://x", ["unknown scheme bogus://"]),
    ("sqlite:///{tmp}/junk.db", ["not a sqlite database"]),
    ("sqlite:///{tmp}/regular/x.db", ["regular is a file, not a directory", "Fix:"]),
])
def test_slurm_check_refuses_a_tracking_uri_the_job_cannot_log_into(tmp_path, monkeypatch, capsys, uri, words):
    """Before: `config ok ... tracking bogus://x` (exit 0), or a FileExistsError traceback."""
    (tmp_path / "junk.db").write_text("not a database")
    (tmp_path / "regular").write_text("a file")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri.format(tmp=tmp_path))
    _refused(["slurm", "check", TINY, "--ntasks", "1"], capsys, *words)


@pytest.mark.parametrize("kind", ["directory", "plain file"])
def test_slurm_submit_refuses_what_is_not_a_job_script(sbatch, tmp_path, capsys, kind):
    """Before: `sbatch --parsable /tmp` was run (exit 0)."""
    target = tmp_path / "notes.txt"
    if kind == "directory":
        target = tmp_path / "scripts"
        target.mkdir()
    else:
        target.write_text("train the 8B model\n")
    _refused(["slurm", "submit", str(target)], capsys, str(target), "not a job script" if kind != "directory"
             else "is a directory", "Fix:")
    assert _calls(sbatch) == []


@pytest.mark.parametrize("override, words", [
    (["--set", "foo"], ["expected KEY=VALUE"]),
    (["--set", "foo=bar"], ["Key 'foo'"]),
    (["--set=optim.lr=nan"], ["optim.lr=nan"]),
])
@pytest.mark.parametrize("command", [["sweep", "table1"], ["submit", SCRIPT]])
def test_slurm_refuses_set_overrides_the_job_would_stop_on(sbatch, capsys, command, override, words):
    """Before: every job was queued, each to fail in launch.sh's `repro slurm check`."""
    _refused(["slurm", *command, "--", "--smoke", *override], capsys, *words, "Nothing was submitted", "Fix:")
    _refused(["slurm", *command, "--", *override], capsys, *words, "Nothing was submitted")
    assert _calls(sbatch) == []


def test_data_fetch_refuses_a_directory_where_a_file_goes_and_a_file_as_mirror(data_mirror, tmp_path, capsys):
    """Before: an IsADirectoryError traceback; a mirror that is a file 'does not exist'."""
    taken = tmp_path / "data" / "vocab" / "gpt2-merges.txt"
    (taken / "kept").mkdir(parents=True)
    _refused(["data", "fetch", "--data-dir", str(tmp_path / "data"), "--mirror", str(data_mirror), "--only",
              "vocab/gpt2-merges.txt"], capsys, f"{taken} is a directory where the file", "remove it")
    assert (taken / "kept").is_dir()
    (tmp_path / "mirror").write_text("a file")
    _refused(["data", "fetch", "--data-dir", str(tmp_path / "other"), "--mirror", str(tmp_path / "mirror")],
             capsys, "is a file, not a directory")
    assert not (tmp_path / "other").exists()


def test_report_refuses_an_out_it_cannot_write(tmp_path, monkeypatch, capsys):
    """Before: a FileNotFoundError traceback from creating /proc/x."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")
    _refused(["report", "--out", "/proc/x", "--only", "scaling"], capsys, "--out /proc/x", "not writable", "Fix:")


@pytest.mark.parametrize("flags, words", [
    (["--vocab-size", "0"], ["--vocab-size 0 is not a positive count"]),
    (["--num-attention-heads", "0"], ["--num-attention-heads 0 is not a positive count"]),
    (["--vocab-size", "10"], ["--vocab-size 10 differs from the checkpoint's 50257"]),
    (["--gelu", "erf"], ["--gelu erf differs from the checkpoint's tanh"]),
])
def test_import_megatron_refuses_options_that_are_not_positive_or_contradict_the_checkpoint(tmp_path, capsys,
                                                                                           flags, words):
    """Before: 0 counted as not given; --vocab-size 10 and --gelu erf overrode the saved arguments."""
    from test_import_megatron import _hf_model, write_megatron

    write_megatron(tmp_path / "m", _hf_model(n_layer=1), openai_gelu=True)
    _refused(["checkpoint", "import-megatron", str(tmp_path / "m"), "--out", str(tmp_path / "ck"), *flags],
             capsys, *words)
    assert not (tmp_path / "ck").exists()


@pytest.mark.parametrize("content, words", [
    (bytes(range(256)), ["is not valid JSON"]),
    (b"", ["is not valid JSON"]),
    (b"[1, 2]", ["holds a JSON list, not the object"]),
])
def test_data_verify_names_a_record_that_is_not_json_or_not_an_object(tmp_path, capsys, content, words):
    """Before: 'holds no checksums (written by a prepare from before they were recorded)'."""
    (tmp_path / "c_prepare.json").write_bytes(content)
    err = _refused(["data", "verify", str(tmp_path / "c")], capsys, *words, "Fix:")
    assert "holds no checksums" not in err


def test_plan_names_a_directory_given_as_its_config(capsys):
    """Before: 'config file experiments/tiny does not exist'."""
    err = _refused(["plan", str(ROOT / "experiments" / "tiny"), "--gpus", "1"], capsys, "is a directory", "Fix:")
    assert "does not exist" not in err


def test_data_inspect_names_a_config_without_a_train_prefix(capsys):
    """Before: 'data.train_prefix  has no .idx'."""
    _refused(["data", "inspect", "--config", TINY], capsys, "sets no data.train_prefix", "Fix:")


def test_slurm_check_checkpoint_refuses_a_file_that_is_not_a_checkpoint(tmp_path, capsys):
    """Before: 'no checkpoint at ... yet' (exit 0)."""
    (tmp_path / "notes.txt").write_text("not a checkpoint")
    _refused(["slurm", "check-checkpoint", "--family", "gpt", str(tmp_path / "notes.txt")], capsys,
             f"{tmp_path / 'notes.txt'} is a file, not a checkpoint", "Fix:")
