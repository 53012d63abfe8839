"""Map a serial (tp=1) GPT's weights onto Hugging Face `transformers.GPT2LMHeadModel` by name.

The names are the same; HF's Conv1D stores `c_attn`, `c_proj` and `c_fc` weights as (in, out), so
they are transposed; HF has no padded vocabulary rows, so `wte` keeps the first `vocab_size` rows.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from repro.models.config import ModelConfig
from repro.models.sizes import GPT2_VOCAB as GPT2_VOCAB_SIZE

HF_ACTIVATION = {"tanh": "gelu_new", "erf": "gelu"}
"""Our GeLU form -> transformers' activation name (`gelu_pytorch_tanh` is the tanh form too)."""
_CONV1D_SUFFIXES = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
GPT2_END_OF_TEXT = GPT2_VOCAB_SIZE - 1
"""<|endoftext|>: the last id of GPT-2's BPE (50256), whatever rows a padded vocabulary adds after it."""


def end_of_text_id(vocab_size: int) -> int:
    """The end-of-text id of a GPT with `vocab_size` ids: GPT-2 BPE's for a GPT-2 vocabulary (padded
    too: 50,304 rows), else the last id (a vocabulary this project did not tokenize with GPT-2 BPE)."""
    return GPT2_END_OF_TEXT if vocab_size >= GPT2_VOCAB_SIZE else vocab_size - 1


def hf_gpt2_config(cfg: ModelConfig):
    """The transformers.GPT2Config of a model config."""
    from transformers import GPT2Config

    return GPT2Config(
        vocab_size=cfg.vocab_size, n_positions=cfg.seq_length, n_embd=cfg.hidden_size,
        n_layer=cfg.num_layers, n_head=cfg.num_attention_heads, n_inner=4 * cfg.hidden_size,
        activation_function=HF_ACTIVATION[cfg.gelu], resid_pdrop=cfg.hidden_dropout, embd_pdrop=cfg.hidden_dropout,
        attn_pdrop=cfg.attention_dropout, layer_norm_epsilon=cfg.layernorm_epsilon,
        initializer_range=cfg.init_method_std, tie_word_embeddings=True,
        bos_token_id=end_of_text_id(cfg.vocab_size), eos_token_id=end_of_text_id(cfg.vocab_size),
    )


def to_hf_state_dict(state: Mapping[str, torch.Tensor], cfg: ModelConfig,
                     dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """Our tp=1 state dict -> GPT2LMHeadModel's (transposed Conv1D weights, unpadded vocab), read one
    tensor at a time (a lazily merged checkpoint is never whole in memory twice); `dtype` casts."""
    out = {}
    for name, tensor in state.items():
        if name.endswith(_CONV1D_SUFFIXES):
            tensor = tensor.t()
        if name == "transformer.wte.weight":
            tensor = tensor[: cfg.vocab_size]
        out[name] = tensor.to(dtype or tensor.dtype).contiguous()
    out["lm_head.weight"] = out["transformer.wte.weight"]
    return out


def _checked_load(hf, state: dict[str, torch.Tensor], assign: bool = False) -> None:
    missing, unexpected = hf.load_state_dict(state, strict=False, assign=assign)
    missing = [m for m in missing if not m.endswith(("attn.bias", "attn.masked_bias"))]
    if missing or unexpected:
        raise RuntimeError(f"weight mapping to GPT2LMHeadModel failed: missing {missing}, unexpected {unexpected}")


def to_hf_gpt2(model) -> "torch.nn.Module":
    """A GPT2LMHeadModel holding a copy of a serial GPT's weights (float32, eager attention)."""
    from transformers import GPT2LMHeadModel

    hf = GPT2LMHeadModel(hf_gpt2_config(model.cfg))
    _checked_load(hf, to_hf_state_dict(model.state_dict(), model.cfg))
    return hf


def hf_gpt2_for_export(state: Mapping[str, torch.Tensor], cfg: ModelConfig) -> "torch.nn.Module":
    """A float32 GPT2LMHeadModel built around `state`'s tensors for `save_pretrained`: made on the meta
    device and given the converted tensors themselves (`assign`), so an export holds one copy of the
    weights and spends no time on a random initialisation (an 8.3B model: 33 GB, not four times that)."""
    from transformers import GPT2LMHeadModel

    with torch.device("meta"):
        hf = GPT2LMHeadModel(hf_gpt2_config(cfg))
    _checked_load(hf, to_hf_state_dict(state, cfg, torch.float32), assign=True)
    hf.tie_weights()
    still_meta = [n for n, t in [*hf.named_parameters(), *hf.named_buffers()] if t.is_meta]
    if still_meta:
        raise RuntimeError(f"GPT2LMHeadModel tensors left without weights: {still_meta}")
    return hf.eval()


def hf_gpt2_tokenizer(data_dir, max_length: int):
    """transformers' fast tokenizer for GPT-2 BPE, from the vocabulary files in `data_dir` (the same
    backend our data and evaluation use), so `AutoTokenizer.from_pretrained` loads an export."""
    from transformers import PreTrainedTokenizerFast

    from repro.data.tokenizers import build_tokenizer

    eot = "<|endoftext|>"
    backend = build_tokenizer("gpt2", data_dir).backend
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=eot, eos_token=eot, unk_token=eot,
                                   model_max_length=max_length)


# ---- import: transformers.GPT2LMHeadModel -> our model ---------------------------------------------

_GELU_OF = {"gelu_new": "tanh", "gelu_pytorch_tanh": "tanh", "gelu": "erf"}
_SUPPORTED = {"activation_function": tuple(_GELU_OF), "scale_attn_weights": (True,),
              "scale_attn_by_inverse_layer_idx": (False,), "add_cross_attention": (False,),
              "tie_word_embeddings": (True,)}


def config_from_hf(hf_config, make_vocab_size_divisible_by: int = 1024) -> ModelConfig:
    """Our ModelConfig of a transformers.GPT2Config; ValueError naming each setting this GPT lacks."""
    if getattr(hf_config, "model_type", None) != "gpt2":
        raise ValueError(f"model_type {getattr(hf_config, 'model_type', None)!r} is not 'gpt2': only "
                         "GPT2LMHeadModel checkpoints (gpt2, gpt2-medium, ...) can be imported")
    unsupported = [f"{key}={getattr(hf_config, key, None)!r} (this GPT has {' or '.join(map(repr, ok))})"
                   for key, ok in _SUPPORTED.items() if getattr(hf_config, key, ok[0]) not in ok]
    if hf_config.vocab_size != GPT2_VOCAB_SIZE:
        unsupported.append(f"vocab_size={hf_config.vocab_size} (this project tokenizes with GPT-2's BPE of "
                           f"{GPT2_VOCAB_SIZE} tokens; a model with another vocabulary cannot be evaluated with it)")
    inner = hf_config.n_inner or 4 * hf_config.n_embd
    if inner != 4 * hf_config.n_embd:
        unsupported.append(f"n_inner={inner} (this GPT's MLP is 4 x n_embd = {4 * hf_config.n_embd})")
    if unsupported:
        raise ValueError("the model uses settings this GPT does not implement: " + "; ".join(unsupported))
    return ModelConfig(num_layers=hf_config.n_layer, hidden_size=hf_config.n_embd,
                       num_attention_heads=hf_config.n_head, seq_length=hf_config.n_positions,
                       vocab_size=hf_config.vocab_size, make_vocab_size_divisible_by=make_vocab_size_divisible_by,
                       hidden_dropout=hf_config.resid_pdrop, attention_dropout=hf_config.attn_pdrop,
                       init_method_std=hf_config.initializer_range, layernorm_epsilon=hf_config.layer_norm_epsilon,
                       gelu=_GELU_OF[getattr(hf_config, "activation_function", "gelu_new")])


def from_hf_state_dict(hf_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """GPT2LMHeadModel's state dict -> our tp=1 one with the unpadded vocab (float32, Conv1D
    weights transposed, the tied lm_head and the attention-mask buffers dropped)."""
    out = {}
    for name, tensor in hf_state.items():
        if name == "lm_head.weight" or name.endswith((".attn.bias", ".attn.masked_bias")):  # mask buffers
            continue
        tensor = tensor.float()
        out[name] = (tensor.t() if name.endswith(_CONV1D_SUFFIXES) else tensor).contiguous()
    head = hf_state.get("lm_head.weight")
    if head is not None and not torch.equal(head.float(), out["transformer.wte.weight"]):
        raise ValueError("lm_head.weight differs from transformer.wte.weight: this GPT ties its output "
                         "layer to the input embedding (as GPT-2 does), so an untied head cannot be imported")
    return out
