"""Write a GPT of ours as a Megatron-LM checkpoint in its `torch` format (megatron-core names).

    repro checkpoint export-megatron runs/gpt2-355m --out megatron_ckpt --tp 2

Layout: OUT/latest_checkpointed_iteration.txt (`release`) and OUT/release/mp_rank_{tp:02d}/
model_optim_rng.pt, each holding `checkpoint_version` 3.0, the model's arguments and that TP rank's
`model` state with megatron-core's local-spec names (`embedding`, `decoder.layers.N.input_layernorm`,
`self_attention.linear_qkv` ...). Each rank's fused QKV rows go into Megatron's [np, 3, hn] order; the
word embedding is padded to Megatron's multiple of 128 x tp rows with copies of its last row
(`fill_padded_vocab`); the model's own vocab_size goes into Megatron's `vocab_size` argument (--vocab-size,
which only its NullTokenizer reads), so that import-megatron gives the same model back. No optimizer or
RNG state is written: Megatron-LM loads it with --no-load-optim --no-load-rng (and --finetune to start
at iteration 0), given the same model arguments as are saved here.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from repro.models.config import ModelConfig
from repro.models.megatron import LAYER_NAMES
from repro.provenance import save_torch

CORE_LAYER_NAMES = {ours: theirs for theirs, ours in LAYER_NAMES.items()
                    if theirs.startswith(("input_layernorm", "pre_mlp_layernorm", "self_attention.linear_",
                                          "mlp.linear_")) and "layer_norm_" not in theirs}
"""Ours inside a layer -> megatron-core's local-spec name."""
CORE_TOP_NAMES = {"transformer.wte.weight": "embedding.word_embeddings.weight",
                  "transformer.wpe.weight": "embedding.position_embeddings.weight",
                  "transformer.ln_f.weight": "decoder.final_layernorm.weight",
                  "transformer.ln_f.bias": "decoder.final_layernorm.bias"}


def megatron_vocab_rows(vocab_size: int, tp: int, divisible_by: int = 128) -> int:
    """Megatron-LM's padded vocabulary: a multiple of divisible_by x tp."""
    unit = divisible_by * tp
    return -(-vocab_size // unit) * unit


def fill_padded_vocab(shard: dict[str, torch.Tensor], rank: int, vocab_size: int, last_row: torch.Tensor) -> None:
    """Give rank `rank`'s padded word-embedding rows (those past `vocab_size`) the last real row, as
    Megatron-LM's own checkpoint converter pads. Megatron scores every padded column (it masks none,
    where our model's padded logits are -inf), so zero rows would give each a logit of 0: above every
    real logit of a model whose logits sit below 0 (GPT-2's do), most of the probability would go to
    padding. A copy of the last row (<|endoftext|>) adds at most log(1 + n_pad p_eot) nats to a loss."""
    weight = shard["transformer.wte.weight"]
    first = max(vocab_size - rank * weight.shape[0], 0)
    weight[first:] = last_row


def qkv_to_megatron(tensor: torch.Tensor, heads: int) -> torch.Tensor:
    """One TP rank's fused QKV rows from our [3, np, hn] order to checkpoint version 3.0's [np, 3, hn]."""
    rest = tensor.shape[1:]
    return tensor.reshape(3, heads, -1, *rest).transpose(0, 1).reshape(tensor.shape)


def core_rank_state(shard: dict[str, torch.Tensor], cfg: ModelConfig, tp: int) -> dict[str, torch.Tensor]:
    """One TP rank's state of our GPT (our per-rank layout, Megatron's vocabulary rows) in megatron-core names."""
    out = {}
    for name, tensor in shard.items():
        if name in CORE_TOP_NAMES:
            out[CORE_TOP_NAMES[name]] = tensor
            continue
        index, inner = name.removeprefix("transformer.h.").split(".", 1)
        if ".c_attn." in name:
            tensor = qkv_to_megatron(tensor, cfg.num_attention_heads // tp)
        out[f"decoder.layers.{index}.{CORE_LAYER_NAMES[inner]}"] = tensor
    return out


def model_arguments(cfg: ModelConfig, tp: int) -> argparse.Namespace:
    """The model arguments Megatron-LM saves with a checkpoint, for this GPT."""
    return argparse.Namespace(
        num_layers=cfg.num_layers, hidden_size=cfg.hidden_size, ffn_hidden_size=4 * cfg.hidden_size,
        num_attention_heads=cfg.num_attention_heads, kv_channels=cfg.head_dim, num_query_groups=cfg.num_attention_heads,
        group_query_attention=False, max_position_embeddings=cfg.seq_length, seq_length=cfg.seq_length,
        position_embedding_type="learned_absolute", add_position_embedding=True, add_bias_linear=True,
        swiglu=False, untie_embeddings_and_output_weights=False, normalization="LayerNorm",
        apply_residual_connection_post_layernorm=False, apply_layernorm_1p=False,  # our gammas are stored whole
        layernorm_epsilon=cfg.layernorm_epsilon,
        norm_epsilon=cfg.layernorm_epsilon, **_gelu_arguments(cfg.gelu),
        hidden_dropout=cfg.hidden_dropout, attention_dropout=cfg.attention_dropout,
        init_method_std=cfg.init_method_std, tokenizer_type="GPT2BPETokenizer", make_vocab_size_divisible_by=128,
        padded_vocab_size=megatron_vocab_rows(cfg.vocab_size, tp), vocab_size=cfg.vocab_size,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=1, params_dtype=torch.float32, transformer_impl="local", ckpt_format="torch")


def _gelu_arguments(gelu: str) -> dict[str, bool]:
    """The switches that make Megatron-LM compute this GeLU form. Its fused bias-GeLU is the tanh form
    in the legacy models and in megatron-core's (Megatron's default, --bias-gelu-fusion); megatron-core
    ignores --openai-gelu and runs F.gelu, the erf form, without the fusion (legacy models honour
    --openai-gelu, kept for them)."""
    tanh = gelu == "tanh"
    return {"openai_gelu": tanh, "bias_gelu_fusion": tanh, "bias_activation_fusion": tanh}


def write_megatron_gpt(tmp: Path, shards, cfg: ModelConfig, tp: int) -> None:
    """Write the `tp` ranks' states (our names and per-rank layout, from `shards`) as a Megatron-LM
    release checkpoint into the directory `tmp`."""
    args = model_arguments(cfg, tp)
    for rank, shard in enumerate(shards):
        path = tmp / "release" / f"mp_rank_{rank:02d}" / "model_optim_rng.pt"
        path.parent.mkdir(parents=True)
        save_torch({"args": args, "checkpoint_version": 3.0, "iteration": 0,
                    "model": core_rank_state(shard, cfg, tp)}, path)
    (tmp / "latest_checkpointed_iteration.txt").write_text("release")
