"""Bad input to `repro eval` and `repro finetune race` is a one-line error, exit 2, nothing written:
a batch DP cannot split and a TP that does not divide the heads (checked before the run starts),
an eval --tp that does not divide the checkpoint's heads, a non-UTF-8 --file; and lm-eval task YAMLs
that keep a data path holding " #" whole."""

from __future__ import annotations

import contextlib
import io
import os
from pathlib import Path

import pytest

from eval_helpers import mirror, write_tiny_checkpoint
from repro.parallel.spawn import run_ranks
from test_race import FIXTURE, write_fixture_vocab


def _main_on_rank(argv: list[str]) -> tuple[int, str]:
    """repro's exit code on this rank and what it printed to stderr."""
    from repro.cli import main

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(argv)
    return code, err.getvalue()


def _race_argv(tmp_path: Path, model_config: Path, *extra: str) -> list[str]:
    vocab = write_fixture_vocab(tmp_path / "vocab.txt")
    return ["finetune", "race", "--race-dir", str(FIXTURE), "--vocab", str(vocab), "--model-config",
            str(model_config), "--epochs", "1", "--seeds", "1", "--no-mlflow", "--run-dir",
            str(tmp_path / "run"), *extra]


def _bert_config(path: Path, heads: int) -> Path:
    path.write_text(f"model:\n  num_layers: 1\n  hidden_size: {8 * heads}\n  num_attention_heads: {heads}\n"
                    "  seq_length: 64\n  num_tokentypes: 2\n")
    return path


@pytest.mark.parametrize("heads, extra, message", [
    (4, ("--batch-size", "3"), "--batch-size 3 is not divisible by the 2 data-parallel ranks"),
    (3, ("--tp", "2"), "num_attention_heads=3 is not divisible by tp=2"),
])
def test_race_layout_that_cannot_split_exits_2_before_the_run_starts(tmp_path, heads, extra, message):
    argv = _race_argv(tmp_path, _bert_config(tmp_path / "model.yaml", heads), *extra)
    for code, err in run_ranks(_main_on_rank, 2, argv, timeout=120):
        assert code == 2 and message in err and "Fix:" in err and "Traceback" not in err, err
    assert not (tmp_path / "run").exists()  # no params.json, tags.json or metrics.jsonl


def test_race_paper_batch_size_is_checked_against_dp(tmp_path):
    """Without --batch-size the paper's 32 (a custom-shape model) must split over the DP ranks too."""
    from types import SimpleNamespace

    from repro.cli import UserError
    from repro.eval.race_cli import check_layout
    from repro.models.bert import BertConfig

    cfg = BertConfig(num_layers=1, hidden_size=32, num_attention_heads=4, seq_length=64)
    check_layout(32, cfg, SimpleNamespace(tp_size=2, dp_size=4), given=False)
    with pytest.raises(UserError, match=r"batch size 32 \(the paper's\) is not divisible by the 3 .*Fix:"):
        check_layout(32, cfg, SimpleNamespace(tp_size=1, dp_size=3), given=False)


def _gpt_checkpoint(run_dir: Path, heads: int) -> Path:
    """A trainer-format checkpoint of a tiny untrained GPT with `heads` attention heads."""
    return write_tiny_checkpoint(run_dir, seq_length=64, num_layers=1, hidden_size=8 * heads, num_attention_heads=heads)


def test_eval_tp_that_does_not_divide_the_heads_exits_2(tmp_path):
    ckpt, out = _gpt_checkpoint(tmp_path / "run", heads=3), tmp_path / "o.jsonl"
    argv = ["eval", "lambada", "--checkpoint", str(ckpt), "--data-dir", str(mirror()), "--tp", "2",
            "--max-examples", "2", "--no-mlflow", "--out", str(out)]
    for code, err in run_ranks(_main_on_rank, 2, argv, timeout=120):
        assert code == 2 and "num_attention_heads=3 is not divisible by tp=2" in err, err
        assert "--tp" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert not out.exists()


def test_wikitext_file_that_is_not_utf8_names_the_file_and_the_fix(tmp_path, capsys):
    from repro.cli import main

    write_tiny_checkpoint(tmp_path / "run")
    bad = tmp_path / "wiki.test.tokens"
    bad.write_bytes(" = Caf\xe9 = \n The caf\xe9 is open .\n".encode("latin-1"))
    code = main(["eval", "wikitext", "--checkpoint", str(tmp_path / "run"), "--data-dir", str(mirror()),
                 "--file", str(bad), "--window", "64", "--stride", "32", "--no-mlflow",
                 "--out", str(tmp_path / "o.jsonl")])
    err = capsys.readouterr().err
    assert code == 2 and str(bad) in err and "not UTF-8" in err and "Fix:" in err, err
    assert not (tmp_path / "o.jsonl").exists()


def test_local_task_yaml_keeps_a_path_with_a_hash_whole(tmp_path):
    import yaml

    from repro.eval.local_tasks import LAMBADA, WIKITEXT_RAW, write_local_tasks

    data = tmp_path / "eval data #2"
    for rel in (LAMBADA, WIKITEXT_RAW):
        (data / rel).parent.mkdir(parents=True, exist_ok=True)
        os.symlink(mirror() / rel, data / rel)
    out = write_local_tasks(data, tmp_path / "lm-eval tasks #2: x")

    class Loader(yaml.SafeLoader):
        pass

    Loader.add_constructor("!function", lambda loader, node: loader.construct_scalar(node))
    expected = {"lambada_openai_local.yaml": (data / LAMBADA).resolve(),
                "wikitext_local.yaml": (out / "wikitext_document_level.test.jsonl").resolve()}
    for name, path in expected.items():
        cfg = yaml.load((out / name).read_text(), Loader=Loader)
        assert cfg["dataset_kwargs"]["data_files"]["test"] == str(path), name


@pytest.mark.parametrize("command", ["eval", "race"])
def test_a_tp_that_does_not_divide_the_ranks_exits_2(tmp_path, command):
    """--tp 4 on 2 ranks: one line naming both, exit 2 on every rank (before, a LayoutError traceback)."""
    if command == "eval":
        argv = ["eval", "lambada", "--checkpoint", str(_gpt_checkpoint(tmp_path / "ck", heads=4)),
                "--data-dir", str(mirror()), "--tp", "4", "--no-mlflow", "--out", str(tmp_path / "o.jsonl")]
    else:
        argv = _race_argv(tmp_path, _bert_config(tmp_path / "model.yaml", 4), "--tp", "4")
    for code, err in run_ranks(_main_on_rank, 2, argv, timeout=120):
        assert code == 2 and "--tp 4: tensor-parallel size tp=4 does not divide world size 2" in err and "Traceback" not in err, err
    assert not (tmp_path / "run").exists() and not (tmp_path / "o.jsonl").exists()


def test_local_tasks_from_a_data_dir_without_lambada_make_no_output_dir(tmp_path):
    """Both inputs are found before the output folder is made (before: an empty folder was left)."""
    from repro.data.errors import DataError
    from repro.eval.local_tasks import WIKITEXT_RAW, write_local_tasks

    data = tmp_path / "data"
    (data / WIKITEXT_RAW).parent.mkdir(parents=True)
    os.symlink(mirror() / WIKITEXT_RAW, data / WIKITEXT_RAW)
    with pytest.raises(DataError, match="missing"):
        write_local_tasks(data, tmp_path / "tasks")
    assert not (tmp_path / "tasks").exists()
