"""Typed model configuration shared by GPT and BERT, with the paper's field names."""

from __future__ import annotations

from dataclasses import dataclass

from repro.parallel.layers import pad_vocab_size


class ConfigError(ValueError):
    """A model configuration that cannot work; the message names the numbers and the fix."""


GELU_FORMS = {"tanh": "tanh", "erf": "none"}
"""GeLU form -> torch.nn.functional.gelu's `approximate` argument."""
LAYERNORM_ORDERS = ("pre", "post")
GPT_ONLY_VALUES = {"layernorm_order": "pre", "num_tokentypes": 0, "lm_head_gelu": "tanh"}
"""BERT-only settings -> the one value a GPT implements (pre-LN, no token types, no masked-LM head)."""


def check_gelu(name: str, value: str) -> None:
    """ConfigError unless `value` is a GeLU form."""
    if value not in GELU_FORMS:
        raise ConfigError(f"{name}={value!r} is not one of {tuple(GELU_FORMS)}: use 'tanh' (GPT-2's) or 'erf'")


@dataclass
class ModelConfig:
    """Transformer hyper-parameters (paper Table 1/2/4 names)."""

    num_layers: int = 2
    """Transformer layers (N in the 1/sqrt(2N) output-projection init)."""
    hidden_size: int = 64
    """Model width h; the MLP is 4h wide."""
    num_attention_heads: int = 4
    """Attention heads; each TP rank owns num_attention_heads / tp whole heads."""
    seq_length: int = 128
    """Maximum sequence length (learned position embeddings)."""
    vocab_size: int = 50257
    """Real vocabulary size of the tokenizer, before padding."""
    make_vocab_size_divisible_by: int = 128
    """Pad the vocabulary to a multiple of lcm(this, tp); 1024 gives the paper's 51,200 for GPT-2."""
    hidden_dropout: float = 0.1
    """Dropout on embeddings and on each sublayer's output (outside TP regions)."""
    attention_dropout: float = 0.1
    """Dropout on attention probabilities (inside TP regions: differs per TP rank)."""
    init_method_std: float = 0.02
    """Std of the N(0, std) weight init; output projections use std / sqrt(2 num_layers)."""
    layernorm_epsilon: float = 1e-5
    """Layer-norm epsilon (GPT-2 and Hugging Face use 1e-5)."""
    gelu: str = "tanh"
    """The MLP's GeLU: "tanh" (GPT-2's approximation, which Megatron-LM's fused bias-GeLU also
    computes) or "erf" (the exact form; imported models trained with it)."""
    activation_checkpointing: bool = False
    """Recompute each transformer layer in the backward pass (paper: after every layer)."""
    num_tokentypes: int = 0
    """Token-type (segment) embeddings: 0 for GPT, 2 for BERT."""
    layernorm_order: str = "pre"
    """BERT only: "pre" (the paper's rearranged order, GPT-2 style) or "post" (original BERT)."""
    lm_head_gelu: str = "tanh"
    """BERT only: the masked-LM head's GeLU, "tanh" or "erf" (Megatron-LM computes erf there, even where
    its fused MLP computes tanh, unless a legacy model's --openai-gelu; an imported BERT keeps its own)."""

    def validate(self, tp: int = 1) -> None:
        """Raise ConfigError for a layout these sizes cannot be split into."""
        if tp < 1:
            raise ConfigError(f"tp={tp} must be a positive integer: use tp=1 (no tensor parallelism) or "
                              f"a divisor of num_attention_heads={self.num_attention_heads}")
        for name in ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "vocab_size",
                     "make_vocab_size_divisible_by"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}={getattr(self, name)} must be a positive integer")
        h, nh = self.hidden_size, self.num_attention_heads
        if h % nh:
            raise ConfigError(
                f"hidden_size={h} is not divisible by num_attention_heads={nh}: "
                f"choose a head count that divides {h}"
            )
        if nh % tp:
            raise ConfigError(
                f"num_attention_heads={nh} is not divisible by tp={tp}: every TP rank must own whole "
                f"heads; use a tp that divides {nh}"
            )
        check_gelu("gelu", self.gelu)
        check_gelu("lm_head_gelu", self.lm_head_gelu)
        if self.layernorm_order not in LAYERNORM_ORDERS:
            raise ConfigError(f"layernorm_order={self.layernorm_order!r} is not one of "
                              f"{LAYERNORM_ORDERS}: use 'pre' (the paper's) or 'post' (original BERT)")
        for name in ("hidden_dropout", "attention_dropout"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ConfigError(f"{name}={getattr(self, name)} must be in [0, 1)")
        if not 0.0 <= self.init_method_std < float("inf"):  # (nan fails both)
            raise ConfigError(f"init_method_std={self.init_method_std} must be a finite number >= 0: the initial "
                              "weights' standard deviation, e.g. 0.02 (the paper's)")
        if not 0.0 < self.layernorm_epsilon < float("inf"):
            raise ConfigError(f"layernorm_epsilon={self.layernorm_epsilon} must be a finite number > 0: the layer "
                              "norms' variance floor, e.g. 1e-5")

    def validate_gpt(self, tp: int = 1) -> None:
        """validate(tp), and a ConfigError naming each BERT-only setting a GPT would silently ignore."""
        self.validate(tp)
        ignored = [f"{name}={getattr(self, name)!r}" for name, value in GPT_ONLY_VALUES.items()
                   if getattr(self, name) != value]
        if ignored:
            defaults = ", ".join(f"{name}={value!r}" for name, value in GPT_ONLY_VALUES.items())
            raise ConfigError(f"{', '.join(ignored)}: BERT-only model settings that a GPT does not implement "
                              f"(it is pre-LN, without token types or a masked-LM head): drop them from the GPT's "
                              f"config (a GPT runs with {defaults}), or train family: bert")

    def padded_vocab_size(self, tp: int = 1) -> int:
        """The embedding's row count: vocab_size padded so that it splits evenly across tp."""
        return pad_vocab_size(self.vocab_size, self.make_vocab_size_divisible_by, tp)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads
