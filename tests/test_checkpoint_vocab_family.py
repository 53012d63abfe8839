"""export-megatron then import-megatron gives the same GPT back, whatever its vocab_size (50304, the
reviewer's, allowed in training, re-imported as GPT-2's 50257 before the fix, dropping trained output
rows), and a meta.json `family` other than gpt or bert is refused naming the file (it was built as a GPT
before). The commands run as the CLI does, in subprocesses started outside the checkout."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from repro.models.config import ModelConfig
from repro.models.gpt import GPT
from repro.parallel.groups import ProcessGroups
from repro.train import reshard as rs


def _cli(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "repro.cli", "checkpoint", *args], capture_output=True, text=True,
                          timeout=300, cwd=cwd, env={**os.environ, "OMP_NUM_THREADS": "1"})


def _write_gpt(ckpt: Path, **model) -> Path:
    """A tiny TP=1 model-only GPT checkpoint; its rows past GPT-2's 50257 tokens trained away from init."""
    cfg = ModelConfig(num_layers=1, hidden_size=32, num_attention_heads=4, seq_length=16, hidden_dropout=0.0,
                      attention_dropout=0.0, **model)
    gpt = GPT(cfg, seed=1)
    with torch.no_grad():
        gpt.transformer.wte.weight[50257:cfg.vocab_size] += 0.5
    ckpt.mkdir(parents=True)
    torch.save(gpt.state_dict(), ckpt / "model_tp00.pt")
    meta = {"format": 1, "tp": 1, "family": "gpt", "model": dataclasses.asdict(cfg)}
    (ckpt / "meta.json").write_text(json.dumps(meta))
    return ckpt


def _loss(ckpt: Path) -> tuple[int, torch.Tensor]:
    model = rs.load_model_for_eval(ckpt, ProcessGroups.single())
    ids = torch.arange(32).view(2, 16) * 1571 % min(model.cfg.vocab_size, 50257)
    labels = (50303 - torch.arange(32).view(2, 16) * 37) % model.cfg.vocab_size  # rows past 50257 where there are
    with torch.no_grad():
        return model.cfg.vocab_size, model.loss(ids, labels)


@pytest.mark.parametrize("vocab_size, tp", [(50304, 1), (50304, 2), (50257, 2)])
def test_export_then_import_megatron_gives_the_same_gpt_back(tmp_path, vocab_size, tp):
    src = _write_gpt(tmp_path / "src", vocab_size=vocab_size)
    for args in (["export-megatron", str(src), "--out", str(tmp_path / "meg"), "--tp", str(tp)],
                 ["import-megatron", str(tmp_path / "meg"), "--out", str(tmp_path / "back")]):
        proc = _cli(tmp_path, *args)
        assert proc.returncode == 0, proc.stdout + proc.stderr
    (_, before), (size, after) = _loss(src), _loss(tmp_path / "back")
    assert size == vocab_size and torch.equal(before, after) and torch.isfinite(before).all()
    first, again = rs.load_full_model_state(src)[1], rs.load_full_model_state(tmp_path / "back")[1]
    assert first.keys() == again.keys() and all(torch.equal(first[k], again[k]) for k in first)
    assert again["transformer.wte.weight"].shape[0] == vocab_size
    saved = torch.load(tmp_path / "meg/release/mp_rank_00/model_optim_rng.pt", weights_only=False)["args"]
    assert getattr(saved, "vocab_size", None) == vocab_size  # Megatron's own --vocab-size (NullTokenizer's only)
    assert saved.tokenizer_type == "GPT2BPETokenizer"
    assert saved.padded_vocab_size == -(-50257 // (128 * tp)) * 128 * tp  # what Megatron computes and compares


BAD_FAMILIES = {  # meta.json's family -> the model settings written with it
    "Bert, with BERT's settings (was: drop num_tokentypes from the GPT's config)": ("Bert", {"num_tokentypes": 2}),
    "GPT (was: resharded as a GPT, exit 0)": ("GPT", {}),
    "null": (None, {}),
}


@pytest.mark.parametrize("family, model", BAD_FAMILIES.values(), ids=BAD_FAMILIES.keys())
def test_a_family_other_than_gpt_or_bert_is_refused_naming_meta_json(tmp_path, family, model):
    """reshard and export-megatron refuse it (exit 2, nothing written); without a family, as checkpoints
    were written before meta.json had one, the checkpoint is a GPT as before."""
    ckpt = _write_gpt(tmp_path / "ck", vocab_size=1000)
    meta = json.loads((ckpt / "meta.json").read_text())
    (ckpt / "meta.json").write_text(json.dumps({**meta, "family": family, "model": {**meta["model"], **model}}))
    for args in (["reshard", str(ckpt), "--tp", "1"], ["export-megatron", str(ckpt)]):
        proc = _cli(tmp_path, *args, "--out", str(tmp_path / "out"))
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stdout + proc.stderr
        err = proc.stderr.strip().splitlines()[-1]
        assert err.startswith(f"error: {ckpt / 'meta.json'}: `family` is {family!r}, not one of "), err
        assert "gpt or bert" in err and not (tmp_path / "out").exists(), err
    (ckpt / "meta.json").write_text(json.dumps({k: v for k, v in meta.items() if k != "family"}))
    if not model:
        proc = _cli(tmp_path, "reshard", str(ckpt), "--tp", "2", "--out", str(tmp_path / "out"))
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert torch.equal(_loss(ckpt)[1], _loss(tmp_path / "out")[1])

