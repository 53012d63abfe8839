"""`repro checkpoint import-megatron`: a Megatron-LM GPT checkpoint, in each layout Megatron-LM has
saved (checkpoint versions 0 to 3, legacy and megatron-core names, TP x PP rank folders, the pre-1.6
pickle format), becomes a model-only checkpoint whose logits equal Hugging Face's GPT-2 on the same
weights (float32 within 1e-5 relative: the layouts only move rows, TP only reorders sums).

The Megatron files are written here from a transformers GPT2LMHeadModel by the layouts Megatron-LM
documents (its checkpointing.py `_transpose_first_dim`: version 0 stores each TP rank's fused QKV rows
as [3, np, hn], 1.0 as [np, hn, 3], later ones as [np, 3, hn]); the reference is Hugging Face's model,
not the importer.
"""

from __future__ import annotations

import argparse
import enum
import io
import random
import sys
import types

import numpy as np
import pytest
import torch

from repro.models.megatron import ImportOptions
from repro.models.megatron_files import load_rank_file
from repro.parallel.groups import ProcessGroups
from repro.parallel.spawn import run_ranks
from repro.train import checkpoint as ck
from repro.train import reshard as rs
from test_import_hf import IDS, VOCAB, _cli, _logits_worker  # GPT-2's vocabulary; the TP ranks' logits on IDS

LEGACY = {"ln_1": "input_layernorm", "attn.c_attn": "attention.query_key_value", "attn.c_proj": "attention.dense",
          "ln_2": "post_attention_layernorm", "mlp.c_fc": "mlp.dense_h_to_4h", "mlp.c_proj": "mlp.dense_4h_to_h"}
CORE = {"ln_1": "input_layernorm", "attn.c_attn": "self_attention.linear_qkv", "attn.c_proj": "self_attention.linear_proj",
        "ln_2": "pre_mlp_layernorm", "mlp.c_fc": "mlp.linear_fc1", "mlp.c_proj": "mlp.linear_fc2"}
TE = {**CORE, "ln_1": "self_attention.linear_qkv.layer_norm_", "ln_2": "mlp.linear_fc1.layer_norm_"}
ROW_PARALLEL = ("attn.c_proj.weight", "mlp.c_proj.weight")
CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


def _hf_model(n_layer: int = 4, activation_function: str = "gelu_new"):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=VOCAB, n_positions=64, n_embd=32, n_layer=n_layer, n_head=4,
                     activation_function=activation_function)
    model = GPT2LMHeadModel(cfg).eval()
    with torch.no_grad():  # non-trivial layer norms and biases, so a mapping error cannot hide in 1s and 0s
        for name, p in model.named_parameters():
            if name.endswith("bias") or ".ln_" in name:
                p.add_(torch.randn_like(p) * 0.1)
            if name.endswith("mlp.c_fc.weight"):  # GeLU inputs of order 1, where tanh and erf forms differ
                p.mul_(30)
    return model


@pytest.fixture(scope="module")
def hf():
    return _hf_model()


def _hf_logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits


def _qkv_rows(t: torch.Tensor, version: float, heads: int, rank: int, tp: int) -> torch.Tensor:
    """TP rank `rank`'s fused QKV rows of HF's [q | k | v] in the checkpoint version's order."""
    rest = t.shape[1:]
    local = heads // tp
    x = t.reshape(3, heads, -1, *rest)[:, rank * local:(rank + 1) * local]  # [3, np, hn, ...]
    if version == 1:
        x = x.permute(1, 2, 0, *range(3, x.dim()))  # [np, hn, 3, ...]
    elif version >= 2:
        x = x.transpose(0, 1)  # [np, 3, hn, ...]
    return x.reshape(-1, *rest)


def _layer_param(name: str, t: torch.Tensor, version: float, heads: int, rank: int, tp: int) -> torch.Tensor:
    if name.endswith(CONV1D):
        t = t.t()  # HF's Conv1D is (in, out); Megatron's linears are (out, in)
    if ".c_attn." in name:
        return _qkv_rows(t, version, heads, rank, tp)
    if name.endswith(ROW_PARALLEL):
        return t.chunk(tp, dim=1)[rank]
    if ".c_fc." in name:
        return t.chunk(tp, dim=0)[rank]
    return t  # layer norms, row-parallel biases: on every rank


def _stage_state(hf_state: dict, cfg, *, version, tp, pp, rank, stage, names, core) -> dict:
    """Megatron's model state of TP rank `rank`, pipeline stage `stage`: legacy nested or core flat."""
    per_stage = cfg.n_layer // pp
    rows = -(-VOCAB // (128 * tp)) * 128 * tp  # Megatron pads to a multiple of 128 x tp (rows it never uses)
    pad = torch.randn(rows - VOCAB, cfg.n_embd, generator=torch.Generator().manual_seed(1))
    wte = torch.cat([hf_state["transformer.wte.weight"], pad]).chunk(tp)[rank]
    layers = {}
    for i in range(per_stage):
        prefix = f"transformer.h.{stage * per_stage + i}."
        for name, t in hf_state.items():
            if name.startswith(prefix) and not name.endswith((".attn.bias", ".attn.masked_bias")):
                part, kind = name[len(prefix):].rsplit(".", 1)
                ours = _layer_param(name, t, version, cfg.n_head, rank, tp)
                target = names[part] + kind if names[part].endswith("_") else f"{names[part]}.{kind}"
                layers[f"layers.{i}.{target}"] = ours.clone()
        if names is TE:
            layers[f"layers.{i}.self_attention.linear_qkv._extra_state"] = io.BytesIO(b"fp8 metadata")
    first, last = stage == 0, stage == pp - 1
    final = {f"final_layernorm.{k}": hf_state[f"transformer.ln_f.{k}"] for k in ("weight", "bias")} if last else {}
    if core:
        state = {f"decoder.{k}": v for k, v in {**layers, **final}.items()}
        if first:
            state |= {"embedding.word_embeddings.weight": wte,
                      "embedding.position_embeddings.weight": hf_state["transformer.wpe.weight"]}
        if last and pp > 1:
            state["output_layer.weight"] = wte.clone()
        return state
    stack = "transformer" if version < 2 else "encoder"
    lm = {stack: {**layers, **final}}
    if first:
        lm["embedding"] = {"word_embeddings": {"weight": wte},
                           "position_embeddings": {"weight": hf_state["transformer.wpe.weight"]}}
    state = {"language_model": lm}
    if last and pp > 1:
        state["word_embeddings_for_head"] = {"weight": wte.clone()}
    return state


def _fake_megatron_module():
    """A class from a module the importer cannot import (as Megatron's enums are without Megatron)."""
    module = types.ModuleType("megatron_absent.enums")

    class PositionEmbeddingType(enum.Enum):
        learned_absolute = 1

    PositionEmbeddingType.__module__, PositionEmbeddingType.__qualname__ = module.__name__, "PositionEmbeddingType"
    module.PositionEmbeddingType = PositionEmbeddingType
    return module


def write_megatron(root, model, *, version=3.0, tp=1, pp=1, names=LEGACY, args=True, legacy_pickle=False,
                   release=True, tracker=True, edit=None, **arg_overrides):
    """Save `model` as Megatron-LM does: ROOT/latest_checkpointed_iteration.txt, ROOT/{release,iter_N}/mp_rank_*;
    `edit(saved, rank, stage)` may change a rank file's contents first."""
    cfg, hf_state = model.config, {k: v.detach().clone() for k, v in model.state_dict().items()}
    core = names is not LEGACY
    folder = root / ("release" if release else "iter_0000500")
    module = _fake_megatron_module()
    package = types.ModuleType("megatron_absent")
    package.enums = module
    sys.modules |= {package.__name__: package, module.__name__: module}  # while saving only, like Megatron itself
    try:
        for rank in range(tp):
            for stage in range(pp):
                saved = {"iteration": 500, "model": _stage_state(hf_state, cfg, version=version, tp=tp, pp=pp, rank=rank,
                                                                 stage=stage, names=names, core=core),
                         "optimizer": {"loss_scaler": module.PositionEmbeddingType.learned_absolute},
                         "rng_state": [{"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state()}]}
                if version:
                    saved["checkpoint_version"] = version
                if args:
                    saved["args"] = argparse.Namespace(**{
                        "num_layers": cfg.n_layer, "hidden_size": cfg.n_embd, "num_attention_heads": cfg.n_head,
                        "ffn_hidden_size": 4 * cfg.n_embd, "max_position_embeddings": cfg.n_positions,
                        "tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp,
                        "tokenizer_type": "GPT2BPETokenizer", "bias_gelu_fusion": True, "openai_gelu": False,
                        "position_embedding_type": module.PositionEmbeddingType.learned_absolute,
                        "hidden_dropout": 0.1, "attention_dropout": 0.1, "init_method_std": 0.02,
                        "layernorm_epsilon": 1e-5, "params_dtype": torch.float16, **arg_overrides})
                if edit is not None:
                    edit(saved, rank, stage)
                path = folder / (f"mp_rank_{rank:02d}" + (f"_{stage:03d}" if pp > 1 else "")) / "model_optim_rng.pt"
                path.parent.mkdir(parents=True)
                torch.save(saved, path, _use_new_zipfile_serialization=not legacy_pickle)
    finally:
        del sys.modules[module.__name__], sys.modules[package.__name__]
    if tracker:
        (root / "latest_checkpointed_iteration.txt").write_text("release" if release else "500")
    return root


def _logits(ckpt) -> torch.Tensor:
    with torch.no_grad():
        return rs.load_model_for_eval(ckpt, ProcessGroups.single())(IDS)[..., :VOCAB]


LAYOUTS = {  # name: (write_megatron keywords, import keywords)
    "2019 release: version 0, no arguments, pre-1.6 pickle": (
        dict(version=0, args=False, legacy_pickle=True), dict(num_attention_heads=4)),
    "version 0 at TP=2": (dict(version=0, tp=2, args=False, release=False), dict(num_attention_heads=4)),
    "NVIDIA's 345M zip, unzipped: release/ without a tracker file": (
        dict(version=0, args=False, tracker=False), dict(num_attention_heads=4)),
    "version 1.0 at TP=2": (dict(version=1.0, tp=2), {}),
    "version 2.0 at TP=2 x PP=2": (dict(version=2.0, tp=2, pp=2), {}),
    "megatron-core at TP=2 x PP=2": (dict(version=3.0, tp=2, pp=2, names=CORE), {}),
    "megatron-core, Transformer Engine names": (dict(version=3.0, tp=1, names=TE), {}),
}


def test_gelu_form_follows_the_saved_arguments(tmp_path):
    """Without bias-GeLU fusion or --openai-gelu Megatron-LM computes the erf GeLU: the import keeps it
    and gives an erf GPT-2's logits; --gelu sets the form where no arguments were saved."""
    erf = _hf_model(activation_function="gelu")
    ref = _hf_logits(erf)
    write_megatron(tmp_path / "args", erf, bias_gelu_fusion=False, openai_gelu=False)
    rs.import_megatron(tmp_path / "args", tmp_path / "a")
    assert ck.read_meta(tmp_path / "a")["model"]["gelu"] == "erf"
    assert (_logits(tmp_path / "a") - ref).abs().max() / ref.abs().max() < 1e-5
    write_megatron(tmp_path / "no_args", erf, args=False)
    proc = _cli("checkpoint", "import-megatron", str(tmp_path / "no_args"), "--out", str(tmp_path / "b"),
                "--num-attention-heads", "4", "--gelu", "erf")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (_logits(tmp_path / "b") - ref).abs().max() / ref.abs().max() < 1e-5
    # without arguments or --gelu, tanh is assumed: not the erf model's logits
    rs.import_megatron(tmp_path / "no_args", tmp_path / "c", options=ImportOptions(num_attention_heads=4))
    assert (_logits(tmp_path / "c") - ref).abs().max() / ref.abs().max() > 1e-4


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_megatron_layout_imports_to_hugging_faces_logits(hf, tmp_path, layout):
    written, options = LAYOUTS[layout]
    write_megatron(tmp_path / "megatron", hf, **written)
    rs.import_megatron(tmp_path / "megatron", tmp_path / "ck", tp=2, options=ImportOptions(**options))
    meta = ck.read_meta(tmp_path / "ck")
    assert meta["tp"] == 2 and meta["model_only"] and meta["imported_with"] == "import-megatron"
    assert (meta["megatron_tp"], meta["megatron_pp"]) == (written.get("tp", 1), written.get("pp", 1))
    assert meta["megatron_checkpoint_version"] == written["version"] and meta["megatron_iteration"] == 500
    assert meta["model"]["num_layers"] == 4 and meta["model"]["seq_length"] == 64
    ref = _hf_logits(hf)
    assert (_logits(tmp_path / "ck") - ref).abs().max() / ref.abs().max() < 1e-5


def test_cli_imports_a_tp2_pp2_run_that_tp2_ranks_evaluate(hf, tmp_path):
    write_megatron(tmp_path / "megatron", hf, version=3.0, tp=2, pp=2, release=False)
    proc = _cli("checkpoint", "import-megatron", str(tmp_path / "megatron"), "--out", str(tmp_path / "ck"), "--tp", "2")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "import-megatron" in ck.read_meta(tmp_path / "ck")["imported_with"]
    ref = _hf_logits(hf)
    tp2 = torch.tensor(run_ranks(_logits_worker, 2, str(tmp_path / "ck"), 2)[0])
    assert (tp2 - ref).abs().max() / ref.abs().max() < 1e-5


def test_rank_files_load_without_megatron_and_without_running_pickled_code(hf, tmp_path):
    """Megatron's classes become inert placeholders and argparse.Namespace is kept; a pickle that would
    call a function gets a placeholder too, so nothing in a file runs."""
    write_megatron(tmp_path / "m", hf)
    saved = load_rank_file(tmp_path / "m" / "release" / "mp_rank_00" / "model_optim_rng.pt")
    assert isinstance(saved["args"], argparse.Namespace) and saved["args"].num_attention_heads == 4
    assert type(saved["args"].position_embedding_type).__name__ == "PositionEmbeddingType"
    assert isinstance(saved["model"]["language_model"]["embedding"]["word_embeddings"]["weight"], torch.Tensor)

    class Exploit:
        def __reduce__(self):
            return (print, ("pickled code ran",))

    torch.save({"model": {}, "x": Exploit()}, tmp_path / "evil.pt")
    proc = _cli("checkpoint", "import-megatron", str(tmp_path / "evil.pt"), "--out", str(tmp_path / "ck"),
                "--num-attention-heads", "4")
    assert proc.returncode == 2 and "pickled code ran" not in proc.stdout, proc.stdout + proc.stderr
    assert not (tmp_path / "ck").exists()


REFUSALS = {  # name: (write_megatron keywords, import CLI flags, words the error must hold)
    "SwiGLU": (dict(swiglu=True), [], "swiglu=True"),
    "rotary positions": (dict(position_embedding_type="rope"), [], "position_embedding_type='rope'"),
    "another tokenizer": (dict(tokenizer_type="SentencePieceTokenizer"), [], "tokenizer_type='SentencePieceTokenizer'"),
    "no arguments and no head count": (dict(args=False), [], "--num-attention-heads"),
    "a head count the arguments contradict": (dict(), ["--num-attention-heads", "8"], "differs from the checkpoint's 4"),
}


@pytest.mark.parametrize("case", REFUSALS)
def test_what_this_gpt_cannot_express_is_refused_by_name(hf, tmp_path, case):
    written, flags, named = REFUSALS[case]
    write_megatron(tmp_path / "m", hf, **written)
    proc = _cli("checkpoint", "import-megatron", str(tmp_path / "m"), "--out", str(tmp_path / "ck"), *flags)
    assert proc.returncode == 2 and named in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert not (tmp_path / "ck").exists()


def test_damaged_incomplete_or_foreign_checkpoints_are_refused(hf, tmp_path):
    import shutil

    def refused(path, *words):
        proc = _cli("checkpoint", "import-megatron", str(path), "--out", str(tmp_path / "ck"))
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
        assert all(w in proc.stderr for w in words), proc.stderr
        assert not (tmp_path / "ck").exists()

    write_megatron(tmp_path / "tp2", hf, tp=2, pp=2)
    shutil.rmtree(tmp_path / "tp2" / "release" / "mp_rank_01_001")
    refused(tmp_path / "tp2", "lacks mp_rank_01_001")
    refused(tmp_path / "tp2" / "release" / "mp_rank_00_000" / "model_optim_rng.pt", "TP=2 x PP=2", "whole checkpoint")
    def untie(saved, rank, stage):
        if stage == 1:
            saved["model"]["word_embeddings_for_head"]["weight"] += 1.0

    write_megatron(tmp_path / "untied", hf, tp=1, pp=2, edit=untie)
    refused(tmp_path / "untied", "differs from the word embedding")
    (tmp_path / "dist").mkdir()
    (tmp_path / "dist" / ".metadata").write_bytes(b"")
    (tmp_path / "dist" / "__0_0.distcp").write_bytes(b"")
    refused(tmp_path / "dist", "torch_dist", "--ckpt-convert-format torch")
    (tmp_path / "megatron.zip").write_bytes(b"PK")
    refused(tmp_path / "megatron.zip", "unzip")
    refused(tmp_path / "nowhere", "does not exist")
    write_megatron(tmp_path / "iters", hf, release=False)
    (tmp_path / "iters" / "latest_checkpointed_iteration.txt").unlink()
    refused(tmp_path / "iters", "import one of iter_0000500")
    def add_qk_norm(saved, rank, stage):
        saved["model"]["language_model"]["transformer"]["layers.0.attention.q_layernorm.weight"] = torch.ones(8)

    write_megatron(tmp_path / "qk", hf, version=1.0, edit=add_qk_norm)
    refused(tmp_path / "qk", "no counterpart", "layers.0.attention.q_layernorm.weight")


def test_zero_shot_table_names_megatron_weights_as_imported_from_megatron(hf, tmp_path, monkeypatch):
    """An eval of imported Megatron-LM weights gets its own row in the zero-shot table, labelled as
    Megatron-LM weights with the import command that made them."""
    from eval_helpers import mirror
    from repro.analysis.zeroshot import measured_models

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    write_megatron(tmp_path / "megatron", hf, version=3.0, tp=2)
    rs.import_megatron(tmp_path / "megatron", tmp_path / "ck")
    proc = _cli("eval", "lambada", "--checkpoint", str(tmp_path / "ck"), "--data-dir", str(mirror()),
                "--out", str(tmp_path / "eval.jsonl"), "--max-examples", "16")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    row = measured_models(uri).iloc[0]
    source = (tmp_path / "megatron").resolve()
    assert row["model"] == f"{source} (imported)" and row["label"] == "imported Megatron-LM weights, not trained here"
    assert row["provenance"].startswith(f"`repro checkpoint import-megatron {source}`")
    assert 0 <= row["lambada_acc"] <= 100


def test_half_precision_weights_import_as_float32(tmp_path):
    """An fp16 or bf16 run saves its model in that dtype: the import keeps those values, in float32."""
    for dtype in (torch.float16, torch.bfloat16):
        rounded = _hf_model().to(dtype)
        write_megatron(tmp_path / str(dtype), rounded, tp=2)
        rs.import_megatron(tmp_path / str(dtype), tmp_path / f"ck-{dtype}")
        state = rs.load_full_model_state(ck.resolve(tmp_path / f"ck-{dtype}"))[1]
        assert all(t.dtype == torch.float32 for t in state.values())
        ref = _hf_logits(rounded.float())
        assert (_logits(tmp_path / f"ck-{dtype}") - ref).abs().max() / ref.abs().max() < 1e-5


def _zero_centered(model, norms):
    """A copy of `model` whose layer-norm weights named by `norms(name)` hold gamma - 1, as Megatron-LM
    stores them under --apply-layernorm-1p (it computes with weight + 1)."""
    stored = type(model)(model.config).eval()
    stored.load_state_dict(model.state_dict())
    with torch.no_grad():
        for name, p in stored.named_parameters():
            if norms(name):
                p.sub_(1.0)
    return stored


@pytest.mark.parametrize("names, switch", [(LEGACY, "apply_layernorm_1p"), (CORE, "layernorm_zero_centered_gamma"),
                                           (TE, "apply_layernorm_1p")], ids=["legacy", "core", "te"])
def test_zero_centered_layer_norms_import_with_their_one_added(hf, tmp_path, names, switch):
    """Under --apply-layernorm-1p (megatron-core: layernorm_zero_centered_gamma) each layer norm stores
    gamma - 1; read as gamma it was another model (logits 0.9 off relatively). The import adds the 1 back."""
    stored = _zero_centered(hf, lambda name: name.endswith("weight") and (".ln_" in name or "ln_f" in name))
    write_megatron(tmp_path / "m", stored, names=names, tp=2, **{switch: True})
    rs.import_megatron(tmp_path / "m", tmp_path / "ck")
    ref = _hf_logits(hf)
    assert (_logits(tmp_path / "ck") - ref).abs().max() / ref.abs().max() < 1e-5


def test_megatron_core_ignores_openai_gelu_and_legacy_models_honour_it(tmp_path):
    """--openai-gelu without the bias-GeLU fusion: the legacy models ran tanh, megatron-core's MLP (its
    config.activation_func) erf; each import gives that model's logits."""
    erf, tanh = _hf_model(activation_function="gelu"), _hf_model()
    for names, model, form in ((CORE, erf, "erf"), (LEGACY, tanh, "tanh")):
        out = tmp_path / form
        write_megatron(out / "m", model, names=names, openai_gelu=True, bias_gelu_fusion=False)
        rs.import_megatron(out / "m", out / "ck")
        assert ck.read_meta(out / "ck")["model"]["gelu"] == form
        ref = _hf_logits(model)
        assert (_logits(out / "ck") - ref).abs().max() / ref.abs().max() < 1e-5


def test_gelu_forms_follow_each_generations_rules():
    """(MLP, BERT LM head): legacy honours --openai-gelu in both; megatron-core's MLP is tanh only with
    the fusion, its BertLMHead always F.gelu (erf)."""
    from repro.models.megatron import gelu_forms

    cases = {(True, True): (("tanh", "tanh"), ("tanh", "erf")), (True, False): (("tanh", "tanh"), ("erf", "erf")),
             (False, True): (("tanh", "erf"), ("tanh", "erf")), (False, False): (("erf", "erf"), ("erf", "erf"))}
    for (openai, fused), (legacy, core) in cases.items():
        args = argparse.Namespace(openai_gelu=openai, bias_gelu_fusion=fused)
        assert (gelu_forms(args), gelu_forms(args, core=True)) == (legacy, core), (openai, fused)
    assert gelu_forms(None) == ("tanh", "tanh") and gelu_forms(None, "erf", core=True) == ("erf", "erf")
