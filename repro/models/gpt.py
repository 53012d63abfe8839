"""GPT-2 built from tensor-parallel layers; at tp=1 it is the ordinary serial model.

Parameter names follow Hugging Face's GPT2LMHeadModel (`transformer.wte`, `transformer.h.N.attn.c_attn`,
...), so a TP=1 state dict maps onto it by name (HF's Conv1D stores weights transposed).

Per layer and pass the model issues the paper's 2 all-reduces (g after attention and after MLP in
the forward; f before attention and before MLP in the backward).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from repro.models.config import GELU_FORMS, ModelConfig
from repro.parallel.cross_entropy import vocab_parallel_cross_entropy
from repro.parallel.half_gemm import linear
from repro.parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    normal_init,
    scaled_init,
)
from repro.parallel.mappings import copy_to_tensor_parallel_region, group_rank, group_size
from repro.parallel.random import RNGTracker, checkpoint, tp_region_tracker


class ParallelAttention(nn.Module):
    """Causal self-attention: QKV column-parallel (whole heads per rank), output row-parallel."""

    def __init__(self, cfg: ModelConfig, tp_group, rng: RNGTracker | None, generator, device=None, causal=True):
        super().__init__()
        h = cfg.hidden_size
        self.tp = group_size(tp_group)
        self.heads_per_rank = cfg.num_attention_heads // self.tp
        self.head_dim = cfg.head_dim
        self.dropout_p, self.rng, self.causal = cfg.attention_dropout, rng, causal
        init = normal_init(cfg.init_method_std)
        self.c_attn = ColumnParallelLinear(h, 3 * h, tp_group=tp_group, stride=3, init=init,
                                           generator=generator, device=device)
        self.c_proj = RowParallelLinear(h, h, tp_group=tp_group, generator=generator, device=device,
                                        init=scaled_init(cfg.init_method_std, cfg.num_layers))

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        b, s, _ = x.shape
        qkv = self.c_attn(x)  # (b, s, 3 * nh_local * hs): [q_local | k_local | v_local]
        q, k, v = (t.view(b, s, self.heads_per_rank, self.head_dim).transpose(1, 2)
                   for t in qkv.chunk(3, dim=-1))  # (b, nh_local, s, hs)
        dropout_p = self.dropout_p if self.training else 0.0
        if self.rng is None and dropout_p > 0 and self.tp > 1:
            raise ValueError(f"attention dropout at TP={self.tp} without an RNG tracker would drop the same "
                             "positions of head i on every TP rank (the paper gives each rank its own stream). "
                             "Fix: build the model with rng=RNGTracker(seed, tp_rank) (repro.parallel.random)")
        if self.rng is not None and dropout_p > 0:
            # attention dropout: a different stream on every TP rank. The context manager is entered
            # where it is made: torch 2.9's dynamo refuses one held in a variable first
            with self.rng.fork():
                y = self._attend(q, k, v, attn_mask, dropout_p)
        else:
            y = self._attend(q, k, v, attn_mask, dropout_p)
        y = y.transpose(1, 2).reshape(b, s, self.heads_per_rank * self.head_dim)  # (b, s, h/tp)
        return self.c_proj(y)

    def _attend(self, q, k, v, attn_mask, dropout_p: float) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p,
                                              is_causal=self.causal and attn_mask is None)


class ParallelMLP(nn.Module):
    """GeLU(X A) B with A column-parallel (GeLU on each rank's slice) and B row-parallel."""

    def __init__(self, cfg: ModelConfig, tp_group, generator, device=None):
        super().__init__()
        h = cfg.hidden_size
        self.c_fc = ColumnParallelLinear(h, 4 * h, tp_group=tp_group, generator=generator, device=device,
                                         init=normal_init(cfg.init_method_std))
        self.c_proj = RowParallelLinear(4 * h, h, tp_group=tp_group, generator=generator, device=device,
                                        init=scaled_init(cfg.init_method_std, cfg.num_layers))
        self.approximate = GELU_FORMS[cfg.gelu]  # F.gelu's name for the form

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x), approximate=self.approximate))


class Block(nn.Module):
    """Pre-LN transformer layer: x + drop(attn(ln_1(x))), then x + drop(mlp(ln_2(x)))."""

    def __init__(self, cfg: ModelConfig, tp_group, rng, generator, device=None, causal=True):
        super().__init__()
        eps = cfg.layernorm_epsilon
        self.ln_1 = nn.LayerNorm(cfg.hidden_size, eps=eps, device=device)
        self.attn = ParallelAttention(cfg, tp_group, rng, generator, device, causal)
        self.ln_2 = nn.LayerNorm(cfg.hidden_size, eps=eps, device=device)
        self.mlp = ParallelMLP(cfg, tp_group, generator, device)
        self.dropout = nn.Dropout(cfg.hidden_dropout)

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.dropout(self.attn(self.ln_1(x), attn_mask))
        return x + self.dropout(self.mlp(self.ln_2(x)))


class GPT(nn.Module):
    """GPT-2 language model with a vocab-parallel, tied output layer.

    `forward(ids)` returns this rank's vocab slice of the logits, (b, s, V_padded / tp), with the
    padded vocabulary columns at -inf (never predicted). `loss(ids, labels)` returns the per-token
    loss (b, s) through the vocab-parallel cross-entropy, without gathering logits.
    """

    def __init__(self, cfg: ModelConfig, tp_group=None, rng: RNGTracker | None = None,
                 seed: int = 1234, device=None):
        super().__init__()
        tp = group_size(tp_group)
        cfg.validate_gpt(tp)
        self.cfg, self.tp_group, self.rng = cfg, tp_group, rng
        self.region_rng = tp_region_tracker(rng, tp)  # None at TP = 1: no fork, one graph
        self.padded_vocab = cfg.padded_vocab_size(tp)
        generator = torch.Generator().manual_seed(seed)  # shared by all ranks: master-weight init
        init = normal_init(cfg.init_method_std)
        self.transformer = nn.ModuleDict(dict(
            wte=VocabParallelEmbedding(self.padded_vocab, cfg.hidden_size, tp_group=tp_group,
                                       init=init, generator=generator, device=device, vocab_size=cfg.vocab_size,
                                       drawn_rows=cfg.padded_vocab_size(1)),  # same draws at every tp
            wpe=nn.Embedding(cfg.seq_length, cfg.hidden_size, device=device),
            drop=nn.Dropout(cfg.hidden_dropout),
            h=nn.ModuleList(Block(cfg, tp_group, self.region_rng, generator, device) for _ in range(cfg.num_layers)),
            ln_f=nn.LayerNorm(cfg.hidden_size, eps=cfg.layernorm_epsilon, device=device),
        ))
        if not self.transformer.wpe.weight.is_meta:
            with torch.no_grad():
                self.transformer.wpe.weight.copy_(_drawn((cfg.seq_length, cfg.hidden_size), init, generator))
        self.num_real_local = real_vocab_columns(cfg, tp_group)

    def hidden_states(self, ids: torch.Tensor) -> torch.Tensor:
        """Final-layer-norm output (b, s, h), replicated on every TP rank."""
        check_seq_length(ids, self.cfg)
        pos = torch.arange(ids.shape[1], device=ids.device)
        x = self.transformer.drop(self.transformer.wte(ids) + self.transformer.wpe(pos))  # (b, s, h)
        for block in self.transformer.h:
            if self.cfg.activation_checkpointing and self.training:
                x = checkpoint(block, x, tracker=self.region_rng if self.cfg.attention_dropout > 0 else None)
            else:
                x = block(x)
        return self.transformer.ln_f(x)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        """Vocab-parallel logits (b, s, V/tp); with `labels`, the per-token loss (b, s) instead."""
        logits = self.logits(ids)
        if labels is None:
            return logits
        return vocab_parallel_cross_entropy(logits, labels, self.tp_group, inplace=True,  # logits unseen
                                           vocab_size=self.cfg.vocab_size)

    def logits(self, ids: torch.Tensor) -> torch.Tensor:
        """This rank's vocab slice of the logits (b, s, V/tp), padded columns at -inf."""
        return self.output_layer(self.hidden_states(ids))

    def output_layer(self, hidden: torch.Tensor) -> torch.Tensor:
        """The tied output layer on hidden states (..., h): this rank's vocab slice of the logits
        (..., V/tp), padded columns at -inf. Evaluation applies it to the scored positions only."""
        x = copy_to_tensor_parallel_region(hidden, self.tp_group)  # f
        logits = linear(x, self.transformer.wte.weight)
        if self.num_real_local < logits.shape[-1]:  # padded vocab columns: never predicted
            if torch.compiler.is_compiling():  # a mask the compiler folds into the loss's reads of the logits
                return logits.masked_fill(_padded_columns(logits, self.num_real_local), float("-inf"))
            logits[..., self.num_real_local:] = float("-inf")  # in place: the matmul output is not saved
        return logits

    def loss(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Per-token cross-entropy (b, s), computed in float32 without gathering logits."""
        return self(ids, labels)


def _padded_columns(logits: torch.Tensor, num_real: int) -> torch.Tensor:
    """True at the padded vocab columns of `logits` (..., V/tp). Compiled, an out-of-place mask by
    column index costs no pass of its own; the in-place fill of the eager path compiles to a store of
    every logit (0.84 GB a step at 1.2B parameters)."""
    return torch.arange(logits.shape[-1], device=logits.device) >= num_real


def real_vocab_columns(cfg: ModelConfig, tp_group) -> int:
    """How many of this TP rank's vocabulary rows (columns of its logits) are real tokens, not padding."""
    per_rank = cfg.padded_vocab_size(group_size(tp_group)) // group_size(tp_group)
    return max(0, min(per_rank, cfg.vocab_size - group_rank(tp_group) * per_rank))


def check_seq_length(tokens: torch.Tensor, cfg: ModelConfig) -> None:
    """ValueError unless the inputs are (b, s) with s within the model's learned positions."""
    if tokens.dim() != 2:
        raise ValueError(f"token ids of shape {tuple(tokens.shape)}: the model takes a batch (b, s); add a "
                         "batch dimension with ids.unsqueeze(0)")
    if tokens.shape[1] > cfg.seq_length:
        raise ValueError(f"sequence length {tokens.shape[1]} exceeds the model's seq_length {cfg.seq_length}: "
                         "truncate the input or raise seq_length")


def _drawn(shape, init, generator) -> torch.Tensor:
    t = torch.empty(shape)
    init(t, generator)
    return t
