"""Analytic memory per rank: parameters, gradients and optimizer state at a TP degree and ZeRO stage.

Parameter count per TP rank (GPT, tied output layer): the sharded matrices (wte V_p h, per layer
QKV 3h^2 + 3h, attention output h^2, MLP 4h^2 + 4h and 4h^2) divided by tp, plus the replicated
rest (wpe s h, per layer two layer norms 4h and two row-parallel biases 2h, the final norm 2h).

Bytes per parameter (Rajbhandari et al. 2020, ZeRO §3): mixed-precision Adam keeps 2 (half
weights) + 2 (half grads) + 12 (fp32 master, m, v); fp32 Adam keeps 4 + 4 + 8 (m, v), and
DeepSpeed's ZeRO-1/2 also keeps an fp32 partition of the weights (+4). ZeRO-1 divides the optimizer
state by dp; ZeRO-2 also the gradients; ZeRO-3 also the parameters.

DeepSpeed's ZeRO-1/2 partitions one flat buffer of all parameters (in model.parameters() order), padded
to a multiple of 2 dp, into dp equal slices; `zero_partition_numel` and `zero_staged_numel` give the
sizes of its gradient buffers (see repro.perf.bench_zero).
"""

from __future__ import annotations

from dataclasses import dataclass

from repro.models.config import ModelConfig


def params_per_rank(cfg: ModelConfig, tp: int = 1) -> int:
    """Number of parameters one TP rank holds (its shards plus the replicated tensors)."""
    h = cfg.hidden_size
    embeddings = cfg.padded_vocab_size(tp) * h // tp + cfg.seq_length * h
    return embeddings + cfg.num_layers * layer_params_per_rank(cfg, tp) + 2 * h  # + the final norm


def layer_params_per_rank(cfg: ModelConfig, tp: int = 1) -> int:
    """Parameters of one transformer layer on one TP rank: QKV 3h^2 + 3h, attention output h^2, MLP
    4h^2 + 4h and 4h^2 sharded; two layer norms 4h and two row-parallel biases 2h replicated."""
    h = cfg.hidden_size
    return (3 * h * h + 3 * h + h * h + 4 * h * h + 4 * h + 4 * h * h) // tp + 4 * h + 2 * h


def bert_params_per_rank(cfg: ModelConfig, tp: int = 1) -> int:
    """Parameters one TP rank of repro.models.bert.BERT with its heads holds: GPT's count (the same
    embeddings, layers and one extra layer norm) plus token-type embeddings, the pooler, the MLM
    head (dense, layer norm, vocab-parallel bias) and the SOP head."""
    h = cfg.hidden_size
    heads = (h * h + h) * 2 + 2 * h + 2 * h + 2  # pooler and MLM dense, MLM layer norm, SOP
    return params_per_rank(cfg, tp) + cfg.num_tokentypes * h + heads + cfg.padded_vocab_size(tp) // tp


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per rank by category."""

    params: int
    grads: int
    optimizer: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer


def bytes_per_param(precision: str, zero_stage: int, fp32_main_grads: bool = False) -> tuple[int, int, int]:
    """(weight, gradient, optimizer-state) bytes per parameter before any ZeRO division.

    `fp32_main_grads`: a half model whose gradients are accumulated in fp32 (the trainer's
    precision.main_grads: fp32, as Megatron-LM): 2 + 4 + 12 = 18 bytes instead of ZeRO's 16."""
    if precision == "fp32":
        return 4, 4, 8 + (4 if zero_stage > 0 else 0)  # DeepSpeed ZeRO keeps an fp32 partition
    return 2, 4 if fp32_main_grads else 2, 12


def memory_per_rank(cfg: ModelConfig, tp: int = 1, dp: int = 1, zero_stage: int = 0,
                    precision: str = "fp32", fp32_main_grads: bool = False, n: int | None = None) -> MemoryEstimate:
    """Analytic bytes of parameters, gradients and Adam state on one rank (of a GPT, or of a model
    with `n` parameters per rank)."""
    n = params_per_rank(cfg, tp) if n is None else n
    w, g, o = bytes_per_param(precision, zero_stage, fp32_main_grads)
    return MemoryEstimate(
        params=n * w // (dp if zero_stage >= 3 else 1),
        grads=n * g // (dp if zero_stage >= 2 else 1),
        optimizer=n * o // (dp if zero_stage >= 1 else 1),
    )


def zero_partition_numel(n: int, dp: int) -> int:
    """Elements of one rank's DeepSpeed ZeRO-1/2 partition: n padded to a multiple of 2 dp, over dp."""
    align = 2 * dp  # nccl_start_alignment_factor (2) x dp
    return -(-n // align) * align // dp


def zero_staged_numel(numels: list[int], dp: int, rank: int) -> int:
    """Elements of DeepSpeed's `grads_in_partition` on `rank`: every parameter overlapping its partition,
    copied whole (a parameter cut by a partition boundary is counted by both ranks)."""
    size = zero_partition_numel(sum(numels), dp)
    lo, hi, start, total = rank * size, (rank + 1) * size, 0, 0
    for n in numels:
        if start < hi and start + n > lo:
            total += n
        start += n
    return total
