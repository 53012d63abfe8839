"""`repro checkpoint import-hf`: a transformers GPT2LMHeadModel becomes a model-only checkpoint whose
logits equal Hugging Face's at TP=1 and TP=2 (float32 within 1e-5 relative: TP only reorders sums),
that exports back bit for bit, and that `repro eval` scores."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from eval_helpers import mirror
from repro.models.config import ModelConfig
from repro.parallel.groups import ProcessGroups
from repro.parallel.spawn import run_ranks
from repro.train import checkpoint as ck
from repro.train import reshard as rs

VOCAB = 50257
IDS = torch.arange(48).view(3, 16) * 997 % VOCAB


def _hf_model(**overrides):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(**{"vocab_size": VOCAB, "n_positions": 64, "n_embd": 32, "n_layer": 2, "n_head": 4, **overrides})
    model = GPT2LMHeadModel(cfg).eval()
    with torch.no_grad():  # non-trivial layer norms and biases, so a mapping error cannot hide in 1s and 0s
        for name, p in model.named_parameters():
            if name.endswith("bias") or ".ln_" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return model


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf") / "gpt2-tiny"
    _hf_model().save_pretrained(path)
    return path


def _cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "repro.cli", *args], capture_output=True, text=True,
                          timeout=300, env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})


def _hf_logits(path) -> torch.Tensor:
    from transformers import GPT2LMHeadModel

    with torch.no_grad():
        return GPT2LMHeadModel.from_pretrained(path).eval()(IDS).logits


def _logits_worker(ckpt: str, tp: int) -> list:
    import torch.distributed as dist

    from repro.parallel.groups import ParallelDims, build_process_groups
    from repro.parallel.mappings import gather_from_tensor_parallel_region

    pg = build_process_groups(ParallelDims(tp, dist.get_world_size() // tp))
    model = rs.load_model_for_eval(ckpt, pg)
    with torch.no_grad():
        return gather_from_tensor_parallel_region(model(IDS), pg.tp_group)[..., :VOCAB].tolist()


def test_imported_gpt2_gives_hugging_faces_logits_at_tp1_and_tp2(hf_dir, tmp_path):
    proc = _cli("checkpoint", "import-hf", str(hf_dir), "--out", str(tmp_path / "ck"), "--tp", "2")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    meta = ck.read_meta(tmp_path / "ck")
    assert meta["tp"] == 2 and meta["imported_from"] == str(hf_dir.resolve()) and meta["model_only"]
    assert meta["model"]["seq_length"] == 64 and ModelConfig(**meta["model"]).padded_vocab_size(2) == 51200
    ref = _hf_logits(hf_dir)
    scale = ref.abs().max()
    with torch.no_grad():
        tp1 = rs.load_model_for_eval(tmp_path / "ck", ProcessGroups.single())(IDS)[..., :VOCAB]
    tp2 = torch.tensor(run_ranks(_logits_worker, 2, str(tmp_path / "ck"), 2)[0])
    assert (tp1 - ref).abs().max() / scale < 1e-5
    assert (tp2 - ref).abs().max() / scale < 1e-5


def test_import_then_export_is_bit_identical(hf_dir, tmp_path):
    """...and the export carries GPT-2 BPE as its tokenizer (AutoTokenizer loads it, tokenizing as our
    data and evaluation do, <|endoftext|> = 50256, the model's sequence length as its maximum)."""
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    from repro.data.tokenizers import build_tokenizer

    rs.import_hf(str(hf_dir), tmp_path / "ck", tp=2)
    proc = _cli("checkpoint", "export-hf", str(tmp_path / "ck"), "--out", str(tmp_path / "back"),
                "--data-dir", str(mirror()))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "and its tokenizer" in proc.stdout
    original, back = load_file(hf_dir / "model.safetensors"), load_file(tmp_path / "back" / "model.safetensors")
    assert original.keys() == back.keys()
    assert all(torch.equal(original[k], back[k]) for k in original)
    theirs, ours = AutoTokenizer.from_pretrained(tmp_path / "back"), build_tokenizer("gpt2", mirror())
    text = "Hello world, it's 1,000 km\u2014caf\u00e9 \U0001F600. Ende."
    assert theirs(text).input_ids == ours.encode(text)
    assert (theirs.eos_token_id, theirs.model_max_length) == (ours.eod, 64) == (50256, 64)


def test_export_without_the_vocabulary_writes_the_model_and_says_so(hf_dir, tmp_path):
    rs.import_hf(str(hf_dir), tmp_path / "ck", tp=1)
    (tmp_path / "empty").mkdir()
    proc = _cli("checkpoint", "export-hf", str(tmp_path / "ck"), "--out", str(tmp_path / "back"),
                "--data-dir", str(tmp_path / "empty"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "note: no tokenizer written" in proc.stdout and "repro data fetch" in proc.stdout
    assert (tmp_path / "back" / "model.safetensors").is_file() and not (tmp_path / "back" / "tokenizer.json").exists()


@pytest.mark.parametrize("overrides, named", [
    ({"activation_function": "relu"}, "activation_function='relu'"),
    ({"n_inner": 100}, "n_inner=100"),
    ({"scale_attn_by_inverse_layer_idx": True}, "scale_attn_by_inverse_layer_idx=True"),
    ({"vocab_size": 21128}, "vocab_size=21128"),
])
def test_a_model_this_gpt_cannot_express_is_refused_by_name(overrides, named, tmp_path):
    _hf_model(**overrides).save_pretrained(tmp_path / "hf")
    proc = _cli("checkpoint", "import-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "ck"))
    assert proc.returncode == 2 and named in proc.stderr, proc.stderr
    assert not (tmp_path / "ck").exists()


def test_untied_head_missing_model_and_occupied_out_are_user_errors(hf_dir, tmp_path):
    untied = _hf_model(tie_word_embeddings=False)
    with torch.no_grad():
        untied.lm_head.weight.add_(1.0)
    untied.save_pretrained(tmp_path / "untied")
    proc = _cli("checkpoint", "import-hf", str(tmp_path / "untied"), "--out", str(tmp_path / "a"))
    assert proc.returncode == 2 and "tie_word_embeddings=False" in proc.stderr, proc.stderr
    proc = _cli("checkpoint", "import-hf", str(tmp_path / "nowhere"), "--out", str(tmp_path / "b"))
    assert proc.returncode == 2 and "nowhere" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "keep.txt").write_text("mine")
    proc = _cli("checkpoint", "import-hf", str(hf_dir), "--out", str(tmp_path / "c"))
    assert proc.returncode == 2 and "already exists" in proc.stderr
    assert (tmp_path / "c" / "keep.txt").read_text() == "mine"
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_eval_scores_an_imported_model_like_hugging_face(hf_dir, tmp_path):
    """Non-overlapping windows of 64 over the first WikiText lines: the summed NLL `repro eval`
    reports equals Hugging Face's own model's on the same BPE tokens and windows (1e-5 relative)."""
    import torch.nn.functional as F
    from transformers import GPT2LMHeadModel

    from repro.data.tokenizers import build_tokenizer
    from repro.eval.wikitext import load_wikitext, sliding_windows

    rs.import_hf(str(hf_dir), tmp_path / "ck")
    out = tmp_path / "eval.jsonl"
    proc = _cli("eval", "wikitext", "--checkpoint", str(tmp_path / "ck"), "--data-dir", str(mirror()),
                "--window", "64", "--stride", "64", "--max-lines", "30", "--file", "raw",
                "--no-mlflow", "--out", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    metrics = json.loads(out.read_text().splitlines()[-1])["metrics"]
    data = load_wikitext(mirror() / "wikitext" / "wiki.test.raw", build_tokenizer("gpt2", mirror()), 30)
    tokens, hf = torch.tensor(data.tokens), GPT2LMHeadModel.from_pretrained(hf_dir).eval()
    total = 0.0
    with torch.no_grad():
        for w in sliding_windows(len(tokens), 64, 64):
            ids = tokens[w.start:w.start + w.length + 1]
            total += F.cross_entropy(hf(ids[None, :-1]).logits[0], ids[1:], reduction="sum").item()
    assert metrics["num_targets"] == len(tokens) - 1 > 500
    assert metrics["sum_nll"] == pytest.approx(total, rel=1e-5)


def test_missing_or_damaged_weights_are_refused_not_filled_at_random(hf_dir, tmp_path):
    """transformers fills a missing weight with random values and only warns: import-hf refuses."""
    import shutil

    from safetensors.torch import load_file, save_file

    partial = tmp_path / "partial"
    shutil.copytree(hf_dir, partial)
    weights = load_file(partial / "model.safetensors")
    del weights["transformer.h.1.mlp.c_fc.weight"]
    save_file(weights, partial / "model.safetensors", metadata={"format": "pt"})
    proc = _cli("checkpoint", "import-hf", str(partial), "--out", str(tmp_path / "a"))
    assert proc.returncode == 2 and "h.1.mlp.c_fc.weight" in proc.stderr, proc.stderr
    (partial / "model.safetensors").write_bytes(b"not a safetensors file")
    proc = _cli("checkpoint", "import-hf", str(partial), "--out", str(tmp_path / "b"))
    assert proc.returncode == 2 and "cannot import" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_zero_shot_table_names_an_imported_model_by_its_source(hf_dir, tmp_path, monkeypatch):
    """An eval of imported weights is logged with `imported_from`, and the zero-shot table gives it a
    row of its own, named by the source, instead of an 'unknown' training run; also when the import
    sits inside a training run's directory (whose mlflow_run_id names that run)."""
    from repro.analysis.zeroshot import measured_models

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    (tmp_path / "mlflow_run_id").write_text("0123456789abcdef0123456789abcdef")  # a training run's directory
    rs.import_hf(str(hf_dir), tmp_path / "ck")
    for task, limit in (("lambada", ["--max-examples", "16"]), ("wikitext", ["--max-lines", "20", "--window", "64"])):
        proc = _cli("eval", task, "--checkpoint", str(tmp_path / "ck"), "--data-dir", str(mirror()),
                    "--out", str(tmp_path / "eval.jsonl"), *limit)
        assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = measured_models(uri)
    assert len(rows) == 1, rows
    row = rows.iloc[0]
    assert row["model"] == f"{hf_dir.resolve()} (imported)" and not row["paper_size"]
    assert 0 <= row["lambada_acc"] <= 100 and row["wikitext_word_ppl"] > 1
    assert "import-hf" in row["provenance"] and "first 16 passages" in row["protocol"]


def test_an_erf_gelu_gpt2_imports_with_its_form_and_exports_it_back(tmp_path):
    """activation_function='gelu' (erf) becomes model.gelu='erf': Hugging Face's logits on import (MLP
    inputs of order 1, where the forms differ by ~1e-4 relative) and 'gelu' again on export."""
    from transformers import GPT2Config

    model = _hf_model(activation_function="gelu")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.c_fc.weight"):
                p.mul_(30)
    model.save_pretrained(tmp_path / "hf")
    rs.import_hf(str(tmp_path / "hf"), tmp_path / "ck")
    assert ck.read_meta(tmp_path / "ck")["model"]["gelu"] == "erf"
    ref = _hf_logits(tmp_path / "hf")
    with torch.no_grad():
        ours = rs.load_model_for_eval(tmp_path / "ck", ProcessGroups.single())(IDS)[..., :VOCAB]
    assert (ours - ref).abs().max() / ref.abs().max() < 1e-5
    proc = _cli("checkpoint", "export-hf", str(tmp_path / "ck"), "--out", str(tmp_path / "back"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert GPT2Config.from_pretrained(tmp_path / "back").activation_function == "gelu"
