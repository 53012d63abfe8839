"""Map a serial (tp=1), original-order ("post") BERT onto `transformers.BertForPreTraining`.

Name mapping (ours -> Hugging Face), per layer i::

    embeddings.word/position/tokentype  -> bert.embeddings.{word,position,token_type}_embeddings
    embeddings.ln                       -> bert.embeddings.LayerNorm
    layers.i.attn.c_attn (rows q|k|v)   -> bert.encoder.layer.i.attention.self.{query,key,value}
    layers.i.attn.c_proj, layers.i.ln_1 -> ...attention.output.dense, ...attention.output.LayerNorm
    layers.i.mlp.c_fc                   -> ...intermediate.dense
    layers.i.mlp.c_proj, layers.i.ln_2  -> ...output.dense, ...output.LayerNorm
    pooler                              -> bert.pooler.dense
    lm_head.dense, lm_head.ln, .bias    -> cls.predictions.transform.dense / .LayerNorm, cls.predictions.bias
    sop_head                            -> cls.seq_relationship

Differences: HF has no padded vocabulary (the first vocab_size rows and bias entries are kept);
GeLU is the config's form (HF `hidden_act` "gelu_new" for tanh, "gelu" for erf; one for the MLP and
the head, so the two must agree here); HF's
`seq_relationship` head is trained for next-sentence prediction, ours for sentence order (the same
Linear(h, 2) on the pooled [CLS], only the labels differ). The pre-LN order has no HF counterpart.
"""

from __future__ import annotations

import torch

from repro.models.bert import BERT, BertConfig
from repro.parallel.mappings import group_size

_LAYER_MAP = {
    "attn.c_proj": "attention.output.dense",
    "ln_1": "attention.output.LayerNorm",
    "mlp.c_fc": "intermediate.dense",
    "mlp.c_proj": "output.dense",
    "ln_2": "output.LayerNorm",
}
_TOP_MAP = {
    "embeddings.word.weight": "bert.embeddings.word_embeddings.weight",
    "embeddings.position.weight": "bert.embeddings.position_embeddings.weight",
    "embeddings.tokentype.weight": "bert.embeddings.token_type_embeddings.weight",
    "embeddings.ln": "bert.embeddings.LayerNorm",
    "pooler": "bert.pooler.dense",
    "lm_head.dense": "cls.predictions.transform.dense",
    "lm_head.ln": "cls.predictions.transform.LayerNorm",
    "lm_head.bias": "cls.predictions.bias",
    "sop_head": "cls.seq_relationship",
}


def hf_bert_config(cfg: BertConfig):
    """The transformers.BertConfig of a model config (its GeLU form, our layer-norm epsilon)."""
    from transformers import BertConfig as HFBertConfig

    from repro.models.hf import HF_ACTIVATION

    if cfg.gelu != cfg.lm_head_gelu:
        raise ValueError(f"gelu={cfg.gelu!r} but lm_head_gelu={cfg.lm_head_gelu!r}: Hugging Face's BERT has one "
                         "hidden_act for both")

    return HFBertConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_attention_heads, intermediate_size=4 * cfg.hidden_size,
        hidden_act=HF_ACTIVATION[cfg.gelu], hidden_dropout_prob=cfg.hidden_dropout,
        attention_probs_dropout_prob=cfg.attention_dropout, max_position_embeddings=cfg.seq_length,
        type_vocab_size=cfg.num_tokentypes, layer_norm_eps=cfg.layernorm_epsilon,
        initializer_range=cfg.init_method_std, tie_word_embeddings=True,
    )


def _hf_name(name: str) -> str:
    for ours, theirs in _TOP_MAP.items():
        if name == ours or name.startswith(ours + "."):
            return theirs + name[len(ours):]
    _, index, rest = name.split(".", 2)
    for ours, theirs in _LAYER_MAP.items():
        if rest.startswith(ours + "."):
            return f"bert.encoder.layer.{index}.{theirs}{rest[len(ours):]}"
    raise KeyError(f"no Hugging Face name for parameter {name!r}")


def to_hf_state_dict(model: BERT) -> dict[str, torch.Tensor]:
    """Our tp=1 state dict renamed for BertForPreTraining (QKV split, vocab unpadded)."""
    cfg, out = model.cfg, {}
    for name, tensor in model.state_dict().items():
        if ".attn.c_attn." in name:
            _, index, _ = name.split(".", 2)
            kind = name.rsplit(".", 1)[1]
            for part, chunk in zip(("query", "key", "value"), tensor.chunk(3, dim=0)):
                out[f"bert.encoder.layer.{index}.attention.self.{part}.{kind}"] = chunk.clone()
            continue
        if name in ("embeddings.word.weight", "lm_head.bias"):
            tensor = tensor[: cfg.vocab_size]
        out[_hf_name(name)] = tensor.clone()
    out["cls.predictions.decoder.weight"] = out["bert.embeddings.word_embeddings.weight"]
    out["cls.predictions.decoder.bias"] = out["cls.predictions.bias"]
    return out


def to_hf_bert(model: BERT) -> torch.nn.Module:
    """A BertForPreTraining holding the same weights as a serial, post-order BERT (eager attention)."""
    from transformers import BertForPreTraining

    if model.cfg.layernorm_order != "post":
        raise ValueError(f"layernorm_order={model.cfg.layernorm_order!r}: only the original ('post') layer-norm "
                         "order maps onto BertForPreTraining; build the BERT with layernorm_order='post'")
    if group_size(model.tp_group) > 1:
        raise ValueError(f"a BERT split over {group_size(model.tp_group)} TP ranks: BertForPreTraining takes the "
                         "whole model; build it at tp=1 (or gather a tp=1 state dict first)")
    hf = BertForPreTraining(hf_bert_config(model.cfg))
    hf.config._attn_implementation = "eager"
    missing, unexpected = hf.load_state_dict(to_hf_state_dict(model), strict=False)
    missing = [m for m in missing if not m.endswith("position_ids")]
    if missing or unexpected:
        raise RuntimeError(f"weight mapping to BertForPreTraining failed: missing {missing}, "
                           f"unexpected {unexpected}")
    return hf
