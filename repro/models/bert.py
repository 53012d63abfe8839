"""BERT built from the tensor-parallel layers, with the paper's layer-norm placement switch (§5).

Two orders of a transformer layer (`BertConfig.layernorm_order`):

* ``"pre"`` (the paper's rearranged order, the default; Fig. 7 "(b)"): layer norm on each
  sublayer's input, residual added to the un-normalised input::

      x = x + drop(attn(ln_1(x)));  x = x + drop(mlp(ln_2(x)))      ... final ln_f after the stack

  As in the 2020 Megatron code there is no embedding layer norm in this order.
* ``"post"`` (the original BERT order; Fig. 7 "(a)"): residual first, then layer norm::

      x = ln_1(x + drop(attn(x)));  x = ln_2(x + drop(mlp(x)))      ... layer norm on the embeddings

  At tp=1 this is exactly `transformers.BertForPreTraining` (see repro/models/bert_hf.py).

Heads: a masked-LM head (dense -> GeLU -> layer norm -> logits with the tied, vocab-parallel word
embedding plus a vocab-parallel bias) scored with the vocab-parallel cross-entropy, and a
sentence-order-prediction head (Linear(h, 2)) on the pooled [CLS] (tanh(dense(h[:, 0]))).
Both orders have the same parameter names except `embeddings.ln` (post) and `ln_f` (pre).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from repro.models.config import GELU_FORMS, ConfigError, ModelConfig
from repro.models.gpt import ParallelAttention, ParallelMLP, check_seq_length, real_vocab_columns
from repro.parallel.cross_entropy import vocab_parallel_cross_entropy
from repro.parallel.half_gemm import linear
from repro.parallel.layers import VocabParallelEmbedding, mark_tensor_parallel, normal_init
from repro.parallel.mappings import copy_to_tensor_parallel_region, group_size
from repro.parallel.random import RNGTracker, checkpoint, tp_region_tracker

IGNORE_INDEX = -100  # mlm_labels value of positions that are not predicted (as the data pipeline)


@dataclass
class BertConfig(ModelConfig):
    """ModelConfig plus BERT's choices; defaults: the uncased WordPiece vocab, 2 token types."""

    vocab_size: int = 30522
    """BERT uncased WordPiece vocabulary. The named sizes pad it to a multiple of 1024 = 128 x 8: 30,720,
    so every rank's slice is a multiple of 128 at any tp up to 8, as GPT-2's 51,200 (the paper states
    no BERT padding: this is the repo's choice; the 2020 code's 128 x tp gives 30,592 at tp 1)."""
    num_tokentypes: int = 2
    """Segment A / B embeddings."""
    layernorm_order: str = "pre"
    """"pre": the paper's rearranged order (LN on the sublayer input); "post": original BERT."""

    def validate(self, tp: int = 1) -> None:
        """ModelConfig's checks (the layer-norm order among them) plus the token types."""
        super().validate(tp)
        if self.num_tokentypes < 2:  # every BERT input here (SOP pairs, RACE) has token types 0 and 1
            raise ConfigError(f"num_tokentypes={self.num_tokentypes}: BERT's inputs have two segments, token "
                              "types 0 and 1; set model.num_tokentypes=2")


def as_bert_config(cfg: ModelConfig) -> BertConfig:
    """A BertConfig from a ModelConfig (e.g. a named size), keeping every shared field."""
    if isinstance(cfg, BertConfig):
        return cfg
    return BertConfig(**{f.name: getattr(cfg, f.name) for f in fields(ModelConfig)})


class BertOutput(NamedTuple):
    mlm_logits: torch.Tensor  # (b, s, V_padded / tp): this rank's vocab slice, padding at -inf
    sop_logits: torch.Tensor  # (b, 2), replicated on every TP rank


def _init_replicated(param: torch.Tensor, init, generator) -> None:
    """Draw a replicated parameter from the shared generator (skipped on the meta device)."""
    if param.is_meta:
        return
    master = torch.empty(param.shape, dtype=torch.float32)
    init(master, generator)
    with torch.no_grad():
        param.copy_(master)


def _linear(h_in: int, h_out: int, cfg: BertConfig, generator, device) -> nn.Linear:
    layer = nn.Linear(h_in, h_out, device=device)
    _init_replicated(layer.weight, normal_init(cfg.init_method_std), generator)
    nn.init.zeros_(layer.bias)
    return layer


class BertEmbeddings(nn.Module):
    """word (vocab-parallel) + position + token type; layer norm only in the post order."""

    def __init__(self, cfg: BertConfig, padded_vocab: int, tp_group, generator, device=None):
        super().__init__()
        h, init = cfg.hidden_size, normal_init(cfg.init_method_std)
        self.word = VocabParallelEmbedding(padded_vocab, h, tp_group=tp_group, init=init,
                                           generator=generator, device=device, vocab_size=cfg.vocab_size,
                                           drawn_rows=cfg.padded_vocab_size(1))  # same draws at every tp
        self.position = nn.Embedding(cfg.seq_length, h, device=device)
        self.tokentype = nn.Embedding(cfg.num_tokentypes, h, device=device)
        _init_replicated(self.position.weight, init, generator)
        _init_replicated(self.tokentype.weight, init, generator)
        if cfg.layernorm_order == "post":
            self.ln = nn.LayerNorm(h, eps=cfg.layernorm_epsilon, device=device)
        self.dropout = nn.Dropout(cfg.hidden_dropout)

    def forward(self, tokens: torch.Tensor, token_types: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.word(tokens) + self.position(pos) + self.tokentype(token_types)  # (b, s, h)
        if hasattr(self, "ln"):
            x = self.ln(x)
        return self.dropout(x)


class BertLayer(nn.Module):
    """Bidirectional transformer layer in either layer-norm order (see the module docstring)."""

    def __init__(self, cfg: BertConfig, tp_group, rng, generator, device=None):
        super().__init__()
        eps, h = cfg.layernorm_epsilon, cfg.hidden_size
        self.post = cfg.layernorm_order == "post"
        self.ln_1 = nn.LayerNorm(h, eps=eps, device=device)
        self.attn = ParallelAttention(cfg, tp_group, rng, generator, device, causal=False)
        self.ln_2 = nn.LayerNorm(h, eps=eps, device=device)
        self.mlp = ParallelMLP(cfg, tp_group, generator, device)
        self.dropout = nn.Dropout(cfg.hidden_dropout)

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor) -> torch.Tensor:
        if self.post:  # original BERT: residual, then layer norm
            x = self.ln_1(x + self.dropout(self.attn(x, attn_mask)))
            return self.ln_2(x + self.dropout(self.mlp(x)))
        x = x + self.dropout(self.attn(self.ln_1(x), attn_mask))  # paper: LN on the sublayer input
        return x + self.dropout(self.mlp(self.ln_2(x)))


class MaskedLMHead(nn.Module):
    """dense -> GeLU -> layer norm (replicated), then logits against the tied word embedding."""

    def __init__(self, cfg: BertConfig, padded_vocab: int, tp_group, generator, device=None):
        super().__init__()
        self.tp_group = tp_group
        self.dense = _linear(cfg.hidden_size, cfg.hidden_size, cfg, generator, device)
        self.ln = nn.LayerNorm(cfg.hidden_size, eps=cfg.layernorm_epsilon, device=device)
        self.bias = nn.Parameter(torch.zeros(padded_vocab // group_size(tp_group), device=device))
        mark_tensor_parallel(self.bias, partition_dim=0)  # vocab-parallel, like the embedding rows
        self.approximate = GELU_FORMS[cfg.lm_head_gelu]

    def forward(self, x: torch.Tensor, word_weight: torch.Tensor) -> torch.Tensor:
        x = self.ln(F.gelu(self.dense(x), approximate=self.approximate))  # (b, s, h)
        x = copy_to_tensor_parallel_region(x, self.tp_group)  # f
        return linear(x, word_weight, self.bias)  # (b, s, V/tp)


class BERT(nn.Module):
    """BERT encoder with pooler and (optionally) the MLM and SOP pretraining heads.

    Inputs are the data pipeline's batch: tokens, token_types (b, s) and padding_mask (b, s; 1 =
    real token). Padded keys are masked out of attention in both directions.
    """

    def __init__(self, cfg: ModelConfig, tp_group=None, rng: RNGTracker | None = None,
                 seed: int = 1234, device=None, pretraining_heads: bool = True):
        super().__init__()
        cfg = as_bert_config(cfg)
        tp = group_size(tp_group)
        cfg.validate(tp)
        self.cfg, self.tp_group, self.rng = cfg, tp_group, rng
        self.region_rng = tp_region_tracker(rng, tp)  # None at TP = 1: no fork, one graph
        self.padded_vocab = cfg.padded_vocab_size(tp)
        generator = torch.Generator().manual_seed(seed)  # shared by all ranks: master-weight init
        self.embeddings = BertEmbeddings(cfg, self.padded_vocab, tp_group, generator, device)
        self.layers = nn.ModuleList(BertLayer(cfg, tp_group, self.region_rng, generator, device)
                                    for _ in range(cfg.num_layers))
        if cfg.layernorm_order == "pre":
            self.ln_f = nn.LayerNorm(cfg.hidden_size, eps=cfg.layernorm_epsilon, device=device)
        self.pooler = _linear(cfg.hidden_size, cfg.hidden_size, cfg, generator, device)
        if pretraining_heads:
            self.lm_head = MaskedLMHead(cfg, self.padded_vocab, tp_group, generator, device)
            self.sop_head = _linear(cfg.hidden_size, 2, cfg, generator, device)
        self.num_real_local = real_vocab_columns(cfg, tp_group)

    def encode(self, tokens: torch.Tensor, token_types: torch.Tensor,
               padding_mask: torch.Tensor) -> torch.Tensor:
        """Final hidden states (b, s, h), replicated on every TP rank."""
        check_seq_length(tokens, self.cfg)
        attn_mask = padding_mask.bool()[:, None, None, :]  # (b, 1, 1, s): True = attend to key
        x = self.embeddings(tokens, token_types)
        for layer in self.layers:
            if self.cfg.activation_checkpointing and self.training:
                x = checkpoint(layer, x, attn_mask, tracker=self.region_rng if self.cfg.attention_dropout > 0 else None)
            else:
                x = layer(x, attn_mask)
        return self.ln_f(x) if hasattr(self, "ln_f") else x

    def pooled(self, hidden: torch.Tensor) -> torch.Tensor:
        """tanh(dense(h_[CLS])): (b, h)."""
        return torch.tanh(self.pooler(hidden[:, 0]))

    def forward(self, tokens, token_types, padding_mask) -> BertOutput:
        if not hasattr(self, "lm_head"):
            raise RuntimeError("this BERT was built with pretraining_heads=False (as RACE fine-tuning builds it): it "
                               "has no masked-LM or SOP head to run; call encode(tokens, token_types, padding_mask) "
                               "for the hidden states and pooled(hidden) for the pooled [CLS]")
        hidden = self.encode(tokens, token_types, padding_mask)
        logits = self.lm_head(hidden, self.embeddings.word.weight)
        if self.num_real_local < logits.shape[-1]:  # padded vocab rows: never predicted
            pad = torch.zeros(logits.shape[-1], dtype=torch.bool, device=logits.device)
            pad[self.num_real_local:] = True
            logits = logits.masked_fill(pad, float("-inf"))
        return BertOutput(logits, self.sop_head(self.pooled(hidden)))

    def losses(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """MLM loss (mean over predicted tokens), SOP loss (mean over the batch) and their sum."""
        out = self(batch["tokens"], batch["token_types"], batch["padding_mask"])
        labels = batch["mlm_labels"]
        predict = (labels != IGNORE_INDEX).float()  # (b, s)
        per_token = vocab_parallel_cross_entropy(out.mlm_logits, labels.clamp_min(0), self.tp_group,
                                                 vocab_size=self.cfg.vocab_size)
        mlm = (per_token * predict).sum() / predict.sum().clamp_min(1.0)
        sop_logits = out.sop_logits  # half upcast to fp32 for the loss; fp32/fp64 as they are
        sop = F.cross_entropy(sop_logits.float() if sop_logits.element_size() < 4 else sop_logits, batch["sop_label"])
        return {"mlm": mlm, "sop": sop, "total": mlm + sop}
