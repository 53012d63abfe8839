"""`repro finetune race` on inputs a review found mishandled: a resume with another model or checkpoint
(old seeds were mixed into the median), damaged checkpoints, a missing --vocab, a level without
questions (nan accuracy), a malformed --model-config, a directory or dangling link named *.txt."""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

from repro.cli import main
from repro.eval.race import RaceFormatError, load_race
from repro.models.bert import BERT, BertConfig
from test_race import FIXTURE, write_fixture_vocab

ROOT = Path(__file__).resolve().parents[1]
TINY_YAML = ROOT / "experiments" / "bert" / "tiny_cpu.yaml"
TINY = dict(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=64, hidden_dropout=0.0,
            attention_dropout=0.0)


@pytest.fixture(scope="module")
def vocab(tmp_path_factory) -> Path:
    return write_fixture_vocab(tmp_path_factory.mktemp("vocab") / "vocab.txt")


def _argv(vocab: Path, run_dir: Path, *extra: str, race: Path = FIXTURE) -> list[str]:
    return ["finetune", "race", "--race-dir", str(race), "--vocab", str(vocab), "--run-dir", str(run_dir),
            "--no-mlflow", "--epochs", "1", "--batch-size", "5", "--seq-length", "32", *extra]


def _refused(argv: list[str], capsys, *names: str) -> str:
    """Exit 2 with a message naming each of `names` and a fix; the error text."""
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Fix:" in err and all(n in err for n in names), err
    return err


def _save_pt(path: Path, vocab: Path, seed: int, **shape) -> Path:
    from repro.data.tokenizers import bert_tokenizer
    from repro.models.bert_checkpoint import save_bert

    cfg = BertConfig(vocab_size=bert_tokenizer(vocab).vocab_size, **{**TINY, **shape})
    save_bert(BERT(cfg, seed=seed), path)
    return path


def _save_train_checkpoint(run_dir: Path, vocab: Path, iteration: int) -> None:
    """A `repro train` BERT checkpoint (meta.json + model_tp00.pt) at `iteration`; `latest` names it."""
    from repro.data.tokenizers import bert_tokenizer
    from repro.parallel.groups import ProcessGroups
    from repro.train import checkpoint as ck

    cfg = BertConfig(vocab_size=bert_tokenizer(vocab).vocab_size, **TINY)
    root, pg = run_dir / "checkpoints", ProcessGroups.single()
    tmp = ck.begin_save(root, iteration, pg)
    torch.save(BERT(cfg, seed=iteration).state_dict(), tmp / "model_tp00.pt")
    meta = {"format": ck.FORMAT_VERSION, "family": "bert", "iteration": iteration, "tp": 1, "dp": 1,
            "world_size": 1, "model": asdict(cfg), "mlflow_run_id": "pretrain-run"}
    (tmp / "meta.json").write_text(json.dumps(meta))
    ck.finish_save(root, iteration, pg)


def _seed_file(run_dir: Path) -> Path:
    return run_dir / "seeds" / "seed_1.json"


def test_resume_with_another_model_config_or_vocab_is_refused(tmp_path, vocab, capsys):
    """Only the size label was recorded: another --model-config reused seed 1 of the first model."""
    small, big = tmp_path / "a.yaml", tmp_path / "b.yaml"
    small.write_text("model: {num_layers: 2, hidden_size: 64, num_attention_heads: 4, seq_length: 64}\n")
    big.write_text("model: {num_layers: 3, hidden_size: 64, num_attention_heads: 4, seq_length: 64}\n")
    run = tmp_path / "run"
    assert main(_argv(vocab, run, "--model-config", str(small), "--seeds", "1")) == 0
    before = _seed_file(run).read_bytes()
    err = _refused(_argv(vocab, run, "--model-config", str(big), "--seeds", "1", "2"), capsys, "model.num_layers")
    assert "--run-dir" in err and "original inputs" in err
    other_vocab = Path(shutil.copy(vocab, tmp_path / "other_vocab.txt"))
    _refused(_argv(other_vocab, run, "--model-config", str(small), "--seeds", "1"), capsys, "vocab differ")
    assert _seed_file(run).read_bytes() == before and not (run / "seeds" / "seed_2.json").exists()


def test_resume_with_a_checkpoint_saved_again_at_the_same_path_is_refused(tmp_path, vocab, capsys):
    """Same path, same shape, other weights: the path alone matched, so the old seed was reused."""
    ckpt, run = tmp_path / "bert.pt", tmp_path / "run"
    _save_pt(ckpt, vocab, seed=1)
    assert main(_argv(vocab, run, "--checkpoint", str(ckpt), "--seeds", "1")) == 0
    _save_pt(ckpt, vocab, seed=2)
    _refused(_argv(vocab, run, "--checkpoint", str(ckpt), "--seeds", "1"), capsys, "checkpoint_identity.")


def test_resume_after_the_training_run_saved_a_later_checkpoint_is_refused(tmp_path, vocab, capsys):
    """--checkpoint a `repro train` run dir: its `latest` moved on, the seeds of iteration 5 are not reused."""
    pretrain, run = tmp_path / "pretrain", tmp_path / "run"
    _save_train_checkpoint(pretrain, vocab, 5)
    assert main(_argv(vocab, run, "--checkpoint", str(pretrain), "--seeds", "1")) == 0
    settings = json.loads(_seed_file(run).read_text())["settings"]
    assert settings["checkpoint_identity"]["checkpoint_iteration"] == "5"
    assert settings["checkpoint_identity"]["training_run_id"] == "pretrain-run"
    _save_train_checkpoint(pretrain, vocab, 10)
    _refused(_argv(vocab, run, "--checkpoint", str(pretrain), "--seeds", "1"), capsys,
             "checkpoint_identity.checkpoint_iteration")


def test_seeds_saved_without_the_new_settings_still_resume(tmp_path, vocab, capsys):
    """A seed file written before the model, checkpoint identity and vocab were recorded is compared on
    the keys it has."""
    ckpt, run = _save_pt(tmp_path / "bert.pt", vocab, seed=1), tmp_path / "run"
    argv = _argv(vocab, run, "--checkpoint", str(ckpt), "--seeds", "1")
    assert main(argv) == 0
    record = json.loads(_seed_file(run).read_text())
    for key in ("model", "checkpoint_identity", "vocab"):
        del record["settings"][key]
    _seed_file(run).write_text(json.dumps(record))
    capsys.readouterr()
    assert main(argv) == 0
    assert "seed 1: finished by an earlier run" in capsys.readouterr().out


def _truncated(path: Path, vocab: Path) -> None:
    data = _save_pt(path, vocab, seed=1).read_bytes()
    path.write_bytes(data[: len(data) // 2])


@pytest.mark.parametrize("write", [
    _truncated,
    lambda path, vocab: path.write_bytes(b"not a checkpoint"),
    lambda path, vocab: torch.save({"weights": torch.zeros(2)}, path),  # a torch file, not save_bert's
    lambda path, vocab: torch.save({"config": {"layers": 2}, "model": {}}, path),  # not a BertConfig
], ids=["truncated", "junk", "no-config", "foreign-config"])
def test_a_damaged_or_foreign_checkpoint_file_exits_2_naming_it(tmp_path, vocab, capsys, write):
    ckpt = tmp_path / "bert.pt"
    write(ckpt, vocab)
    _refused(_argv(vocab, tmp_path / "run", "--checkpoint", str(ckpt), "--seeds", "1"), capsys,
             f"{ckpt}", "save_bert")
    assert not (tmp_path / "run").exists()


def test_a_missing_vocab_exits_2_naming_it(tmp_path, capsys):
    missing = tmp_path / "no_vocab.txt"
    _refused(_argv(missing, tmp_path / "run", "--model-config", str(TINY_YAML), "--seeds", "1"), capsys,
             f"--vocab {missing}")


def test_a_level_without_questions_is_refused_naming_split_and_level(tmp_path, vocab, capsys):
    """dev/high with no questions: the run finished with nan high accuracy and exit 0."""
    race = tmp_path / "RACE"
    shutil.copytree(FIXTURE, race)
    for path in (race / "dev" / "high").glob("*.txt"):
        path.write_text(json.dumps({"article": "x", "questions": [], "options": [], "answers": []}))
    _refused(_argv(vocab, tmp_path / "run", "--model-config", str(TINY_YAML), "--seeds", "1", race=race),
             capsys, "dev/high", "cmu.edu")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("text, problem", [
    ("model: [1, 2\n", "not readable YAML (line 2"),
    ("model: {num_layers: two, hidden_size: 64, num_attention_heads: 4}\n", "model.num_layers"),
    ("- 1\n- 2\n", "top level is a YAML list"),
    ("model: 3\n", "model: block is a YAML int"),
], ids=["syntax", "not-a-number", "top-level-list", "model-not-mapping"])
def test_a_malformed_model_config_exits_2_naming_the_file(tmp_path, vocab, capsys, text, problem):
    config = tmp_path / "model.yaml"
    config.write_text(text)
    _refused(_argv(vocab, tmp_path / "run", "--model-config", str(config), "--seeds", "1"), capsys,
             str(config), problem, "experiments/bert/tiny_cpu.yaml")


def test_a_directory_named_txt_is_skipped_and_a_dangling_link_is_reported(tmp_path, vocab, capsys):
    race = tmp_path / "RACE"
    shutil.copytree(FIXTURE, race)
    (race / "train" / "high" / "9.txt").mkdir()  # was an IsADirectoryError traceback
    assert len(load_race(race, "train")) == len(load_race(FIXTURE, "train"))
    link = race / "train" / "high" / "10.txt"
    link.symlink_to(tmp_path / "gone.txt")  # was a bare errno message without a fix
    with pytest.raises(RaceFormatError, match=r"10\.txt: cannot be read .*Fix:"):
        load_race(race, "train")
    _refused(_argv(vocab, tmp_path / "run", "--model-config", str(TINY_YAML), "--seeds", "1", race=race),
             capsys, str(link))


def test_a_training_config_gives_its_named_size_and_includes():
    """experiments/bert/bert_336m.yaml names its shape by `model_size: bert-336m` and fig7_336m_post.yaml
    includes it: --model-config read only the model: block, so both built the default 2-layer h64 model."""
    from repro.eval.race_cli import yaml_config

    base = yaml_config(str(ROOT / "experiments/bert/bert_336m.yaml"))
    assert (base.num_layers, base.hidden_size, base.num_attention_heads, base.seq_length) == (24, 1024, 16, 512)
    post = yaml_config(str(ROOT / "experiments/bert/fig7_336m_post.yaml"))
    assert post.layernorm_order == "post" and post.num_layers == 24 and base.layernorm_order == "pre"


def test_a_gpt_training_config_is_refused(tmp_path, vocab, capsys):
    gpt = ROOT / "experiments/tiny/gpt_tiny.yaml"
    _refused(_argv(vocab, tmp_path / "run", "--model-config", str(gpt), "--seeds", "1"), capsys,
             str(gpt), "is a gpt config", "RACE fine-tunes a BERT")


def test_a_split_is_held_compact_and_batched_as_int64(vocab):
    """encode_race held int64 everywhere: 24 bytes a position, 4.3 GB a rank for RACE's 87,866 training
    questions at s=512. Now 6 (int32 tokens, uint8 types and mask); the model still gets int64."""
    import torch

    from repro.data.tokenizers import bert_tokenizer
    from repro.eval.race import encode_race, load_race
    from repro.eval.race_finetune import _rows

    data = encode_race(load_race(FIXTURE, "dev"), bert_tokenizer(vocab), 64)
    held = sum(t.element_size() * t.numel() for t in (data.tokens, data.token_types, data.padding_mask))
    assert held == len(data) * 4 * 64 * 6
    batch = _rows(data, torch.arange(len(data)), torch.device("cpu"))
    assert all(t.dtype == torch.int64 for t in batch)
    assert batch[0].tolist() == data.tokens.tolist() and batch[2].sum() == data.padding_mask.long().sum()
