"""Bad input to `repro eval`, `repro generate`, `repro tracking sync` and `repro finetune race --vocab` is a
clear error naming the problem and the fix, exit 2, and nothing already written changes: an --out that is
not eval records, an existing generate --out, a bad MLFLOW_TRACKING_URI, unreadable or undecodable
files, conflicting generate options, and a --stride out of range."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from conftest import require
from eval_helpers import mirror, write_tiny_checkpoint
from test_eval_input_errors import _bert_config, _race_argv

UNREADABLE = Path("/proc/1/mem")  # a regular file that even root cannot read(): PermissionError


def _cli(capsys, *argv) -> tuple[int, str, str]:
    from repro.cli import main

    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(autouse=True)
def _store(tmp_path, monkeypatch) -> None:
    """A fresh sqlite store (absent until written) for every test."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """A training run directory holding a tiny untrained GPT checkpoint."""
    run_dir = tmp_path_factory.mktemp("gpt") / "run"
    write_tiny_checkpoint(run_dir, seq_length=64, num_layers=1)
    return run_dir


def _eval(capsys, run: Path, task: str, *extra) -> tuple[int, str, str]:
    size = ("--max-examples", "2") if task == "lambada" else ("--window", "64", "--stride", "64", "--max-lines", "20")
    return _cli(capsys, "eval", task, "--checkpoint", run, "--data-dir", mirror(), *size, *extra)


def _unreadable() -> Path:
    try:
        UNREADABLE.read_bytes()
    except OSError:
        return UNREADABLE
    require(False, f"a file this user cannot read ({UNREADABLE} is readable here)")


def test_eval_out_that_is_not_eval_records_is_refused_and_left_as_it_is(run, tmp_path, capsys):
    out = tmp_path / "notes.txt"
    for content in (b"my notes\nresult table: keep this line", b"model:\n  num_layers: 1\n",
                    b'{"model": {"num_layers": 1}}\n', b"one line, no newline"):
        out.write_bytes(content)
        code, printed, err = _eval(capsys, run, "lambada", "--no-mlflow", "--out", out)
        assert code == 2 and f"--out {out}" in err and "choose another --out" in err, err
        assert out.read_bytes() == content and "lambada" not in printed  # refused before evaluating
    records = tmp_path / "zero_shot.jsonl"  # earlier records with a killed write's partial line: appended to
    assert _eval(capsys, run, "lambada", "--no-mlflow", "--out", records)[0] == 0
    with open(records, "a") as handle:
        handle.write('{"metrics": {"acc')
    with pytest.warns(UserWarning, match="dropped an unfinished last line"):
        assert _eval(capsys, run, "lambada", "--no-mlflow", "--out", records)[0] == 0
    assert [json.loads(line)["task"] for line in records.read_text().splitlines()] == ["lambada", "lambada"]


def test_generate_refuses_an_existing_out_unless_overwrite(run, tmp_path, capsys):
    out = tmp_path / "samples.json"
    out.write_bytes(b"earlier samples, kept")
    base = ("generate", "--checkpoint", run, "--data-dir", mirror(), "--max-new-tokens", "1", "--out", out)
    code, printed, err = _cli(capsys, *base)
    assert code == 2 and f"--out {out} already exists" in err and "--overwrite" in err and "Fix:" in err, err
    assert out.read_bytes() == b"earlier samples, kept" and "=== sample" not in printed
    assert _cli(capsys, *base, "--overwrite")[0] == 0
    assert json.loads(out.read_text())["samples"]


def _sync_run_dir(path: Path) -> Path:
    path.mkdir()
    (path / "params.json").write_text('{"lr": 0.1}')
    (path / "tags.json").write_text('{"experiment": "review", "run_name": "r"}')
    (path / "metrics.jsonl").write_text('{"step": 1, "time": 1733300000.0, "loss": 7.1}\n')
    return path


def _records_file(path: Path) -> Path:
    from repro.eval.report import EvalRecord, write_json

    write_json(EvalRecord("lambada", {"acc": 0.5}, {"strict": True}, time=1733300000.0), path)
    return path


@pytest.mark.parametrize("uri, message", [
    ("bogus://x", "has the unknown scheme bogus://"),
    ("sqlite:///{tmp}/random.bin", "which is not a sqlite database"),
    ("{tmp}/emptydir/st", "is a path, not a URI"),
])
@pytest.mark.parametrize("command", ["eval", "sync file", "sync run dir"])
def test_a_bad_tracking_uri_exits_2_before_scoring_or_reading(run, tmp_path, capsys, monkeypatch, uri, message,
                                                             command):
    (tmp_path / "random.bin").write_bytes(os.urandom(2000))
    (tmp_path / "emptydir").mkdir()
    uri = uri.format(tmp=tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    if command == "eval":
        out = tmp_path / "o.jsonl"
        code, printed, err = _eval(capsys, run, "wikitext", "--out", out)
        assert not out.exists() and "wikitext" not in printed and "--no-mlflow" in err, err
    else:
        target = _records_file(tmp_path / "z.jsonl") if command == "sync file" else _sync_run_dir(tmp_path / "r")
        code, _, err = _cli(capsys, "tracking", "sync", target)
        assert not (tmp_path / "r" / "mlflow_run_id").exists()
    assert code == 2 and message in err and uri in err and "Fix:" in err, err


def _random_bytes(path: Path) -> Path:
    path.write_bytes(bytes(range(128, 256)) * 16)  # not UTF-8 from its first byte
    return path


@pytest.mark.parametrize("case, message", [
    ("generate --prompt-file UNREADABLE", "cannot be read"),
    ("eval wikitext --file UNREADABLE", "cannot be read"),
    ("tracking sync UNREADABLE", "cannot be read"),
    ("tracking sync RANDOM", "is not UTF-8 text"),
    ("finetune race --vocab RANDOM", "is not a readable WordPiece vocabulary"),
    ("finetune race --vocab EMPTY", "has no [UNK] token"),
])
def test_unreadable_or_undecodable_input_names_the_file_and_the_fix(run, tmp_path, capsys, case, message):
    files = {"UNREADABLE": _unreadable() if "UNREADABLE" in case else None,
             "RANDOM": _random_bytes(tmp_path / "random.bin"), "EMPTY": tmp_path / "empty.txt"}
    files["EMPTY"].write_bytes(b"")
    *words, name = case.split()
    bad = files[name]
    if words[0] == "generate":
        argv = [*words, bad, "--checkpoint", run, "--data-dir", mirror()]
    elif words[0] == "eval":
        argv = [*words, bad, "--checkpoint", run, "--data-dir", mirror(), "--no-mlflow", "--out", tmp_path / "o.jsonl"]
    elif words[0] == "tracking":
        argv = [*words, bad]
    else:
        argv = _race_argv(tmp_path, _bert_config(tmp_path / "model.yaml", 4), *words[2:], bad)
    code, printed, err = _cli(capsys, *argv)
    assert code == 2 and str(bad) in err and message in err and "Fix:" in err, err
    assert not (tmp_path / "o.jsonl").exists() and not (tmp_path / "run").exists() and "=== sample" not in printed


@pytest.mark.parametrize("extra, message", [
    (("--prompt", "x", "--prompt-file", "PROMPT"), "--prompt and --prompt-file"),
    (("--greedy", "--temperature", "0.5"), "--temperature 0.5 would be ignored"),
    (("--greedy", "--top-k", "5"), "--top-k 5 would be ignored"),
    (("--greedy", "--top-p", "0.9"), "--top-p 0.9 would be ignored"),
    (("--greedy", "--temperature", "nan"), "--temperature nan would be ignored"),
])
def test_generate_options_that_conflict_are_refused(run, tmp_path, capsys, extra, message):
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("The tower is")
    extra = [prompt if a == "PROMPT" else a for a in extra]
    base = ("generate", "--checkpoint", run, "--data-dir", mirror(), "--max-new-tokens", "1")
    code, printed, err = _cli(capsys, *base, *extra)
    assert code == 2 and message in err and "Fix:" in err and "=== sample" not in printed, err
    alone = extra[:1] if extra[0] == "--greedy" else extra[:2]
    assert _cli(capsys, *base, *alone)[0] == 0  # each alone runs (defaults are not taken as given)


@pytest.mark.parametrize("window_stride", [("--stride", "0"), ("--window", "64", "--stride", "65")])
def test_eval_stride_out_of_range_names_the_fix(run, capsys, window_stride):
    code, _, err = _cli(capsys, "eval", "wikitext", "--checkpoint", run, *window_stride, "--no-mlflow")
    assert code == 2 and "must be between 1 and --window" in err and "Fix:" in err, err
