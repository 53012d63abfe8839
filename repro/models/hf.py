"""Map a serial (tp=1) GPT's weights onto Hugging Face `transformers.GPT2LMHeadModel` by name.

The names are the same; HF's Conv1D stores `c_attn`, `c_proj` and `c_fc` weights as (in, out), so
they are transposed; HF has no padded vocabulary rows, so `wte` keeps the first `vocab_size` rows.
"""

from __future__ import annotations

import torch

from repro.models.config import ModelConfig

_CONV1D_SUFFIXES = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


def hf_gpt2_config(cfg: ModelConfig):
    """The transformers.GPT2Config of a model config (tanh GeLU, as GPT-2)."""
    from transformers import GPT2Config

    return GPT2Config(
        vocab_size=cfg.vocab_size, n_positions=cfg.seq_length, n_embd=cfg.hidden_size,
        n_layer=cfg.num_layers, n_head=cfg.num_attention_heads, n_inner=4 * cfg.hidden_size,
        activation_function="gelu_new", resid_pdrop=cfg.hidden_dropout, embd_pdrop=cfg.hidden_dropout,
        attn_pdrop=cfg.attention_dropout, layer_norm_epsilon=cfg.layernorm_epsilon,
        initializer_range=cfg.init_method_std, tie_word_embeddings=True,
        bos_token_id=cfg.vocab_size - 1, eos_token_id=cfg.vocab_size - 1,
    )


def to_hf_state_dict(state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Our tp=1 state dict -> GPT2LMHeadModel's (transposed Conv1D weights, unpadded vocab)."""
    out = {}
    for name, tensor in state.items():
        if name.endswith(_CONV1D_SUFFIXES):
            tensor = tensor.t()
        if name == "transformer.wte.weight":
            tensor = tensor[: cfg.vocab_size]
        out[name] = tensor.contiguous()
    out["lm_head.weight"] = out["transformer.wte.weight"]
    return out


def to_hf_gpt2(model) -> "torch.nn.Module":
    """A GPT2LMHeadModel holding the same weights as a serial GPT (float32, eager attention)."""
    from transformers import GPT2LMHeadModel

    hf = GPT2LMHeadModel(hf_gpt2_config(model.cfg))
    missing, unexpected = hf.load_state_dict(to_hf_state_dict(model.state_dict(), model.cfg), strict=False)
    missing = [m for m in missing if not m.endswith(("attn.bias", "attn.masked_bias"))]
    if missing or unexpected:
        raise RuntimeError(f"weight mapping to GPT2LMHeadModel failed: missing {missing}, unexpected {unexpected}")
    return hf
