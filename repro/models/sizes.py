"""The paper's named model sizes in one table, with parameter counts from the model definition."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from repro.models.config import ModelConfig


@dataclass(frozen=True)
class NamedSize:
    """A model size the paper reports, with where it reports it."""

    name: str
    family: str  # "gpt" or "bert"
    source: str  # table of the paper
    paper_params: str
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    seq_length: int
    vocab_size: int
    make_vocab_size_divisible_by: int

    def model_config(self, **overrides) -> ModelConfig:
        cfg = ModelConfig(
            num_layers=self.num_layers, hidden_size=self.hidden_size,
            num_attention_heads=self.num_attention_heads, seq_length=self.seq_length,
            vocab_size=self.vocab_size, make_vocab_size_divisible_by=self.make_vocab_size_divisible_by,
            num_tokentypes=2 if self.family == "bert" else 0,
        )
        return replace(cfg, **overrides)


GPT2_VOCAB, BERT_VOCAB = 50257, 30522


def _gpt(name, source, params, layers, hidden, heads) -> NamedSize:
    return NamedSize(name, "gpt", source, params, layers, hidden, heads, 1024, GPT2_VOCAB, 1024)


def _bert(name, params, layers, hidden, heads) -> NamedSize:
    return NamedSize(name, "bert", "Table 4", params, layers, hidden, heads, 512, BERT_VOCAB, 1024)


SIZES: dict[str, NamedSize] = {s.name: s for s in (
    _gpt("scaling-1.2b", "Table 1 config 1", "1.2B", 40, 1536, 16),
    _gpt("scaling-2.5b", "Table 1 config 2", "2.5B", 54, 1920, 20),
    _gpt("scaling-4.2b", "Table 1 config 3", "4.2B", 64, 2304, 24),
    _gpt("scaling-8.3b", "Table 1 config 4", "8.3B", 72, 3072, 32),
    _gpt("scaling-8.3b-16h", "Table 7 (config 4 with 16 heads)", "8.3B", 72, 3072, 16),
    _gpt("scaling-8.3b-24h", "Table 7 (config 4 with 24 heads)", "8.3B", 72, 3072, 24),
    _gpt("gpt2-355m", "Table 2", "355M", 24, 1024, 16),
    _gpt("gpt2-2.5b", "Table 2", "2.5B", 54, 1920, 20),
    _gpt("gpt2-8.3b", "Table 2", "8.3B", 72, 3072, 24),
    _bert("bert-336m", "336M", 24, 1024, 16),
    _bert("bert-1.3b", "1.3B", 24, 2048, 32),
    _bert("bert-3.9b", "3.9B", 48, 2560, 40),
)}


def get_size(name: str) -> NamedSize:
    """Look up a named size; the error lists the valid names."""
    if name not in SIZES:
        raise KeyError(f"unknown model size {name!r}; choose one of: {', '.join(SIZES)}")
    return SIZES[name]


def count_parameters(size: NamedSize) -> int:
    """Parameters of the serial (tp=1) model, built on the meta device (no memory, no init)."""
    cfg = size.model_config()
    with torch.device("meta"):
        if size.family == "bert":
            from repro.models.bert import BERT

            model = BERT(cfg)
        else:
            from repro.models.gpt import GPT

            model = GPT(cfg)
    return sum(p.numel() for p in model.parameters())


def format_count(n: int) -> str:
    """1_213_470_000 -> "1.21B"; 355_788_000 -> "355.8M"."""
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"
