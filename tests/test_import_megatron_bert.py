"""`repro checkpoint import-megatron` of a Megatron-LM BERT (the legacy layout of NVIDIA's 345M BERT
releases: `language_model` + `lm_head` + `binary_head`): the imported model's masked-LM and
sentence-relation logits equal `transformers.MegatronBertForPreTraining` on the same weights (float32
within 1e-5 relative), at TP=2 x PP=2 and for the 2019 layout, and `repro finetune race` starts from it.

As in test_import_megatron.py the Megatron files are written from the Hugging Face model by the
layouts Megatron-LM documents (transformers' own Megatron-BERT converter reads the same names); the
reference is Hugging Face's model, not the importer.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from repro.models.bert import BERT
from repro.models.bert_checkpoint import load_full_state_dict, read_bert
from repro.models.megatron import ImportOptions
from repro.train import checkpoint as ck
from repro.train import reshard as rs
from test_import_megatron import _cli, _qkv_rows

VOCAB = 30522
ROOT = Path(__file__).resolve().parents[1]


def _hf_bert(hidden_act: str, vocab: int = VOCAB):
    from transformers import MegatronBertConfig, MegatronBertForPreTraining

    torch.manual_seed(0)
    cfg = MegatronBertConfig(vocab_size=vocab, hidden_size=32, num_hidden_layers=4, num_attention_heads=4,
                             intermediate_size=128, max_position_embeddings=64, hidden_act=hidden_act,
                             layer_norm_eps=1e-5)  # Megatron-LM's default (HF's is 1e-12)
    model = MegatronBertForPreTraining(cfg).eval()
    with torch.no_grad():  # non-trivial norms and biases; GeLU inputs of order 1, where its forms differ
        for name, p in model.named_parameters():
            if name.endswith("bias") or "ln." in name or "LayerNorm" in name:
                p.add_(torch.randn_like(p) * 0.1)
            if name.endswith(("intermediate.dense.weight", "transform.dense.weight")):
                p.mul_(30)
    return model


def _megatron_bert_state(hf, *, version, tp, pp, rank, stage, binary_head=True, head_norm="layernorm") -> dict:
    """TP rank `rank`, pipeline stage `stage` of a legacy Megatron-LM BERT (nested as Megatron saves it);
    without `binary_head` as --bert-no-binary-head saves it: no binary head, pooler or token types;
    `head_norm`: the LM head's norm, `layernorm` or (built by `get_norm` since 2023) `norm`."""
    sd, cfg = hf.state_dict(), hf.config
    per_stage, heads = cfg.num_hidden_layers // pp, cfg.num_attention_heads
    rows = -(-cfg.vocab_size // (128 * tp)) * 128 * tp
    pad = torch.randn(rows - cfg.vocab_size, cfg.hidden_size, generator=torch.Generator().manual_seed(1))
    words = torch.cat([sd["bert.embeddings.word_embeddings.weight"], pad]).chunk(tp)[rank]
    layers = {}
    for i in range(per_stage):
        src = f"bert.encoder.layer.{stage * per_stage + i}."
        for kind in ("weight", "bias"):
            qkv = torch.cat([sd[f"{src}attention.self.{x}.{kind}"] for x in ("query", "key", "value")])
            cols = sd[f"{src}intermediate.dense.{kind}"].chunk(tp)[rank]
            layers |= {f"layers.{i}.input_layernorm.{kind}": sd[f"{src}attention.ln.{kind}"],
                       f"layers.{i}.attention.query_key_value.{kind}": _qkv_rows(qkv, version, heads, rank, tp),
                       f"layers.{i}.post_attention_layernorm.{kind}": sd[f"{src}ln.{kind}"],
                       f"layers.{i}.mlp.dense_h_to_4h.{kind}": cols}
        layers |= {f"layers.{i}.attention.dense.weight": sd[f"{src}attention.output.dense.weight"].chunk(tp, 1)[rank],
                   f"layers.{i}.attention.dense.bias": sd[f"{src}attention.output.dense.bias"],
                   f"layers.{i}.mlp.dense_4h_to_h.weight": sd[f"{src}output.dense.weight"].chunk(tp, 1)[rank],
                   f"layers.{i}.mlp.dense_4h_to_h.bias": sd[f"{src}output.dense.bias"]}
    model, stack = {}, {k: v.clone() for k, v in layers.items()}
    lm = {"transformer" if version < 2 else "encoder": stack}
    if stage == 0:
        lm["embedding"] = {"word_embeddings": {"weight": words},
                           "position_embeddings": {"weight": sd["bert.embeddings.position_embeddings.weight"]},
                           "tokentype_embeddings": {"weight": sd["bert.embeddings.token_type_embeddings.weight"]}}
    if stage == pp - 1:
        stack |= {f"final_layernorm.{k}": sd[f"bert.encoder.ln.{k}"] for k in ("weight", "bias")}
        lm["pooler"] = {f"dense.{k}": sd[f"bert.pooler.dense.{k}"] for k in ("weight", "bias")}
        bias = torch.cat([sd["cls.predictions.bias"], torch.zeros(rows - cfg.vocab_size)]).chunk(tp)[rank]
        model["lm_head"] = {"bias": bias, **{f"dense.{k}": sd[f"cls.predictions.transform.dense.{k}"] for k in
                                             ("weight", "bias")},
                            **{f"{head_norm}.{k}": sd[f"cls.predictions.transform.LayerNorm.{k}"] for k in
                               ("weight", "bias")}}
        model["binary_head"] = {k: sd[f"cls.seq_relationship.{k}"] for k in ("weight", "bias")}
        if not binary_head:
            del model["binary_head"], lm["pooler"]
        if pp > 1:
            model["word_embeddings_for_head"] = {"weight": words.clone()}
    if not binary_head and stage == 0:
        del lm["embedding"]["tokentype_embeddings"]
    model["language_model"] = lm
    return model


def write_megatron_bert(root: Path, hf, *, version=2.0, tp=1, pp=1, args=True, binary_head=True,
                        head_norm="layernorm", **arg_overrides) -> Path:
    folder = root / "release"
    for rank in range(tp):
        for stage in range(pp):
            saved = {"iteration": 2000, "model": _megatron_bert_state(hf, version=version, tp=tp, pp=pp, rank=rank,
                                                                      stage=stage, binary_head=binary_head,
                                                                      head_norm=head_norm)}
            if version:
                saved["checkpoint_version"] = version
            if args:
                saved["args"] = argparse.Namespace(**{
                    "num_layers": 4, "hidden_size": 32, "num_attention_heads": 4, "tensor_model_parallel_size": tp,
                    "pipeline_model_parallel_size": pp, "tokenizer_type": "BertWordPieceLowerCase",
                    "bias_gelu_fusion": False, "openai_gelu": False, **arg_overrides})
            path = folder / (f"mp_rank_{rank:02d}" + (f"_{stage:03d}" if pp > 1 else "")) / "model_optim_rng.pt"
            path.parent.mkdir(parents=True)
            torch.save(saved, path)
    (root / "latest_checkpointed_iteration.txt").write_text("release")
    return root


def _ours_and_hf(ckpt: Path, hf):
    cfg, state = read_bert(ckpt)
    model = BERT(cfg).eval()
    load_full_state_dict(model, state)
    tokens = torch.arange(40).view(2, 20) * 761 % hf.config.vocab_size
    types = (torch.arange(20) >= 8).long().expand(2, 20)
    mask = torch.ones(2, 20, dtype=torch.long)
    mask[1, 15:] = 0  # padding in the second sequence
    with torch.no_grad():
        ours = model(tokens, types, mask)
        theirs = hf(input_ids=tokens, token_type_ids=types, attention_mask=mask)
    return cfg, ours, theirs


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool((a - b).abs().max() / b.abs().max() < 1e-5)


@pytest.mark.parametrize("layout", ["version 2.0 at TP=2 x PP=2", "2019: version 0, no arguments"])
def test_megatron_bert_imports_to_megatron_berts_logits(tmp_path, layout):
    """erf GeLU throughout (no bias-GeLU fusion, or --gelu erf where no arguments were saved)."""
    hf = _hf_bert("gelu")
    if layout.startswith("2019"):
        write_megatron_bert(tmp_path / "m", hf, version=0, args=False)
        options = ImportOptions(num_attention_heads=4, gelu="erf")
    else:
        write_megatron_bert(tmp_path / "m", hf, version=2.0, tp=2, pp=2)
        options = ImportOptions()
    rs.import_megatron(tmp_path / "m", tmp_path / "ck", tp=2, options=options)
    meta = ck.read_meta(tmp_path / "ck")
    assert meta["family"] == "bert" and meta["tp"] == 2 and meta["imported_with"] == "import-megatron"
    cfg, ours, theirs = _ours_and_hf(tmp_path / "ck", hf)
    assert (cfg.vocab_size, cfg.num_tokentypes, cfg.layernorm_order) == (VOCAB, 2, "pre")
    assert (cfg.gelu, cfg.lm_head_gelu) == ("erf", "erf")
    assert _close(ours.mlm_logits[..., :VOCAB], theirs.prediction_logits)
    assert _close(ours.sop_logits, theirs.seq_relationship_logits)


def test_fused_bias_gelu_mlp_keeps_tanh_while_the_lm_head_keeps_erf(tmp_path):
    """Megatron-LM's default BERT: the fused bias-GeLU MLP computes tanh, the LM head plain (erf) GeLU.
    Hugging Face has one form, so the encoder (tanh) is checked against a tanh model and the config
    records both forms."""
    hf = _hf_bert("gelu_new")
    write_megatron_bert(tmp_path / "m", hf, bias_gelu_fusion=True)
    rs.import_megatron(tmp_path / "m", tmp_path / "ck")
    cfg, ours, theirs = _ours_and_hf(tmp_path / "ck", hf)
    assert (cfg.gelu, cfg.lm_head_gelu) == ("tanh", "erf")
    assert _close(ours.sop_logits, theirs.seq_relationship_logits)  # encoder and pooler: exact
    assert not _close(ours.mlm_logits[..., :VOCAB], theirs.prediction_logits)  # the head's GeLU differs


def test_vocabulary_comes_from_the_tokenizer_type_or_the_padded_rows(tmp_path):
    """Cased WordPiece (28,996, padded by Megatron to 29,056) from the tokenizer type or, without
    arguments, from the row count; a row count no known vocabulary pads to needs --vocab-size."""
    cased = _hf_bert("gelu", vocab=28996)
    write_megatron_bert(tmp_path / "typed", cased, tokenizer_type="BertWordPieceCase")
    rs.import_megatron(tmp_path / "typed", tmp_path / "a")
    write_megatron_bert(tmp_path / "bare", cased, version=0, args=False)
    rs.import_megatron(tmp_path / "bare", tmp_path / "b", options=ImportOptions(num_attention_heads=4, gelu="erf"))
    assert ck.read_meta(tmp_path / "a")["model"]["vocab_size"] == ck.read_meta(tmp_path / "b")["model"]["vocab_size"] == 28996
    write_megatron_bert(tmp_path / "odd", _hf_bert("gelu", vocab=1000), version=0, args=False)
    proc = _cli("checkpoint", "import-megatron", str(tmp_path / "odd"), "--out", str(tmp_path / "c"),
                "--num-attention-heads", "4")
    assert proc.returncode == 2 and "--vocab-size" in proc.stderr, proc.stderr
    assert not (tmp_path / "c").exists()
    proc = _cli("checkpoint", "import-megatron", str(tmp_path / "odd"), "--out", str(tmp_path / "c"),
                "--num-attention-heads", "4", "--vocab-size", "1000")
    assert proc.returncode == 0 and "repro finetune race --checkpoint" in proc.stdout, proc.stdout + proc.stderr


def test_finetune_race_starts_from_an_imported_megatron_bert(tmp_path):
    """The RACE fixture with its own small WordPiece vocab: one epoch from the imported weights runs
    to the end, and the BERT table gives it a row of its own, as Megatron-LM weights pretrained
    elsewhere (never a paper row, never one of our MLM runs' perplexities)."""
    import os

    from repro.analysis import bert as bert_table
    import json

    from test_race import FIXTURE, write_fixture_vocab

    vocab_file = write_fixture_vocab(tmp_path / "vocab.txt")
    size = len(vocab_file.read_text().splitlines())
    write_megatron_bert(tmp_path / "m", _hf_bert("gelu", vocab=size), tp=2)
    rs.import_megatron(tmp_path / "m", tmp_path / "ck", options=ImportOptions(vocab_size=size))
    cmd = [sys.executable, "-m", "repro.cli", "finetune", "race", "--race-dir", str(FIXTURE), "--vocab", str(vocab_file),
           "--checkpoint", str(tmp_path / "ck"), "--epochs", "1", "--batch-size", "5", "--seq-length", "64",
           "--seeds", "1", "--run-dir", str(tmp_path / "run")]
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT,
                         env={**os.environ, "MLFLOW_TRACKING_URI": uri})
    assert out.returncode == 0, out.stdout + out.stderr
    results = json.loads((tmp_path / "run" / "results.json").read_text())
    assert [s["seed"] for s in results["seeds"]] == [1]
    assert all(0 <= results["median"][split]["total"] <= 100 for split in ("dev", "test"))
    table = bert_table.build(uri)
    row = table[table["model"] == f"{(tmp_path / 'm').resolve()} (imported)"].iloc[0]
    assert "fine-tuned from Megatron-LM weights pretrained elsewhere" in row["label"]
    assert row["race_total"] == results["median"]["test"]["total"] and row["mlm_valid_ppl"] is None
    shown = bert_table.display(table)
    assert (shown[shown["model"] == row["model"]]["measured MLM val ppl"] == "pretrained elsewhere").all()


def test_a_bert_trained_without_its_binary_head_imports_with_fresh_heads(tmp_path):
    """--bert-no-binary-head saves no binary head, pooler or token-type embeddings: the import warns, naming
    the flag, adds zero token types (Megatron's masked-LM logits unchanged) and a fresh pooler and SOP head
    (which RACE fine-tuning trains). A file whose arguments say it has the head is refused instead."""
    hf = _hf_bert("gelu")
    with torch.no_grad():  # the model Megatron ran: no token types
        hf.bert.embeddings.token_type_embeddings.weight.zero_()
    write_megatron_bert(tmp_path / "m", hf, tp=2, pp=2, binary_head=False, bert_binary_head=False)
    with pytest.warns(UserWarning, match="--bert-no-binary-head.*pooler.weight.*sop_head.weight"):
        rs.import_megatron(tmp_path / "m", tmp_path / "ck", tp=2)
    cfg, ours, theirs = _ours_and_hf(tmp_path / "ck", hf)
    assert cfg.num_tokentypes == 2 and ours.sop_logits.shape == (2, 2)
    assert _close(ours.mlm_logits[..., :VOCAB], theirs.prediction_logits)
    write_megatron_bert(tmp_path / "damaged", hf, binary_head=False, bert_binary_head=True)
    proc = _cli("checkpoint", "import-megatron", str(tmp_path / "damaged"), "--out", str(tmp_path / "c"))
    assert proc.returncode == 2 and "bert_binary_head=True but no rank file holds binary_head" in proc.stderr, \
        proc.stderr


@pytest.mark.parametrize("head_norm", ["layernorm", "norm"])
def test_zero_centered_layer_norms_of_a_legacy_bert_import_with_their_one_added(tmp_path, head_norm):
    """--apply-layernorm-1p stores gamma - 1 in the encoder's layer norms. The legacy LM head's
    `layernorm` was a plain LayerNorm (the switch never reached it) and keeps its gamma; its later
    `norm`, built by `get_norm`, follows the switch and gets its 1 back (before, `norm` was refused)."""
    hf = _hf_bert("gelu")
    stored = type(hf)(hf.config).eval()
    stored.load_state_dict(hf.state_dict())
    centred = ("ln.weight", "transform.LayerNorm.weight") if head_norm == "norm" else ("ln.weight",)
    with torch.no_grad():
        for name, p in stored.named_parameters():
            if name.startswith(("bert.encoder.", "cls.predictions.")) and name.endswith(centred):
                p.sub_(1.0)
    write_megatron_bert(tmp_path / "m", stored, tp=2, apply_layernorm_1p=True, head_norm=head_norm)
    rs.import_megatron(tmp_path / "m", tmp_path / "ck")
    _, ours, theirs = _ours_and_hf(tmp_path / "ck", hf)
    assert _close(ours.mlm_logits[..., :VOCAB], theirs.prediction_logits)
    assert _close(ours.sop_logits, theirs.seq_relationship_logits)
