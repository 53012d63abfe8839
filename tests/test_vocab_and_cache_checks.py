"""Review fixes: a GPT with fewer ids than GPT-2 BPE is refused by zero-shot eval, generation and the
lm-eval model (exit 2, before any text is tokenized; a padded vocabulary still works); BERT's
model.vocab_size is checked against its WordPiece vocabulary; an empty sample cache is rebuilt, and a
written one synced before its rename; a data.cache_dir that cannot be created warns (the caches stay in
memory) and is made only by the rank that writes it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from bert_fixtures import bert_corpus  # noqa: F401  (pytest fixtures)
from data_fixtures import bert_tokenizer  # noqa: F401
from eval_helpers import mirror, write_tiny_checkpoint
from train_fixtures import corpus, data_dir, data_mirror, tiny_overrides  # noqa: F401

ROOT = Path(__file__).resolve().parents[1]
SMALL = "has model.vocab_size=30522, but zero-shot evaluation and generation tokenize with GPT-2 BPE (50257 ids)"
SEQ = 64


def _run(cwd: Path, *argv: str, module: str = "repro.cli") -> subprocess.CompletedProcess:
    """`python -m module argv` in cwd (not the checkout: the code under test is the one on the path)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", module, *argv], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300)


def _sets(overrides: dict) -> list[str]:
    return [a for k, v in overrides.items() for a in ("--set", f"{k}={v}")]


# ---- 1: zero-shot eval, generation and lm-eval need a GPT-2-vocabulary GPT ---------------------------

@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[int, Path]:
    """Tiny GPT run dirs by model.vocab_size: WordPiece's 30522 (too few ids) and a padded 50304."""
    base = tmp_path_factory.mktemp("vocab")
    for vocab in (30522, 50304):
        write_tiny_checkpoint(base / f"v{vocab}", seq_length=SEQ, vocab_size=vocab)
    return {vocab: base / f"v{vocab}" for vocab in (30522, 50304)}


@pytest.mark.parametrize("command", [
    ["eval", "lambada", "--max-examples", "2", "--no-mlflow"],
    ["eval", "wikitext", "--max-lines", "5", "--window", str(SEQ), "--stride", str(SEQ), "--no-mlflow"],
    ["generate", "--prompt", "", "--max-new-tokens", "3"],
    ["generate", "--prompt", "The tower is", "--max-new-tokens", "3"],
], ids=["lambada", "wikitext", "generate-unconditional", "generate-prompt"])
def test_eval_and_generate_refuse_a_gpt_with_fewer_ids_than_gpt2(checkpoints, tmp_path, command):
    """model.vocab_size=30522 (a GPT trained on a WordPiece corpus): exit 2 naming the checkpoint, its
    vocab_size and the fix, nothing written. Was an embedding RuntimeError traceback (exit 1), or for
    generate's prompt, exit 0 with the ids decoded as GPT-2 words. A padded 50304 still runs."""
    small, padded = tmp_path / "small.json", tmp_path / "padded.json"
    done = _run(tmp_path, *command, "--checkpoint", str(checkpoints[30522]), "--data-dir", str(mirror()),
                "--out", str(small))
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-3000:]
    assert SMALL in done.stderr and "Fix: use a GPT-2-vocabulary model" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr and "=== sample" not in done.stdout and not small.exists()
    done = _run(tmp_path, *command, "--checkpoint", str(checkpoints[50304]), "--data-dir", str(mirror()),
                "--out", str(padded))
    assert done.returncode == 0 and padded.is_file(), done.stdout[-2000:] + done.stderr[-3000:]


def test_lm_eval_model_refuses_a_gpt_with_fewer_ids_than_gpt2(checkpoints, tmp_path):
    """`repro-lm-eval --model_args checkpoint=...` on model.vocab_size=30522: exit 2 with the same
    message (was a RuntimeError traceback from the first batch, exit 1); a padded 50304 loads."""
    from repro.cli import UserError
    from repro.eval.local_tasks import write_local_tasks
    from repro.eval.lm_eval_adapter import MegatronReproLM

    tasks = write_local_tasks(mirror(), tmp_path / "tasks")
    done = _run(tmp_path, "--model", "megatron-repro", "--model_args",
                f"checkpoint={checkpoints[30522]},data_dir={mirror()}", "--device", "cpu",
                "--include_path", str(tasks), "--tasks", "lambada_openai_local", "--limit", "2",
                module="repro.eval.lm_eval_adapter")
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-3000:]
    assert SMALL in done.stderr and "Traceback" not in done.stderr, done.stderr[-3000:]
    lm = MegatronReproLM(checkpoint=str(checkpoints[50304]), data_dir=str(mirror()), device="cpu")
    assert lm.model.cfg.vocab_size == 50304
    with pytest.raises(UserError, match="model.vocab_size=30522"):
        MegatronReproLM(checkpoint=str(checkpoints[30522]), data_dir=str(mirror()), device="cpu")


# ---- 4: BERT's model.vocab_size against its WordPiece vocabulary -------------------------------------

def test_bert_training_with_fewer_ids_than_wordpiece_is_a_data_error(bert_corpus, data_dir,  # noqa: F811
                                                                      bert_tokenizer, tmp_path):  # noqa: F811
    """`repro train experiments/bert/tiny_cpu.yaml --set model.vocab_size=1000`: exit 2 naming the corpus,
    the two sizes and the fix (was the embedding's RuntimeError traceback, exit 1). A vocabulary of the
    tokenizer's size or padded beyond it is fine."""
    from repro.cli import UserError
    from repro.data.bert_dataset import BertDataset, BertOptions

    done = _run(tmp_path, "train", str(ROOT / "experiments/bert/tiny_cpu.yaml"), *_sets({
        "data.train_prefix": f"{bert_corpus}_train", "data.valid_prefix": f"{bert_corpus}_valid",
        "data.vocab_dir": data_dir, "data.cache_dir": tmp_path / "cache", "run_dir": tmp_path / "run",
        "tracking.enabled": "false", "train.train_iters": 2, "model.vocab_size": 1000}))
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-3000:]
    assert (f"{bert_corpus}_train: BERT samples use the 30,522-id WordPiece vocabulary, but model.vocab_size=1000"
            in done.stderr and "Fix: set model.vocab_size: 30522" in done.stderr), done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    opts = BertOptions(max_seq_length=SEQ)
    for vocab in (30522, 30720):
        assert BertDataset(f"{bert_corpus}_train", bert_tokenizer, opts, tmp_path, vocab_size=vocab).at(0)
    with pytest.raises(UserError, match="model.vocab_size=30521"):
        BertDataset(f"{bert_corpus}_train", bert_tokenizer, opts, tmp_path, vocab_size=30521)


# ---- 2: an empty cache is rebuilt; a written one is synced before its rename -------------------------

def test_an_empty_sample_cache_is_rebuilt(corpus, bert_corpus, bert_tokenizer, tmp_path):  # noqa: F811
    """A zero-byte .npy (a crash after an unsynced rename) where the GPT sample order or BERT's sample
    map is cached: rebuilt and rewritten, the same samples as a fresh cache (np.load's EOFError was not
    caught: training died with a traceback)."""
    from repro.data.bert_dataset import BertDataset, BertOptions
    from repro.data.gpt_dataset import GPTDataset

    fresh = GPTDataset(corpus["train"], SEQ, seed=5, cache_dir=tmp_path / "fresh")
    path = GPTDataset(corpus["train"], SEQ, seed=5, cache_dir=tmp_path / "gpt").shuffle._path(0)
    path.parent.mkdir(exist_ok=True)
    path.write_bytes(b"")
    data = GPTDataset(corpus["train"], SEQ, seed=5, cache_dir=tmp_path / "gpt")
    assert np.array_equal(data.at(3), fresh.at(3))
    assert np.array_equal(np.load(path), fresh.shuffle.order(0))

    opts, prefix = BertOptions(max_seq_length=SEQ), f"{bert_corpus}_train"
    fresh = BertDataset(prefix, bert_tokenizer, opts, tmp_path / "bert")
    (bert_map,) = (tmp_path / "bert").glob("*_bert_map_*.npy")
    bert_map.write_bytes(b"")
    data = BertDataset(prefix, bert_tokenizer, opts, tmp_path / "bert")
    assert np.array_equal(data.samples, fresh.samples) and np.array_equal(np.load(bert_map), fresh.samples)


def test_a_written_cache_is_synced_before_its_rename(tmp_path, monkeypatch):
    """save_npy_atomic fsyncs the temporary file before os.replace, as provenance.write_atomic, so a
    crash leaves the old cache or the new one, not an empty file under the final name."""
    from repro.data.sampler import cached_array

    events, fsync, replace = [], os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: (events.append("fsync"), fsync(fd))[1])
    monkeypatch.setattr(os, "replace", lambda a, b: (events.append("replace"), replace(a, b))[1])
    order = cached_array(tmp_path / "order.npy", lambda: np.arange(7), lambda a: a.shape == (7,))
    assert events == ["fsync", "replace"] and np.array_equal(np.load(tmp_path / "order.npy"), order)


# ---- 3: data.cache_dir is made only when written; one that cannot be made warns ----------------------

def test_a_cache_dir_that_cannot_be_created_warns_and_training_goes_on(corpus, tmp_path):  # noqa: F811
    """data.cache_dir under a regular file: the trainer warns naming data.cache_dir and keeps the
    sample orders in memory, as for an unwritable one (was a NotADirectoryError traceback on every
    rank after the model was built)."""
    (tmp_path / "afile").write_text("")
    overrides = dict(o.split("=", 1) for o in tiny_overrides(corpus, tmp_path / "run", **{
        "train.train_iters": 2, "train.log_interval": 1, "data.cache_dir": tmp_path / "afile" / "cache"}))
    done = _run(tmp_path, "train", str(ROOT / "experiments/tiny/gpt_tiny.yaml"), *_sets(overrides))
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert "could not cache the sample index" in done.stderr and "data.cache_dir" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr and "iteration      2/2" in done.stdout + done.stderr


def test_ranks_that_do_not_write_the_caches_do_not_create_the_cache_dir(corpus, bert_corpus,  # noqa: F811
                                                                        bert_tokenizer, tmp_path):
    """write_cache=False (every rank but the trainer's rank 0): samples built in memory, and no
    data.cache_dir made (each rank made it, even where it cannot be made)."""
    from repro.data.bert_dataset import BertDataset, BertOptions
    from repro.data.gpt_dataset import GPTDataset

    GPTDataset(corpus["train"], SEQ, cache_dir=tmp_path / "gpt", write_cache=False).at(0)
    BertDataset(f"{bert_corpus}_train", bert_tokenizer, BertOptions(max_seq_length=SEQ), tmp_path / "bert",
                write_cache=False).at(0)
    assert not (tmp_path / "gpt").exists() and not (tmp_path / "bert").exists()
    GPTDataset(corpus["train"], SEQ, cache_dir=tmp_path / "gpt" / "deep").at(0)  # the writer makes it
    assert len(list((tmp_path / "gpt" / "deep").glob("*.npy"))) == 1
