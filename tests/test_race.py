"""Issue 6, RACE: the official layout, the paper's 4 samples per question, clear errors on bad files,
fine-tuning a tiny BERT to 100% train accuracy, middle/high/total, MLflow; checkpoints at any TP."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tokenizers import pre_tokenizers

from conftest import require
from repro.data.tokenizers import bert_tokenizer
from repro.eval.race import (RaceFormatError, accuracy_by_level, build_choice_inputs, encode_race,
                             load_race, parse_race_file, question_with_option)
from repro.models.bert import BERT, BertConfig
from repro.parallel.spawn import run_ranks

FIXTURE = Path(__file__).parent / "fixtures" / "race"
ROOT = Path(__file__).resolve().parents[1]


def write_fixture_vocab(vocab: Path) -> Path:
    """A WordPiece vocab of the fixture's words (small, so a tiny BERT is fast), written to `vocab`."""
    words = set()
    pre = pre_tokenizers.BertPreTokenizer()
    for path in FIXTURE.rglob("*.txt"):
        doc = json.loads(path.read_text())
        texts = [doc["article"], *doc["questions"], *(o for opts in doc["options"] for o in opts)]
        words |= {w.lower() for t in texts for w, _ in pre.pre_tokenize_str(t)}
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *sorted(words)]) + "\n")
    return vocab


@pytest.fixture(scope="module")
def vocab_file(tmp_path_factory) -> Path:
    return write_fixture_vocab(tmp_path_factory.mktemp("vocab") / "vocab.txt")


@pytest.fixture(scope="module")
def tok(vocab_file):
    return bert_tokenizer(vocab_file)


def test_fixture_loads_in_the_official_layout():
    counts = {s: len(load_race(FIXTURE, s)) for s in ("train", "dev", "test")}
    assert counts == {"train": 10, "dev": 4, "test": 3}
    train = load_race(FIXTURE, "train")
    assert [q.level for q in train].count("middle") == 5 and train[0].label == 1  # "B"
    assert all(len(q.options) == 4 for q in train)


def test_four_samples_per_question_as_the_paper_builds_them(tok):
    q = load_race(FIXTURE, "train")[1]  # "Max found _ in the sand."
    assert question_with_option(q.question, q.options[2]) == "Max found an old bottle in the sand."
    assert question_with_option("Where does Tom live?", "In Spain.") == "Where does Tom live? In Spain."
    rows = build_choice_inputs(q, tok, seq_length=40)
    assert rows["tokens"].shape == (4, 40)
    for j, option in enumerate(q.options):
        qa = tok.encode(question_with_option(q.question, option))
        article = tok.encode(q.article)[: 40 - len(qa) - 3]  # article truncated to fill seq_length
        ids = [tok.cls, *qa, tok.sep, *article, tok.sep]
        assert rows["tokens"][j].tolist() == ids + [tok.pad] * (40 - len(ids))
        assert rows["token_types"][j].tolist() == [0] * (len(qa) + 2) + [1] * (len(ids) - len(qa) - 2) + [0] * (40 - len(ids))
        assert rows["padding_mask"][j].sum() == len(ids)
    short = build_choice_inputs(q, tok, seq_length=64, max_qa_tokens=3)  # qa capped (paper: 128)
    assert short["tokens"][0, 4] == tok.sep and short["token_types"][0, :5].tolist() == [0] * 5
    data = encode_race(load_race(FIXTURE, "dev"), tok, 64)
    assert data.tokens.shape == (4, 4, 64) and data.labels.tolist() == [2, 1, 1, 0]


def test_accuracy_by_level():
    acc = accuracy_by_level(torch.tensor([0, 1, 2, 3]), torch.tensor([0, 1, 0, 0]), ["middle", "middle", "high", "high"])
    assert acc == {"middle": 100.0, "high": 0.0, "total": 50.0}


def _broken_copy(tmp_path: Path, mutate) -> Path:
    root = tmp_path / "RACE"
    shutil.copytree(FIXTURE, root)
    path = root / "train" / "high" / "2.txt"
    doc = json.loads(path.read_text())
    mutate(doc)
    path.write_text(json.dumps(doc))
    return root


@pytest.mark.parametrize("mutate, message", [
    (lambda d: d.pop("answers"), r"missing key\(s\) 'answers'"),
    (lambda d: d["answers"].__setitem__(1, "E"), r"question 1 has answer 'E', not one of A, B, C, D"),
    (lambda d: d["options"][0].pop(), r"question 0 has 3 options, not 4"),
    (lambda d: d["questions"].pop(), r"1 questions, 2 option lists and 2 answers"),
    (lambda d: d.__setitem__("article", 7), r"the article is a int, not text"),  # were TypeErrors in the tokenizer
    (lambda d: d["questions"].__setitem__(1, None), r"question 1 is a NoneType, not text"),
    (lambda d: d["options"][0].__setitem__(2, 3), r"question 0 has an option that is not text"),
    (lambda d: d.__setitem__("answers", "AB"), r"'answers' must be JSON lists"),
])
def test_bad_race_files_name_the_file(tmp_path, mutate, message):
    root = _broken_copy(tmp_path, mutate)
    with pytest.raises(RaceFormatError, match=message) as err:
        load_race(root, "train")
    assert str(root / "train" / "high" / "2.txt") in str(err.value) and "Fix:" in str(err.value)


def test_cli_split_without_questions_exits_2_naming_it(tmp_path, vocab_file, capsys):
    """A split whose files hold no questions: a user error naming the split (was a traceback)."""
    from repro.cli import main

    root = tmp_path / "RACE"
    shutil.copytree(FIXTURE, root)
    for path in (root / "dev").glob("*/*.txt"):
        path.write_text(json.dumps({**json.loads(path.read_text()), "questions": [], "options": [], "answers": []}))
    argv = ["finetune", "race", "--race-dir", str(root), "--vocab", str(vocab_file), "--model-config",
            str(ROOT / "experiments" / "bert" / "tiny_cpu.yaml"), "--run-dir", str(tmp_path / "run"),
            "--seeds", "1", "--no-mlflow"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "the dev split(s) hold no questions" in err and "Fix:" in err, err


def test_missing_folder_and_bad_json_are_clear(tmp_path):
    with pytest.raises(RaceFormatError, match=r"train/middle: missing .*cmu.edu"):
        load_race(tmp_path, "train")
    bad = tmp_path / "x.txt"
    bad.write_text("{not json")
    with pytest.raises(RaceFormatError, match=r"x.txt: not valid JSON"):
        parse_race_file(bad, "high")


def test_cli_bad_file_exits_2_naming_it(tmp_path, vocab_file):
    root = _broken_copy(tmp_path, lambda d: d["answers"].__setitem__(0, "Z"))
    out = subprocess.run([sys.executable, "-m", "repro.cli", "finetune", "race", "--race-dir", str(root),
                          "--vocab", str(vocab_file), "--no-mlflow"],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 2, out.stderr
    assert re.search(r"error: .*train/high/2.txt: question 0 has answer 'Z'", out.stderr), out.stderr


@pytest.mark.parametrize("option,value,message", [
    ("--epochs", "0", "--epochs 0 must be at least 1"),  # used to crash writing results.json after every seed
    ("--seq-length", "6", "--seq-length 6 must be at least 8"),  # used to be a ValueError traceback
    ("--max-qa-tokens", "-1", "--max-qa-tokens -1 must be at least 1"),  # used to drop the qa's last token
    ("--batch-size", "0", "--batch-size 0 must be at least 1"),  # used to become the paper's 32 silently
    ("--lr", "0", "--lr 0.0 must be a positive, finite number"),  # likewise 2e-5
    ("--lr", "inf", "--lr inf must be a positive, finite number"),  # trained to NaN, and scored that, exit 0
])
def test_numbers_that_cannot_run_exit_2_naming_the_fix(tmp_path, vocab_file, capsys, option, value, message):
    from repro.cli import main

    argv = ["finetune", "race", "--race-dir", str(FIXTURE), "--vocab", str(vocab_file), "--model-config",
            str(ROOT / "experiments" / "bert" / "tiny_cpu.yaml"), "--run-dir", str(tmp_path / "run"),
            "--seeds", "1", "--no-mlflow", option, value]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Fix:" in err, err
    assert not (tmp_path / "run").exists()


TINY = dict(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=96, hidden_dropout=0.0,
            attention_dropout=0.0)


def _save_tp2(path: str, vocab_size: int) -> float:
    """At TP=2: save the model; return a logit sum for the caller to compare after loading at TP=1."""
    import torch.distributed as dist

    from repro.models.bert_checkpoint import save_bert
    from repro.parallel.groups import ParallelDims, build_process_groups

    pg = build_process_groups(ParallelDims(2, 1))
    model = BERT(BertConfig(vocab_size=vocab_size, **TINY), pg.tp_group, seed=77)
    save_bert(model, path)
    dist.barrier()
    return 0.0


def test_checkpoint_saved_at_tp2_loads_at_tp1(tmp_path):
    from repro.models.bert_checkpoint import VOCAB_ROWS, load_full_state_dict, read_bert

    path = tmp_path / "bert_tp2.pt"
    run_ranks(_save_tp2, 2, str(path), 300)
    cfg, state = read_bert(path)
    loaded = BERT(cfg)  # another seed: every tensor must come from the file
    load_full_state_dict(loaded, state)
    serial = BERT(BertConfig(vocab_size=300, **TINY), seed=77)  # master-weight init: same at any TP
    for (name, a), b in zip(loaded.state_dict().items(), serial.state_dict().values()):
        if name in VOCAB_ROWS:  # padded rows are never used: the file drops them, loading zeroes them
            assert not a[300:].any(), name
            a, b = a[:300], b[:300]
        assert torch.equal(a, b), name


def test_finetune_cli_fits_the_fixture_through_an_outage_and_syncs_to_mlflow(tmp_path, tok, vocab_file):
    """Tiny BERT (2 layers, h=64) saved as a checkpoint, fine-tuned by `repro finetune race` with the
    tracking server down: train accuracy must reach 100% (10 questions, lr 1e-3, 25 epochs:
    memorisation), and `repro tracking sync` then puts the run into MLflow as if it had been up."""
    from repro.models.bert_checkpoint import save_bert

    ckpt = tmp_path / "tiny.pt"
    save_bert(BERT(BertConfig(vocab_size=tok.vocab_size, **TINY), seed=3), ckpt)
    env = {**os.environ, "MLFLOW_TRACKING_URI": "http://127.0.0.1:9"}
    cmd = [sys.executable, "-m", "repro.cli", "finetune", "race", "--race-dir", str(FIXTURE), "--vocab", str(vocab_file),
           "--checkpoint", str(ckpt), "--epochs", "25", "--batch-size", "5", "--lr", "1e-3", "--seq-length", "96",
           "--seeds", "1", "2", "--run-dir", str(tmp_path / "run"), "--size", "tiny", "--eval-train"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "MLflow tracking unavailable" in out.stderr and f"repro tracking sync {tmp_path / 'run'}" in out.stderr
    env["MLFLOW_TRACKING_URI"] = f"sqlite:///{tmp_path / 'mlflow.db'}"
    sync = subprocess.run([sys.executable, "-m", "repro.cli", "tracking", "sync", str(tmp_path / "run")],
                          capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert sync.returncode == 0 and "created MLflow run" in sync.stdout, sync.stdout + sync.stderr
    assert "the median by dev total of 2 seeds" in out.stdout
    lines = {ln.split()[0]: ln for ln in out.stdout.splitlines() if re.match(r"\s+(train|dev|test)\s", ln)}
    assert set(lines) == {"train", "dev", "test"}
    assert re.search(r"middle\s+100.0\s+high\s+100.0\s+total\s+100.0", lines["train"]), out.stdout
    results = json.loads((tmp_path / "run" / "results.json").read_text())
    assert all(s["accuracy"]["train"]["total"] == 100.0 for s in results["seeds"])
    chosen = next(s for s in results["seeds"] if s["seed"] == results["median_seed"])
    assert results["median"] == chosen["accuracy"] and results["selected_by"] == "dev total accuracy"
    import mlflow

    mlflow.set_tracking_uri(env["MLFLOW_TRACKING_URI"])
    runs = mlflow.search_runs(experiment_names=["bert"])
    assert len(runs) == 1 and runs["metrics.train/acc_total"].iloc[0] == 100.0
    assert {"metrics.dev/acc_middle", "metrics.dev/acc_high", "metrics.test/acc_total"} <= set(runs.columns)
    assert runs["metrics.test/acc_total"].iloc[0] == chosen["accuracy"]["test"]["total"]
    assert runs["params.precision"].iloc[0] == "fp32" and runs["params.world_size"].iloc[0] == "1"
    assert runs["params.device_name"].iloc[0] and runs["params.git_sha"].iloc[0]
    assert runs["params.device_type"].iloc[0] in ("cpu", "cuda")
    assert runs["status"].iloc[0] == "FINISHED" and runs["tags.task"].iloc[0] == "race"



def _finetune_rank(vocab: str, tp: int, batch: int) -> tuple[list[float], dict]:
    """One seed of RACE fine-tuning of a tiny random BERT (dropout off) at TP=tp x DP=world/tp."""
    import torch.distributed as dist

    from repro.eval.race_finetune import FinetuneOptions, run_seed
    from repro.parallel.groups import ParallelDims, build_process_groups

    pg = build_process_groups(ParallelDims.from_world(tp, dist.get_world_size()))
    tok = bert_tokenizer(Path(vocab))
    splits = {s: encode_race(load_race(FIXTURE, s), tok, TINY["seq_length"]) for s in ("train", "dev", "test")}
    opts = FinetuneOptions(epochs=3, batch_size=batch, lr=1e-3, seed=5)
    result = run_seed(BertConfig(vocab_size=tok.vocab_size, **TINY), None, splits, opts, pg)
    return result.losses, result.accuracy


@pytest.mark.parametrize("world, tp, batch", [(2, 2, 10), (2, 1, 10), (2, 1, 4), (2, 1, 6)])
def test_finetuning_at_tp2_and_dp2_reproduces_serial(vocab_file, world, tp, batch):
    """fp32, dropout off, 3 epochs of 10 questions: every step's loss at TP=2 (or DP=2) within 1e-5
    relative of TP=1 (the layouts only reorder sums), and the same accuracies. The multiple-choice
    head is replicated on the TP ranks and stays identical. Batch 4 and 6 end each epoch with a short
    batch of 2 and 4 questions: at DP=2 one rank gets none (batch 4) or the shares are 3 and 1
    (batch 6), and the step's gradient is still the whole batch's mean."""
    serial_losses, serial_acc = run_ranks(_finetune_rank, 1, str(vocab_file), 1, batch)[0]
    results = run_ranks(_finetune_rank, world, str(vocab_file), tp, batch, timeout=300)
    for losses, acc in results:
        assert len(losses) == len(serial_losses) == 3 * -(-10 // batch)
        assert max(abs(a - b) / b for a, b in zip(losses, serial_losses)) < 1e-5, (losses, serial_losses)
        assert acc == serial_acc
    assert serial_losses[-1] < serial_losses[0] and set(serial_acc) == {"dev", "test"}  # train: --eval-train


def test_size_is_the_models_shape_and_picks_the_papers_batch_and_lr():
    """--size left out: the paper BERT size of exactly the model's shape (its batch/lr: 16/1e-5 for
    1.3B), else "custom"; a paper size given for a model of another shape is refused."""
    from repro.cli import UserError
    from repro.eval.race_cli import size_label
    from repro.eval.race_finetune import options_for
    from repro.models.sizes import SIZES

    def paper(name):
        return BertConfig(**SIZES[name].model_config().__dict__)

    tiny = BertConfig(vocab_size=300, **TINY)
    assert size_label(None, tiny) == "custom" and size_label("tiny", tiny) == "tiny"
    assert [size_label(None, paper(n)) for n in ("bert-336m", "bert-1.3b", "bert-3.9b")] == \
        ["bert-336m", "bert-1.3b", "bert-3.9b"]
    opts = options_for(size_label(None, paper("bert-1.3b")), None, None, 3, 1)
    assert (opts.batch_size, opts.lr) == (16, 1e-5)
    assert size_label("bert-1.3b", paper("bert-1.3b")) == "bert-1.3b"
    with pytest.raises(UserError, match=r"--size bert-336m is the paper's L24-h1024-a16-s512, but the model is "
                                        r"L24-h2048-a32-s512 \(bert-1.3b\)"):
        size_label("bert-336m", paper("bert-1.3b"))
    with pytest.raises(UserError, match=r"L2-h64-a4-s96 \(not a paper size\)\. Fix: leave out --size"):
        size_label("bert-336m", tiny)


def test_a_model_config_without_size_is_logged_custom_with_its_shape(tmp_path, vocab_file, capsys):
    """`repro finetune race --model-config tiny_cpu.yaml` without --size: size "custom" (not the paper's
    bert-336m), and the shape the report checks a size against."""
    from repro.cli import main

    assert main(["finetune", "race", "--race-dir", str(FIXTURE), "--vocab", str(vocab_file), "--model-config",
                 str(ROOT / "experiments/bert/tiny_cpu.yaml"), "--epochs", "1", "--batch-size", "5",
                 "--seq-length", "64", "--seeds", "1", "--no-mlflow", "--run-dir", str(tmp_path / "run")]) == 0
    params = json.loads((tmp_path / "run" / "params.json").read_text())
    assert params["size"] == "custom"
    shape = [params[k] for k in ("num_layers", "hidden_size", "num_attention_heads", "seq_length")]
    assert [int(v) for v in shape] == [2, 64, 4, 64]


def test_a_seq_length_past_the_models_positions_is_said_not_silently_capped(tmp_path, vocab_file, capsys):
    """--seq-length 512 (the default) on a model of 128 positions: inputs are 128 tokens, as before, and
    the command now says so (it used to cap them without a word)."""
    from repro.cli import main

    assert main(["finetune", "race", "--race-dir", str(FIXTURE), "--vocab", str(vocab_file), "--model-config",
                 str(ROOT / "experiments/bert/tiny_cpu.yaml"), "--epochs", "1", "--batch-size", "5",
                 "--seeds", "1", "--no-mlflow", "--run-dir", str(tmp_path / "run")]) == 0
    assert "--seq-length 512: the model has 128 positions, so inputs are 128 tokens" in capsys.readouterr().out
    assert json.loads((tmp_path / "run" / "params.json").read_text())["seq_length"] in (128, "128")


def test_the_median_seed_by_dev_accuracy_reports_one_runs_numbers():
    # per-cell medians would mix seeds (middle of one, high of another); the paper's median is a run
    from repro.eval.race_finetune import FinetuneResult, median_seed

    def result(seed, dev_total, test):
        r = FinetuneResult(seed)
        r.accuracy = {"dev": {"middle": 0.0, "high": 0.0, "total": dev_total},
                      "test": dict(zip(("middle", "high", "total"), test))}
        return r

    runs = [result(1, 60.0, (90, 10, 50)), result(2, 62.0, (10, 90, 51)), result(3, 61.0, (50, 50, 49)),
            result(4, 59.0, (0, 0, 0)), result(5, 63.0, (99, 99, 99))]
    assert median_seed(runs).seed == 3 and median_seed(runs).accuracy["test"]["total"] == 49
    assert median_seed(runs[:4]).seed == 1  # even count: the lower middle
    assert median_seed([result(7, 50.0, (1, 2, 3)), result(6, 50.0, (4, 5, 6))]).seed == 6  # tie: smaller seed


def test_real_bert_vocab_builds_the_inputs():
    """With the real uncased WordPiece vocab (from `repro data fetch`): [CLS]=101, [SEP]=102."""
    from repro.data.tokenizers import build_tokenizer

    data_dir = Path(os.environ.get("REPRO_DATA_DIR") or os.environ.get("REPRO_DATA_MIRROR") or "data")
    require((data_dir / "vocab" / "bert-large-uncased-vocab.txt").is_file(), "the BERT vocab (repro data fetch)")
    tok = build_tokenizer("bert", data_dir)
    data = encode_race(load_race(FIXTURE, "test"), tok, 128)
    assert data.tokens[:, :, 0].eq(101).all() and (data.tokens == 102).sum(-1).eq(2).all()


def _race_cmd(ckpt: Path, vocab_file: Path, run_dir: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "repro.cli", "finetune", "race", "--race-dir", str(FIXTURE), "--vocab",
            str(vocab_file), "--checkpoint", str(ckpt), "--batch-size", "5", "--lr", "1e-3", "--seq-length", "96",
            "--size", "tiny", "--run-dir", str(run_dir), *extra]


def test_a_stopped_job_goes_on_from_the_next_unfinished_seed(tmp_path, tok, vocab_file):
    """USR1 (Slurm's warning before the time limit) during seed 2: exit 0, the marker slurm/launch.sh
    requeues on, seed 1 saved; the same command again skips seed 1 (its saved numbers are reported),
    redoes seed 2 and finishes one MLflow run; other settings in that run dir are refused (exit 2)."""
    import signal
    import time

    import mlflow

    from repro.models.bert_checkpoint import save_bert

    ckpt, run_dir = tmp_path / "tiny.pt", tmp_path / "run"
    save_bert(BERT(BertConfig(vocab_size=tok.vocab_size, **TINY), seed=3), ckpt)
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}"}
    cmd = _race_cmd(ckpt, vocab_file, run_dir, "--epochs", "60", "--seeds", "1", "2")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT, env=env)
    deadline = time.monotonic() + 240
    while not (run_dir / "seeds" / "seed_1.json").is_file():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0]
        time.sleep(0.05)
    proc.send_signal(signal.SIGUSR1)
    out = proc.communicate(timeout=240)[0]
    assert proc.returncode == 0 and "stopping: seed 2 stopped at step" in out, out
    assert (run_dir / "stopped_by_signal").read_text() == "race seed 2"
    assert sorted(p.name for p in (run_dir / "seeds").iterdir()) == ["seed_1.json", "stopped.json"]
    assert not (run_dir / "results.json").exists()
    stopped_at = json.loads((run_dir / "seeds" / "stopped.json").read_text())
    assert stopped_at["seed"] == 2 and f"seed 2 stopped at step {stopped_at['step']}" in out
    first = json.loads((run_dir / "seeds" / "seed_1.json").read_text())
    run_id = (run_dir / "mlflow_run_id").read_text()
    assert mlflow.MlflowClient(env["MLFLOW_TRACKING_URI"]).get_run(run_id).info.status == "KILLED"

    (run_dir / "stopped_by_signal").unlink()  # as slurm/launch.sh does before it starts the step again
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert again.returncode == 0, again.stdout + again.stderr
    assert "seed 1: finished by an earlier run" in again.stdout and "the median by dev total of 2 seeds" in again.stdout
    results = json.loads((run_dir / "results.json").read_text())
    assert [s["seed"] for s in results["seeds"]] == [1, 2]
    assert results["seeds"][0]["accuracy"] == first["accuracy"] and results["seeds"][0]["final_loss"] == first["losses"][-1]
    assert len(json.loads((run_dir / "seeds" / "seed_2.json").read_text())["losses"]) == 60 * 2
    run = mlflow.MlflowClient(env["MLFLOW_TRACKING_URI"]).get_run(run_id)
    assert run.info.status == "FINISHED" and (run_dir / "mlflow_run_id").read_text() == run_id
    assert {"seed1/dev/acc_total", "seed2/dev/acc_total", "test/acc_total"} <= set(run.data.metrics)
    history = mlflow.MlflowClient(env["MLFLOW_TRACKING_URI"]).get_metric_history(run_id, "seed2/train/loss")
    assert sorted(m.step for m in history) == list(range(10, 121, 10))  # once each: the redo logs after the stop
    assert not (run_dir / "seeds" / "stopped.json").exists()

    other = subprocess.run(_race_cmd(ckpt, vocab_file, run_dir, "--epochs", "60", "--seeds", "1", "2", "--lr", "2e-3"),
                           capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert other.returncode == 2 and "other settings (lr differ)" in other.stderr and "--run-dir" in other.stderr, other.stderr


def _precision_rank(vocab: str, tp: int, precision: str) -> tuple[list[float], float, dict]:
    """One seed of 40 steps (40 epochs of 10 questions, batch 10) at TP=tp x DP=world/tp: losses, last loss scale, accuracies."""
    import torch.distributed as dist

    from repro.eval.race_finetune import FinetuneOptions, run_seed
    from repro.parallel.groups import ParallelDims, ProcessGroups, build_process_groups

    world = dist.get_world_size() if dist.is_initialized() else 1
    pg = build_process_groups(ParallelDims.from_world(tp, world)) if world > 1 else ProcessGroups.single()
    tok = bert_tokenizer(Path(vocab))
    splits = {s: encode_race(load_race(FIXTURE, s), tok, TINY["seq_length"]) for s in ("train", "dev", "test")}
    scales = []
    opts = FinetuneOptions(epochs=40, batch_size=10, lr=1e-3, seed=5, precision=precision, log_every=1)
    result = run_seed(BertConfig(vocab_size=tok.vocab_size, **TINY), None, splits, opts, pg,
                      lambda m, i: scales.append(m.get("train/loss_scale", 0.0)))
    return result.losses, scales[-1], result.accuracy


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_fine_tuning_learns_and_agrees_over_ranks(vocab_file, precision):
    """bf16/fp16 autocast over fp32 weights. bf16: the first 5 steps' losses within 0.02 nats of fp32's
    (bf16 rounding; later the memorising trajectories part), and the loss halves. fp16 starts at
    Megatron's 2^32 loss scale and skips its first overflowing steps (many of these 40, a negligible
    share of RACE's ~8k), so it ends higher but still learns; at DP=2 every rank skips the same steps and gets the
    same scale and accuracies (the serial run's overflow steps may differ: rounding differs by layout). "Learns":
    the last 5 steps' mean loss under 3/4 of the first."""
    fp32, _, _ = _precision_rank(str(vocab_file), 1, "fp32")
    half, scale, _ = _precision_rank(str(vocab_file), 1, precision)
    assert len(half) == len(fp32) == 40
    if precision == "bf16":
        assert half[-1] < 0.5 * half[0] and max(abs(a - b) for a, b in zip(half[:5], fp32[:5])) < 0.02, (half, fp32)
    else:
        assert 2.0**8 < scale < 2.0**32 and _last_five(half) < 0.75 * half[0], (scale, half)
        ranks = run_ranks(_precision_rank, 2, str(vocab_file), 1, precision, timeout=300)
        assert ranks[0] == ranks[1]  # the same steps skipped, the same scale, the same accuracies
        losses, dp_scale, _ = ranks[0]
        assert 2.0**8 < dp_scale < 2.0**32 and _last_five(losses) < 0.75 * losses[0], (dp_scale, losses)


def _last_five(losses: list[float]) -> float:
    """The mean loss of the last 5 steps: one step's loss on its 10 questions swings by ~0.3 nats here
    (a change in rounding order alone moved the last one from 0.90 to 1.04), five steps' mean by less."""
    return sum(losses[-5:]) / 5


def test_tp_defaults_to_the_smallest_degree_that_fits_the_gpu():
    """Without --tp: 1 on CPU; on GPUs the smallest TP dividing heads and world whose fp32 weights,
    gradients and Adam state (16 B a parameter, x1.25) fit: the paper's BERTs on 8 V100s of 31.7 GiB
    (as torch reports a 32 GB card) take 1 / 1 / 4 (3.9B needs ~72 GiB at TP=1); on H200s all fit at 1."""
    from repro.cli import UserError
    from repro.eval.race_cli import choose_tp
    from repro.models.sizes import get_size

    bert = {n: BertConfig(**get_size(n).model_config().__dict__) for n in ("bert-336m", "bert-1.3b", "bert-3.9b")}
    v100, h200 = 31.7 * 2**30, 139.8 * 2**30
    assert [choose_tp(cfg, 8, v100) for cfg in bert.values()] == [1, 1, 4]
    assert [choose_tp(cfg, 8, h200) for cfg in bert.values()] == [1, 1, 1]
    assert choose_tp(bert["bert-3.9b"], 8, None) == 1 and choose_tp(bert["bert-3.9b"], 8, 16 * 2**30) == 8
    with pytest.raises(UserError, match="Fix: launch more ranks, or give --tp"):
        choose_tp(bert["bert-3.9b"], 2, 16 * 2**30)


def test_the_default_paper_size_is_refused_on_cpu_without_a_checkpoint(tmp_path, vocab_file):
    """No --checkpoint/--model-config builds bert-336m at 512 positions: ~24 GB on a CPU, killed by the
    kernel with no message; it is refused (exit 2) naming --model-config, before any run is logged."""
    if torch.cuda.is_available():
        return
    cmd = [sys.executable, "-m", "repro.cli", "finetune", "race", "--race-dir", str(FIXTURE), "--vocab",
           str(vocab_file), "--run-dir", str(tmp_path / "run"), "--seeds", "1"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 2 and "--model-config experiments/bert/tiny_cpu.yaml" in out.stderr, out.stderr
    assert not (tmp_path / "run").exists()



def test_each_article_is_tokenized_once(tok):
    """encode_race's cache: the questions of one file share its article's encoding (it encoded the
    article again for every question: ~3.5 times the work on full RACE)."""
    questions = load_race(FIXTURE, "train")
    articles = {q.article for q in questions}
    calls = []

    class Counting:
        def __getattr__(self, name):
            return getattr(tok, name)

        def encode(self, text):
            calls.append(text)
            return tok.encode(text)

    assert len(questions) > len(articles)
    counted = encode_race(questions, Counting(), 64)
    assert sum(text in articles for text in calls) == len(articles)
    assert torch.equal(counted.tokens, encode_race(questions, tok, 64).tokens)
