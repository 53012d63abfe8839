"""Tensor-parallel layers: the paper's column- and row-parallel linears and vocab-parallel embedding.

Every layer draws its *full* master weight from a generator shared by all ranks and keeps only
its own slice, so a model built from the same seed is bit-identical at every TP degree (the
embedding draws a tp-independent number of rows although its padding depends on tp). Sharded
parameters carry `tensor_model_parallel=True`, `partition_dim` and `partition_stride`, which the
gradient norm, DeepSpeed ZeRO and checkpoint resharding read.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from repro.parallel.half_gemm import linear
from repro.parallel.mappings import (
    copy_to_tensor_parallel_region,
    gather_from_tensor_parallel_region,
    group_rank,
    group_size,
    reduce_from_tensor_parallel_region_,
    scatter_to_tensor_parallel_region,
)

InitFn = Callable[[torch.Tensor, torch.Generator | None], None]


def normal_init(std: float) -> InitFn:
    """N(0, std) initialiser drawing from an explicit generator."""

    def init(tensor: torch.Tensor, generator: torch.Generator | None) -> None:
        nn.init.normal_(tensor, mean=0.0, std=std, generator=generator)

    return init


def scaled_init(std: float, num_layers: int) -> InitFn:
    """N(0, std / sqrt(2 N)): the paper's init for projections that feed a residual add."""
    return normal_init(std / math.sqrt(2.0 * num_layers))


def mark_tensor_parallel(param: nn.Parameter, partition_dim: int, stride: int = 1) -> None:
    """Tag a sharded parameter (read by grad-norm, ZeRO and resharding)."""
    param.tensor_model_parallel = True
    param.partition_dim = partition_dim
    param.partition_stride = stride


def is_tensor_parallel(param: torch.Tensor) -> bool:
    """True for parameters sharded across the TP group."""
    return bool(getattr(param, "tensor_model_parallel", False))


def shard_master(master: torch.Tensor, dim: int, rank: int, size: int, stride: int = 1) -> torch.Tensor:
    """This rank's slice of a full tensor split along `dim` into `size * stride` chunks.

    With stride 3 (fused QKV) rank r takes chunks r, size + r, 2 * size + r: its own heads'
    query, key and value rows.
    """
    chunks = master.chunk(size * stride, dim=dim)
    return torch.cat([chunks[i * size + rank] for i in range(stride)], dim=dim)


def unshard(shards: list[torch.Tensor], dim: int, stride: int = 1) -> torch.Tensor:
    """Inverse of `shard_master`: the full tensor from every rank's slice, in rank order."""
    pieces = [s.chunk(stride, dim=dim) for s in shards]
    return torch.cat([pieces[r][i] for i in range(stride) for r in range(len(shards))], dim=dim)


def gather_full(param: torch.Tensor, tp_group) -> torch.Tensor:
    """The full (unsharded) tensor of a TP-sharded parameter or gradient (collective over the TP group)."""
    shards = [torch.empty_like(param) for _ in range(group_size(tp_group))]
    dist.all_gather(shards, param.contiguous(), group=tp_group)
    return unshard(shards, param.partition_dim, getattr(param, "partition_stride", 1))


def pad_vocab_rows(tensor: torch.Tensor, padded_vocab: int) -> torch.Tensor:
    """A vocabulary-indexed tensor (rows along dim 0) padded with zero rows to `padded_vocab`."""
    return torch.cat([tensor, tensor.new_zeros(padded_vocab - tensor.shape[0], *tensor.shape[1:])])


def tp_markers(module: nn.Module) -> dict[str, tuple[int, int]]:
    """name -> (partition_dim, partition_stride) of every TP-sharded parameter of `module`."""
    return {n: (p.partition_dim, getattr(p, "partition_stride", 1))
            for n, p in module.named_parameters() if is_tensor_parallel(p)}


def to_empty_keeping_markers(module: nn.Module, device) -> nn.Module:
    """`module.to_empty(device=device)` with the TP markers kept (to_empty replaces every Parameter)."""
    markers = tp_markers(module)
    module = module.to_empty(device=device)
    for name, p in module.named_parameters():
        if name in markers:
            mark_tensor_parallel(p, *markers[name])
    return module


def _init_sharded(
    param: nn.Parameter, full_shape: tuple[int, ...], dim: int, group, stride: int,
    init: InitFn, generator: torch.Generator | None, drawn_rows: int | None = None,
) -> None:
    """Draw the full master weight on CPU, then copy this rank's slice into `param`.

    With `drawn_rows`, only that many rows (dim 0) are drawn and the rest are zero.
    """
    if param.is_meta:
        return
    rows = full_shape[0] if drawn_rows is None else drawn_rows
    master = torch.empty(rows, *full_shape[1:], dtype=torch.float32)
    init(master, generator)
    if rows < full_shape[0]:
        master = pad_vocab_rows(master, full_shape[0])
    shard = shard_master(master, dim, group_rank(group), group_size(group), stride)
    with torch.no_grad():
        param.copy_(shard)


def _divide(total: int, parts: int, what: str) -> int:
    if total % parts:
        raise ValueError(f"{what}={total} is not divisible by the tensor-parallel size {parts}")
    return total // parts


class ColumnParallelLinear(nn.Module):
    """Y = X A + b with A split by columns: rank i computes X A_i (f at the input).

    Weight is stored as (out_features / tp, in_features), like nn.Linear.
    """

    def __init__(
        self, in_features: int, out_features: int, *, tp_group=None, bias: bool = True,
        gather_output: bool = False, stride: int = 1, init: InitFn = normal_init(0.02),
        generator: torch.Generator | None = None, device=None, dtype=None,
    ) -> None:
        super().__init__()
        if gather_output and stride > 1:
            raise ValueError(f"ColumnParallelLinear: gather_output=True with stride={stride} is not supported "
                             "(the gathered columns would come out interleaved per rank, not in the serial "
                             "order): keep the output parallel (gather_output=False)")
        self.tp_group, self.gather_output = tp_group, gather_output
        tp = group_size(tp_group)
        if out_features % (tp * stride):
            raise ValueError(f"out_features={out_features} must be divisible by tp*stride = {tp}*{stride}: each TP "
                             f"rank takes an equal slice of each of the {stride} strided parts (e.g. q, k, v)")
        self.out_per_rank = out_features // tp
        self.weight = nn.Parameter(torch.empty(self.out_per_rank, in_features, device=device, dtype=dtype))
        mark_tensor_parallel(self.weight, partition_dim=0, stride=stride)
        _init_sharded(self.weight, (out_features, in_features), 0, tp_group, stride, init, generator)
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.zeros(self.out_per_rank, device=device, dtype=dtype))
            mark_tensor_parallel(self.bias, partition_dim=0, stride=stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = copy_to_tensor_parallel_region(x, self.tp_group)
        y = linear(x, self.weight, self.bias)
        return gather_from_tensor_parallel_region(y, self.tp_group) if self.gather_output else y


class RowParallelLinear(nn.Module):
    """Y = X A + b with A split by rows: rank i computes X_i A_i, then g sums; b added once after."""

    def __init__(
        self, in_features: int, out_features: int, *, tp_group=None, bias: bool = True,
        input_is_parallel: bool = True, init: InitFn = normal_init(0.02),
        generator: torch.Generator | None = None, device=None, dtype=None,
    ) -> None:
        super().__init__()
        self.tp_group, self.input_is_parallel = tp_group, input_is_parallel
        in_per_rank = _divide(in_features, group_size(tp_group), "in_features")
        self.weight = nn.Parameter(torch.empty(out_features, in_per_rank, device=device, dtype=dtype))
        mark_tensor_parallel(self.weight, partition_dim=1)
        _init_sharded(self.weight, (out_features, in_features), 1, tp_group, 1, init, generator)
        self.bias = nn.Parameter(torch.zeros(out_features, device=device, dtype=dtype)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = scatter_to_tensor_parallel_region(x, self.tp_group)
        y = reduce_from_tensor_parallel_region_(linear(x, self.weight), self.tp_group)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Embedding split along the vocabulary: rank i owns ids [i*V/tp, (i+1)*V/tp).

    Ids outside this rank's range give zero rows; g sums the partial lookups. An id outside
    [0, vocab_size) fails at every TP degree alike (a RuntimeError on CPU, a device-side assert on
    GPU; no host sync). Only `drawn_rows` rows (default all) are drawn from `generator`, the rest
    are zero: pass a tp-independent count (the tp=1 padded vocab) so that the generator stream,
    and so every later layer, is the same at every TP degree.
    """

    def __init__(
        self, num_embeddings: int, embedding_dim: int, *, tp_group=None,
        init: InitFn = normal_init(0.02), generator: torch.Generator | None = None,
        device=None, dtype=None, vocab_size: int | None = None, drawn_rows: int | None = None,
    ) -> None:
        super().__init__()
        self.tp_group = tp_group
        self.num_embeddings = num_embeddings
        self.vocab_size = num_embeddings if vocab_size is None else vocab_size
        self._bad_id = f"VocabParallelEmbedding: a token id is outside [0, {self.vocab_size})"
        per_rank = _divide(num_embeddings, group_size(tp_group), "padded vocab size")
        self.vocab_start = group_rank(tp_group) * per_rank
        self.vocab_end = self.vocab_start + per_rank
        self.weight = nn.Parameter(torch.empty(per_rank, embedding_dim, device=device, dtype=dtype))
        mark_tensor_parallel(self.weight, partition_dim=0)
        _init_sharded(self.weight, (num_embeddings, embedding_dim), 0, tp_group, 1, init, generator,
                      drawn_rows=drawn_rows)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        torch._assert_async(((ids >= 0) & (ids < self.vocab_size)).all(), self._bad_id)
        if group_size(self.tp_group) == 1:
            return F.embedding(ids, self.weight)
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local_ids = (ids - self.vocab_start).masked_fill(outside, 0)
        rows = F.embedding(local_ids, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_tensor_parallel_region_(rows, self.tp_group)


def pad_vocab_size(vocab_size: int, divisible_by: int, tp: int) -> int:
    """Round the vocab up to a multiple of lcm(divisible_by, tp), so every rank gets V/tp rows.

    GPT-2's 50,257 with divisible_by=1024 gives the paper's 51,200 at tp = 1, 2, 4 and 8 (each
    rank's slice then a multiple of 128 at tp=8). With divisible_by=128: 50,304.
    """
    multiple = math.lcm(divisible_by, tp)
    return int(math.ceil(vocab_size / multiple) * multiple)
