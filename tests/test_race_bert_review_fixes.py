"""`repro finetune race` and the BERT table after a review: finished seeds reused on other RACE data,
an off-protocol RACE run (epochs, max QA tokens, a partial training set) filling a paper row, a
mistyped --size run at the default batch/lr, and the last fine-tuning step's loss not logged."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pandas as pd
import pytest

from repro.cli import main
from test_race import FIXTURE, write_fixture_vocab
from test_race_inputs_review import TINY_YAML, _argv, _refused


@pytest.fixture(scope="module")
def vocab(tmp_path_factory) -> Path:
    return write_fixture_vocab(tmp_path_factory.mktemp("vocab") / "vocab.txt")


def _tiny(vocab: Path, run_dir: Path, race: Path, *extra: str) -> list[str]:
    return _argv(vocab, run_dir, "--model-config", str(TINY_YAML), "--seeds", "1", *extra, race=race)


def _race_copy(dest: Path, rotate: bool = False) -> Path:
    """The RACE fixture copied to `dest` (new mtimes); `rotate`: every answer moved on by one (A->B, ...,
    D->A), the same files, counts and sizes but another data set."""
    shutil.copytree(FIXTURE, dest, copy_function=shutil.copy)
    for path in dest.glob("*/*/*.txt") if rotate else ():
        doc = json.loads(path.read_text())
        doc["answers"] = ["BCDA"["ABCD".index(a)] for a in doc["answers"]]
        path.write_text(json.dumps(doc))
    return dest


def _seed_file(run: Path) -> Path:
    return run / "seeds" / "seed_1.json"


def test_finished_seeds_on_other_race_data_are_refused_naming_both(tmp_path, vocab, capsys):
    """The settings held only train_questions about the data: a rerun on another RACE dir of the same size
    reported the first data's accuracies. Now refused (exit 2) naming both dirs; a copy resumes."""
    first, other = _race_copy(tmp_path / "race"), _race_copy(tmp_path / "race_other", rotate=True)
    run = tmp_path / "run"
    assert main(_tiny(vocab, run, first)) == 0
    before = _seed_file(run).read_bytes()
    err = _refused(_tiny(vocab, run, other), capsys, "race_data.", str(first.resolve()), str(other.resolve()),
                   "new --run-dir")
    assert "race_data.train.sha256" in err and "race_data.train.questions" not in err, err
    assert _seed_file(run).read_bytes() == before
    moved = _race_copy(tmp_path / "race_moved")  # the same data elsewhere: the identity, not the path, decides
    assert main(_tiny(vocab, run, moved)) == 0
    assert "seed 1: finished by an earlier run" in capsys.readouterr().out
    params = json.loads((run / "params.json").read_text())
    assert params["race_dir"] == str(first.resolve()) and params["race_data"].startswith("train 4 files, 10 questions")


def test_seeds_saved_before_the_race_data_was_recorded_resume_with_a_warning(tmp_path, vocab, capsys):
    """An older run dir (no race_dir/race_data in its settings) is compared on what it has, and says so."""
    run = tmp_path / "run"
    race = _race_copy(tmp_path / "race")
    assert main(_tiny(vocab, run, race)) == 0
    record = json.loads(_seed_file(run).read_text())
    del record["settings"]["race_dir"], record["settings"]["race_data"]
    _seed_file(run).write_text(json.dumps(record))
    capsys.readouterr()
    assert main(_tiny(vocab, run, race)) == 0
    out = capsys.readouterr().out
    assert "seed 1: finished by an earlier run" in out and "saved before race_data were recorded" in out, out


RACE_336M = {"params.task": "race", "params.device_type": "cuda", "params.device_name": "G",
             "params.size": "bert-336m", "params.num_layers": "24", "params.hidden_size": "1024",
             "params.num_attention_heads": "16", "params.seq_length": "512", "params.seeds": "1 2 3 4 5",
             "params.batch_size": "32", "params.lr": "2e-05", "params.epochs": "3", "params.max_qa_tokens": "128",
             "params.train_questions": "87866"}


@pytest.mark.parametrize("param, value, label", [
    ("epochs", "1", "epochs 1 (not the paper's 3)"),
    ("max_qa_tokens", "64", "max QA tokens 64 (not the paper's 128)"),
    ("train_questions", "10", "training questions 10 (not RACE's 87,866)"),
])
def test_the_bert_table_prefers_a_run_on_the_papers_protocol(param, value, label):
    """Only batch and lr were compared: a newer 1-epoch run (or 64 QA tokens, or 10 training questions)
    took bert-336m's paper row from the run on the paper's protocol, unlabelled."""
    from repro.analysis import bert

    off = dict(RACE_336M, run_id="off", **{f"params.{param}": value, "metrics.test/acc_total": 70.0})
    paper = dict(RACE_336M, run_id="paper", **{"metrics.test/acc_total": 83.0})
    rows = bert.race_runs(pd.DataFrame([off, paper]))  # newest first, as load_runs orders them
    assert [(r["model"], r["run_id"], r["race_total"]) for r in rows] == [("bert-336m", "paper", 83.0)]
    assert "not the paper's" not in rows[0]["label"] and "not RACE's" not in rows[0]["label"]
    alone = bert.race_runs(pd.DataFrame([off]))[0]
    assert alone["run_id"] == "off" and alone["label"].endswith(label), alone["label"]


def test_a_mistyped_size_is_refused_not_run_at_the_default_batch_and_lr(tmp_path, vocab, capsys):
    """`--size bert-1.3B` ran at 32 / 2e-5 (bert-1.3b's are 16 / 1e-5) while `bert-1.3b` was refused for
    the tiny model. Now any case names the paper size, and a near miss is refused listing the sizes."""
    race = _race_copy(tmp_path / "race")
    for size in ("bert-1.3B", "BERT-1.3b"):
        _refused(_tiny(vocab, tmp_path / "a", race, "--size", size), capsys,
                 "--size bert-1.3b is the paper's L24-h2048-a32-s512")
    _refused(_tiny(vocab, tmp_path / "b", race, "--size", "bert-13b"), capsys,
             "--size bert-13b is not a BERT size (did you mean bert-1.3b?)", "bert-336m, bert-1.3b, bert-3.9b")
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_a_size_label_is_canonical_and_free_labels_only_name_other_shapes():
    """size_label: a paper size in any case is the paper's name (so its batch/lr); a free label (the
    Slurm smoke test's `smoke`, cpu_results.sh's `bert-tiny-cpu`) names a model of no paper shape only."""
    from repro.cli import UserError
    from repro.eval.race_cli import _bert_size, size_label
    from repro.eval.race_finetune import options_for
    from repro.models.bert import BertConfig

    big = BertConfig(**_bert_size("BERT-1.3B").model_config().__dict__)
    assert size_label("Bert-1.3B", big) == "bert-1.3b"
    assert (options_for(size_label("bert-1.3B", big), None, None, 3, 0).batch_size,
            options_for(size_label("bert-1.3B", big), None, None, 3, 0).lr) == (16, 1e-5)
    with pytest.raises(UserError, match="the model is the paper's bert-1.3b .*Fix: leave out --size"):
        size_label("large", big)
    tiny = BertConfig(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=64)
    assert [size_label(n, tiny) for n in ("smoke", "bert-tiny-cpu", None)] == ["smoke", "bert-tiny-cpu", "custom"]


def test_the_last_steps_loss_is_logged_once(vocab):
    """Logged every log_every steps only: 6 steps at log_every 4 logged step 4, not the last (6); the
    console printed it. Now the last step too, and a last step on the interval only once."""
    from repro.data.tokenizers import bert_tokenizer
    from repro.eval.race import encode_race, load_race
    from repro.eval.race_finetune import FinetuneOptions, MultipleChoiceBert, finetune
    from repro.models.bert import BertConfig

    tok = bert_tokenizer(vocab)
    train = encode_race(load_race(FIXTURE, "train"), tok, 32)  # 10 questions: 2 batches of 5 an epoch
    cfg = BertConfig(vocab_size=tok.vocab_size, num_layers=1, hidden_size=16, num_attention_heads=2, seq_length=32)
    for epochs, steps in ((3, [4, 6]), (4, [4, 8])):
        logged: list[tuple[int, float]] = []
        opts = FinetuneOptions(epochs=epochs, batch_size=5, lr=1e-3, log_every=4, seed=1)
        losses = finetune(MultipleChoiceBert(cfg, seed=1), train, opts, log=lambda m, i: logged.append((i, m["train/loss"])))
        assert [i for i, _ in logged] == steps and len(losses) == steps[-1]
        assert logged[-1][1] == losses[-1]  # the same float: exact


def _bert_file(path: Path, vocab: Path, layernorm_order: str = "pre", hidden: int = 32, drop: str = "") -> Path:
    """A save_bert-format file whose config says hidden 64, pre-LN; its weights as given."""
    from dataclasses import asdict

    import torch

    from repro.data.tokenizers import bert_tokenizer
    from repro.models.bert import BERT, BertConfig
    from repro.models.bert_checkpoint import full_state_dict

    shape = dict(vocab_size=bert_tokenizer(vocab).vocab_size, num_layers=1, num_attention_heads=4, seq_length=64)
    state = full_state_dict(BERT(BertConfig(**shape, hidden_size=hidden, layernorm_order=layernorm_order)))
    state = {k: v for k, v in state.items() if not (drop and k.startswith(drop))}
    torch.save({"config": asdict(BertConfig(**shape, hidden_size=64)), "model": state}, path)
    return path


@pytest.mark.parametrize("weights, named", [
    ({"hidden": 32}, "shape embeddings.word.weight"),
    ({"hidden": 64, "layernorm_order": "post"}, "missing ln_f.weight, ln_f.bias; unexpected embeddings.ln"),
    ({"hidden": 64, "drop": "layers."}, "missing layers.0.ln_1.weight"),
])
def test_a_checkpoint_whose_weights_do_not_fit_its_config_is_refused_before_any_work(tmp_path, vocab, capsys,
                                                                                      weights, named):
    """A file with `config` and `model` whose tensors do not fit that config (another width, the other
    layer-norm order's weights, a layer missing) crashed with a traceback (exit 1) once every rank had
    tokenized RACE and the run dir was written; now exit 2 naming the misfit, before any of that."""
    path = _bert_file(tmp_path / "bert.pt", vocab, **weights)
    run = tmp_path / "run"
    _refused(_tiny(vocab, run, FIXTURE, "--checkpoint", str(path)), capsys,
             "its weights do not fit its own config", named)
    assert not run.exists()


def test_a_file_without_the_pretraining_heads_fine_tunes(tmp_path, vocab):
    """The heads are not needed for fine-tuning: a file without them is not refused by the shape check."""
    path = _bert_file(tmp_path / "bert.pt", vocab, hidden=64, drop="lm_head.")
    argv = _argv(vocab, tmp_path / "run", "--checkpoint", str(path), "--seeds", "1")
    assert main(argv) == 0


def test_the_logged_learning_rate_is_the_one_each_step_used(monkeypatch, vocab):
    """`train/lr` at step k was read after the step advanced the schedule: the rate of step k + 1 (the
    warm-up's peak was never shown). Now each logged rate is the one its step's optimizer update used."""
    import repro.eval.race_finetune as race_finetune
    from repro.data.tokenizers import bert_tokenizer
    from repro.eval.race import encode_race, load_race
    from repro.models.bert import BertConfig

    tok = bert_tokenizer(vocab)
    train = encode_race(load_race(FIXTURE, "train"), tok, 32)
    cfg = BertConfig(vocab_size=tok.vocab_size, num_layers=1, hidden_size=32, num_attention_heads=2, seq_length=32)
    used, logged, step = [], {}, race_finetune.clip_and_step

    def spy(opt, *args, **kwargs):
        used.append(opt.param_groups[0]["lr"])
        return step(opt, *args, **kwargs)

    monkeypatch.setattr(race_finetune, "clip_and_step", spy)
    opts = race_finetune.FinetuneOptions(epochs=2, batch_size=2, lr=1e-3, log_every=1, seed=1)
    race_finetune.finetune(race_finetune.MultipleChoiceBert(cfg, seed=1), train, opts,
                           log=lambda metrics, i: logged.__setitem__(i, metrics["train/lr"]))
    assert len(used) == len(logged) > 4
    assert [logged[k] for k in sorted(logged)] == used
    assert max(used) == pytest.approx(1e-3)  # the peak, at the end of the warm-up
