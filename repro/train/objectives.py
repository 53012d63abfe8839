"""What a training step minimises, per model family, and the data that feeds it.

The objective is a small module around the model, so DDP / DeepSpeed wrap one `forward(batch)`
that returns the micro batch's scalar loss and its detached parts (BERT: `mlm_loss`, `sop_loss`),
logged per step beside `loss`; checkpoints save the bare model underneath.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn

from repro.parallel.groups import ProcessGroups
from repro.train.config import RunConfig


Parts = dict[str, torch.Tensor]
"""Detached scalar components of a micro batch's loss, averaged and logged like the loss itself."""


class GPTObjective(nn.Module):
    """Mean next-token cross-entropy of a (tokens, labels) micro batch (no parts)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, batch) -> tuple[torch.Tensor, Parts]:
        tokens, labels = batch
        return self.model(tokens, labels).float().mean(), {}

    def metrics(self, batch) -> dict[str, torch.Tensor]:
        """Held-out metrics of a micro batch."""
        return {"loss": self(batch)[0]}


class BertObjective(nn.Module):
    """Masked-LM loss (mean over predicted tokens) + sentence-order-prediction loss; both are parts."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, Parts]:
        losses = self.model.losses(batch)
        return losses["total"], {"mlm_loss": losses["mlm"].detach(), "sop_loss": losses["sop"].detach()}

    def metrics(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Held-out metrics of a micro batch: total, MLM and SOP losses."""
        losses = self.model.losses(batch)
        return {"loss": losses["total"], "mlm_loss": losses["mlm"], "sop_loss": losses["sop"]}


def build_model(cfg: RunConfig, pg: ProcessGroups, rng, device) -> nn.Module:
    """The family's model at this TP rank, initialised from the run's seed."""
    if cfg.family == "bert":
        from repro.models.bert import BERT

        return BERT(cfg.model, pg.tp_group, rng=rng, seed=cfg.train.seed).to(device)
    from repro.models.gpt import GPT

    return GPT(cfg.model, pg.tp_group, rng=rng, seed=cfg.train.seed).to(device)


def build_objective(cfg: RunConfig, model: nn.Module) -> nn.Module:
    return BertObjective(model) if cfg.family == "bert" else GPTObjective(model)


def to_device(batch, device: torch.device):
    """Move a micro batch (tuple of tensors or dict of tensors) to the device. To a GPU it goes
    through pinned memory without blocking: a pageable copy would make the host wait for all queued
    kernels (torch synchronizes a blocking copy), stalling the launch queue at every micro batch."""
    def move(t: torch.Tensor) -> torch.Tensor:
        return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t.to(device)

    if isinstance(batch, dict):
        return {k: move(v) for k, v in batch.items()}
    return tuple(move(t) for t in batch)


def build_dataset(cfg: RunConfig, prefix: str, write_cache: bool = True):
    """The family's dataset of an indexed-dataset prefix (GPT samples or BERT sentence pairs);
    `write_cache`: this rank writes the sample-order caches (one rank of a job does)."""
    cache = cfg.data.cache_dir or None
    if cfg.family == "bert":
        from repro.data.bert_dataset import BertDataset, BertOptions
        from repro.data.tokenizers import build_tokenizer

        vocab_dir = cfg.data.vocab_dir or os.environ.get("REPRO_DATA_DIR", "data")
        tokenizer = build_tokenizer("bert", Path(vocab_dir))
        opts = BertOptions(max_seq_length=cfg.model.seq_length, seed=cfg.train.seed)
        return BertDataset(prefix, tokenizer, opts, cache, write_cache, cfg.model.vocab_size)
    from repro.data.gpt_dataset import GPTDataset

    return GPTDataset(prefix, cfg.model.seq_length, cfg.train.seed, cache, write_cache, cfg.model.vocab_size)


def data_loader(cfg: RunConfig, pg: ProcessGroups, dataset, consumed_samples: int = 0, device_type: str = "cpu"):
    """A resumable micro-batch loader over `dataset` for this DP rank: `loader_workers` processes
    build its samples ahead."""
    if cfg.family == "bert":
        from repro.data.bert_dataset import bert_loader as loader
    else:
        from repro.data.gpt_dataset import gpt_loader as loader
    return loader(dataset, cfg.train.micro_batch_size, pg.dp_rank, pg.dp_size, consumed_samples,
                  workers=loader_workers(cfg, device_type))


def loader_workers(cfg: RunConfig, device_type: str) -> int:
    """`data.num_workers`, or by default 2 for BERT on a GPU, else 0 (see DataConfig)."""
    if cfg.data.num_workers is not None:
        return cfg.data.num_workers
    return 2 if cfg.family == "bert" and device_type == "cuda" else 0
