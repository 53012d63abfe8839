"""Shared pieces of the tests/test_eval_*.py files: the data mirror and tiny models."""

from __future__ import annotations

import os
from pathlib import Path

import json

import torch
from torch import nn

from conftest import require

MIRROR = Path(os.environ.get("REPRO_DATA_MIRROR") or "/work/shared/data").absolute()


def mirror() -> Path:
    """The read-only data mirror (skips locally, fails in CI when missing)."""
    require((MIRROR / "vocab" / "gpt2-vocab.json").is_file(), f"the data mirror {MIRROR}")
    return MIRROR


class PositionalModel(nn.Module):
    """Logits that depend only on the position in the window: row p of `table` (s, V)."""

    def __init__(self, table: torch.Tensor) -> None:
        super().__init__()
        self.table = table

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        b, s = ids.shape
        return self.table[:s].unsqueeze(0).expand(b, s, -1).clone()  # (b, s, V)


class TrigramOracle(nn.Module):
    """Predicts the token that followed the same three tokens in `known` sequences (else id 0)."""

    def __init__(self, table: dict[tuple[int, int, int], int], vocab: int) -> None:
        super().__init__()
        self.next_of, self.vocab = table, vocab

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        b, s = ids.shape
        logits = torch.zeros(b, s, self.vocab)
        rows = ids.tolist()
        for i in range(b):
            for p in range(2, s):
                token = self.next_of.get(tuple(rows[i][p - 2:p + 1]))
                if token is not None:
                    logits[i, p, token] = 10.0
        return logits


def write_tiny_checkpoint(run_dir, run_id: str | None = None, seq_length: int = 128, **shape):
    """A trainer-format checkpoint (meta.json + model_tp00.pt) of a tiny untrained GPT (`shape`:
    ModelConfig fields in place of 2 layers, hidden size 32 and 4 heads)."""
    from repro.models.config import ModelConfig
    from repro.models.gpt import GPT
    from repro.parallel.groups import ProcessGroups
    from repro.train import checkpoint as ck

    cfg = ModelConfig(**{"num_layers": 2, "hidden_size": 32, "num_attention_heads": 4, **shape},
                      seq_length=seq_length, hidden_dropout=0.0, attention_dropout=0.0)
    root, pg = run_dir / "checkpoints", ProcessGroups.single()
    tmp = ck.begin_save(root, 5, pg)
    torch.save(GPT(cfg, seed=11).state_dict(), tmp / "model_tp00.pt")
    meta = {"format": ck.FORMAT_VERSION, "family": "gpt", "iteration": 5, "tp": 1, "dp": 1,
            "world_size": 1, "model": cfg.__dict__, "mlflow_run_id": run_id}
    (tmp / "meta.json").write_text(json.dumps(meta))
    return ck.finish_save(root, 5, pg)
