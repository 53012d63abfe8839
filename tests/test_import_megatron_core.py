"""import-megatron against megatron-core itself: a GPTModel and a BertModel built from megatron-core's
own layers (the local layer spec, learned absolute positions, tied output layer) at TP=1 and TP=2 over
gloo are saved as Megatron-LM's training loop saves its `torch` format (saved arguments,
checkpoint_version 3.0, each rank's `state_dict_for_save_checkpoint()` in
iter_NNNNNNN/mp_rank_TT/model_optim_rng.pt), imported, and run by our GPT and BERT: the logits equal
megatron-core's own forward (1e-5 relative).

megatron-core's forward assumes a GPU in three places that do not concern the model's arithmetic; on
CPU its scratch buffer is allocated with torch.empty, its dropout RNG tracker (no dropout here) is a
no-op, and the causal mask is passed explicitly. The weights, names, QKV layout and the computation
are megatron-core's.
"""

from __future__ import annotations

import argparse
import contextlib

import pytest
import torch

from repro.parallel.groups import ProcessGroups
from repro.parallel.spawn import run_ranks
from repro.train import checkpoint as ck
from repro.train import reshard as rs
from test_import_hf import _cli

VOCAB, BERT_VOCAB, SEQ = 50257, 30522, 16
IDS = torch.arange(2 * SEQ).view(2, SEQ) * 997 % VOCAB
BERT_IDS = torch.arange(2 * SEQ).view(2, SEQ) * 761 % BERT_VOCAB
TYPES = (torch.arange(SEQ) >= 8).long().expand(2, SEQ)
PADDING = torch.tensor([[1] * SEQ, [1] * 11 + [0] * (SEQ - 11)])  # 1: a real token


def _on_cpu() -> None:
    """megatron-core's GPU-only helpers replaced by CPU ones (see the module docstring)."""
    from megatron.core import tensor_parallel, utils

    class NoDropoutRNG:
        def fork(self, *args, **kwargs):
            return contextlib.nullcontext()

    utils.GlobalMemoryBuffer.get_tensor = lambda self, shape, dtype, name, **kw: torch.empty(shape, dtype=dtype)
    tensor_parallel.get_cuda_rng_tracker = lambda *args, **kwargs: NoDropoutRNG()


def _perturb(model, rank: int) -> None:
    """Non-trivial layer norms and biases, GeLU inputs of order 1 (where its forms differ): replicated
    tensors alike on every rank, TP shards each their own."""
    with torch.no_grad():
        for i, (name, p) in enumerate(model.named_parameters()):
            gen = torch.Generator().manual_seed(1000 * i + (rank if getattr(p, "tensor_model_parallel", False) else 0))
            if name.endswith("bias") or "layernorm" in name:
                p.add_(torch.randn(p.shape, generator=gen) * 0.1)
            if name.endswith("linear_fc1.weight"):
                p.mul_(30)


def _config(tp: int):
    import torch.nn.functional as F
    from megatron.core import parallel_state
    from megatron.core.transformer.transformer_config import TransformerConfig

    _on_cpu()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    torch.manual_seed(0)  # use_cpu_initialization draws each master weight, then keeps this rank's slice
    return TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, use_cpu_initialization=True,
                             hidden_dropout=0.0, attention_dropout=0.0, activation_func=F.gelu,
                             bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
                             gradient_accumulation_fusion=False, persist_layer_norm=False, apply_rope_fusion=False)


def _save(root: str, model, tp: int, **args) -> None:
    """Megatron-LM's `torch`-format save of this rank's model (megatron/training/checkpointing.py)."""
    import os

    import torch.distributed as dist
    from megatron.core import parallel_state

    saved_args = argparse.Namespace(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=128,
                                    max_position_embeddings=SEQ, tensor_model_parallel_size=tp,
                                    pipeline_model_parallel_size=1, openai_gelu=False, bias_gelu_fusion=False,
                                    position_embedding_type="learned_absolute",
                                    untie_embeddings_and_output_weights=False, layernorm_epsilon=1e-5, **args)
    path = f"{root}/iter_0000010/mp_rank_{parallel_state.get_tensor_model_parallel_rank():02d}/model_optim_rng.pt"
    os.makedirs(path.rsplit("/", 1)[0])
    torch.save({"args": saved_args, "checkpoint_version": 3.0, "iteration": 10,
                "model": model.state_dict_for_save_checkpoint()}, path)
    if dist.get_rank() == 0:
        open(f"{root}/latest_checkpointed_iteration.txt", "w").write("10")


def _gather_vocab(shard: torch.Tensor) -> torch.Tensor:
    import torch.distributed as dist
    from megatron.core import parallel_state

    group = parallel_state.get_tensor_model_parallel_group()
    shards = [torch.empty_like(shard) for _ in range(dist.get_world_size(group))]
    dist.all_gather(shards, shard.contiguous(), group=group)
    return torch.cat(shards, dim=-1)


def _megatron_core_rank(root: str, tp: int) -> list:
    """Build, save and run a megatron-core GPT on this rank: the gathered logits of IDS."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    cfg = _config(tp)
    model = GPTModel(cfg, get_gpt_layer_local_spec(), vocab_size=_padded(VOCAB, tp), max_sequence_length=SEQ,
                     position_embedding_type="learned_absolute", share_embeddings_and_output_weights=True).eval()
    _perturb(model, parallel_state.get_tensor_model_parallel_rank())
    _save(root, model, tp, tokenizer_type="GPT2BPETokenizer")
    causal = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), 1)[None, None]  # True: masked
    with torch.no_grad():
        logits = _gather_vocab(model(IDS, torch.arange(SEQ).expand(2, SEQ), attention_mask=causal))
    parallel_state.destroy_model_parallel()
    return logits[..., :VOCAB].tolist()


def _megatron_core_loaded_rank(root: str, tp: int) -> list:
    """A megatron-core GPT of the same shape loading this rank's file of `root` (an export-megatron
    release) into its own parameters: the gathered logits of IDS."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    cfg = _config(tp)
    model = GPTModel(cfg, get_gpt_layer_local_spec(), vocab_size=_padded(VOCAB, tp), max_sequence_length=SEQ,
                     position_embedding_type="learned_absolute", share_embeddings_and_output_weights=True).eval()
    rank = parallel_state.get_tensor_model_parallel_rank()
    saved = torch.load(f"{root}/release/mp_rank_{rank:02d}/model_optim_rng.pt", weights_only=False)
    missing, unexpected = model.load_state_dict(saved["model"], strict=False)
    assert not unexpected and all(k.endswith("_extra_state") for k in missing), (missing, unexpected)
    assert saved["checkpoint_version"] == 3.0 and saved["args"].tensor_model_parallel_size == tp
    causal = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), 1)[None, None]
    with torch.no_grad():
        logits = _gather_vocab(model(IDS, torch.arange(SEQ).expand(2, SEQ), attention_mask=causal))
    parallel_state.destroy_model_parallel()
    return logits.tolist()  # over Megatron's padded vocabulary: it scores every column


def _megatron_core_bert_rank(root: str, tp: int) -> tuple[list, list]:
    """Build, save and run a megatron-core BERT on this rank: gathered MLM logits and binary logits."""
    from megatron.core import parallel_state
    from megatron.core.models.bert.bert_layer_specs import bert_layer_local_spec
    from megatron.core.models.bert.bert_model import BertModel

    cfg = _config(tp)
    model = BertModel(cfg, num_tokentypes=2, transformer_layer_spec=bert_layer_local_spec,
                      vocab_size=_padded(BERT_VOCAB, tp), max_sequence_length=SEQ, add_binary_head=True,
                      share_embeddings_and_output_weights=True).eval()
    _perturb(model, parallel_state.get_tensor_model_parallel_rank())
    _save(root, model, tp, tokenizer_type="BertWordPieceLowerCase")
    with torch.no_grad():
        mlm, binary = model(BERT_IDS, PADDING, tokentype_ids=TYPES)
        mlm = _gather_vocab(mlm)
    parallel_state.destroy_model_parallel()
    return mlm[..., :BERT_VOCAB].tolist(), binary.tolist()


def _padded(vocab: int, tp: int) -> int:
    return -(-vocab // (128 * tp)) * 128 * tp  # Megatron-LM's vocabulary padding


@pytest.mark.parametrize("tp", [1, 2])
def test_a_megatron_core_gpt_imports_to_megatron_cores_own_logits(tmp_path, tp):
    reference = torch.tensor(run_ranks(_megatron_core_rank, tp, str(tmp_path / "megatron"), tp, timeout=240)[0])
    rs.import_megatron(tmp_path / "megatron", tmp_path / "ck", tp=2)
    meta = ck.read_meta(tmp_path / "ck")
    assert (meta["megatron_tp"], meta["megatron_iteration"], meta["model"]["gelu"]) == (tp, 10, "erf")
    with torch.no_grad():
        ours = rs.load_model_for_eval(tmp_path / "ck", ProcessGroups.single())(IDS)[..., :VOCAB]
    assert (ours - reference).abs().max() / reference.abs().max() < 1e-5


@pytest.mark.parametrize("tp", [1, 2])
def test_a_megatron_core_bert_imports_to_megatron_cores_own_logits(tmp_path, tp):
    """Masked-LM logits at the real tokens (padded positions attend differently by design) and the
    binary head's logits on [CLS]."""
    from repro.models.bert import BERT
    from repro.models.bert_checkpoint import load_full_state_dict, read_bert

    mlm, binary = run_ranks(_megatron_core_bert_rank, tp, str(tmp_path / "megatron"), tp, timeout=240)[0]
    rs.import_megatron(tmp_path / "megatron", tmp_path / "ck", tp=2)
    cfg, state = read_bert(tmp_path / "ck")
    assert (cfg.vocab_size, cfg.gelu, cfg.lm_head_gelu, cfg.num_tokentypes) == (BERT_VOCAB, "erf", "erf", 2)
    model = BERT(cfg).eval()
    load_full_state_dict(model, state)
    with torch.no_grad():
        ours = model(BERT_IDS, TYPES, PADDING)
    real = PADDING.bool()
    mlm, binary = torch.tensor(mlm), torch.tensor(binary)
    assert (ours.mlm_logits[..., :BERT_VOCAB][real] - mlm[real]).abs().max() / mlm[real].abs().max() < 1e-5
    assert (ours.sop_logits - binary).abs().max() / binary.abs().max() < 1e-5


@pytest.mark.parametrize("tp", [1, 2])
def test_export_megatron_loads_into_megatron_core_with_the_same_logits(tmp_path, tp):
    """megatron-core (TP=2) -> import-megatron -> export-megatron at `tp` -> megatron-core's own GPTModel
    loads each rank's file (only its empty _extra_state entries absent) and gives the original logits,
    its padded columns the last real one's; importing the export again gives back the same tensors."""
    reference = torch.tensor(run_ranks(_megatron_core_rank, 2, str(tmp_path / "megatron"), 2, timeout=240)[0])
    rs.import_megatron(tmp_path / "megatron", tmp_path / "ck", tp=1)
    proc = _cli("checkpoint", "export-megatron", str(tmp_path / "ck"), "--out", str(tmp_path / "exported"),
                "--tp", str(tp))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    padded = torch.tensor(run_ranks(_megatron_core_loaded_rank, tp, str(tmp_path / "exported"), tp, timeout=240)[0])
    loaded = padded[..., :VOCAB]
    assert (loaded - reference).abs().max() / reference.abs().max() < 1e-5
    # Megatron masks no padded column: each carries the last real token's logit (a copy of its row,
    # as Megatron's converter pads), never a 0 that would outrank a model's negative logits
    assert padded.shape[-1] == _padded(VOCAB, tp) > VOCAB
    assert torch.equal(padded[..., VOCAB:], padded[..., VOCAB - 1:VOCAB].expand_as(padded[..., VOCAB:]))
    rs.import_megatron(tmp_path / "exported", tmp_path / "again")
    first = rs.load_full_model_state(ck.resolve(tmp_path / "ck"))[1]
    again = rs.load_full_model_state(ck.resolve(tmp_path / "again"))[1]
    assert first.keys() == again.keys() and all(torch.equal(first[k], again[k]) for k in first)


def test_export_megatron_refuses_what_it_cannot_write(tmp_path):
    """A BERT checkpoint, a TP degree that does not divide the heads and an occupied --out are user
    errors (exit 2, nothing written)."""
    from test_import_megatron import _hf_model, write_megatron
    from test_import_megatron_bert import _hf_bert, write_megatron_bert

    write_megatron(tmp_path / "m", _hf_model())
    rs.import_megatron(tmp_path / "m", tmp_path / "gpt")
    write_megatron_bert(tmp_path / "mb", _hf_bert("gelu"))
    rs.import_megatron(tmp_path / "mb", tmp_path / "bert")
    for source, tp, words in (("bert", "1", "writes GPT only"), ("gpt", "3", "is not divisible by tp=3")):
        proc = _cli("checkpoint", "export-megatron", str(tmp_path / source), "--out", str(tmp_path / "a"), "--tp", tp)
        assert proc.returncode == 2 and words in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "keep.txt").write_text("mine")
    proc = _cli("checkpoint", "export-megatron", str(tmp_path / "gpt"), "--out", str(tmp_path / "b"))
    assert proc.returncode == 2 and "already exists" in proc.stderr and (tmp_path / "b" / "keep.txt").exists()
    assert not (tmp_path / "a").exists()


@pytest.mark.parametrize("gelu", ["tanh", "erf"])
def test_export_megatron_saves_the_switches_that_compute_the_models_gelu(gelu):
    """megatron-core ignores --openai-gelu (F.gelu, erf, unless the bias-GeLU fusion runs, which is the
    tanh form): a tanh model is saved with the fusion on, an erf one with it off, and importing the
    saved arguments reads the same form back."""
    from repro.models.config import ModelConfig
    from repro.models.megatron import gelu_forms
    from repro.models.megatron_export import model_arguments

    args = model_arguments(ModelConfig(vocab_size=VOCAB, gelu=gelu), 2)
    assert args.bias_gelu_fusion == args.bias_activation_fusion == (gelu == "tanh")
    assert gelu_forms(args, core=True)[0] == gelu


def test_export_megatron_saves_whole_layer_norm_gammas():
    """Our layer norms hold gamma itself: the export says so, so that neither Megatron-LM nor our import
    adds a 1 to them (--apply-layernorm-1p, megatron-core's layernorm_zero_centered_gamma)."""
    from repro.models.config import ModelConfig
    from repro.models.megatron import zero_centered
    from repro.models.megatron_export import model_arguments

    args = model_arguments(ModelConfig(vocab_size=VOCAB), 1)
    assert args.apply_layernorm_1p is False and not zero_centered(args)
