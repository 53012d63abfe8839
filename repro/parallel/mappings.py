"""The paper's conjugate operators f and g (Fig. 3), and scatter/gather along the last dimension.

Each is a private autograd Function with a public wrapper (g has two: one leaving its input as it
was, and the layers' in-place `reduce_from_tensor_parallel_region_`). With `group=None` (or a group
of one rank) every wrapper is the identity, so TP=1 is the serial model with no communication.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def group_size(group: dist.ProcessGroup | None) -> int:
    """Number of ranks in `group` (1 for None)."""
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group: dist.ProcessGroup | None) -> int:
    """This rank's index inside `group` (0 for None)."""
    return 0 if group is None else dist.get_rank(group)


def _all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    if group_size(group) == 1:
        return x
    x = x.contiguous()
    dist.all_reduce(x, group=group)
    return x


def _split_last_dim(x: torch.Tensor, group) -> torch.Tensor:
    size = group_size(group)
    if size == 1:
        return x
    if x.shape[-1] % size:
        raise ValueError(f"last dimension {x.shape[-1]} is not divisible by the TP size {size}")
    return x.chunk(size, dim=-1)[group_rank(group)].contiguous()


def _gather_last_dim(x: torch.Tensor, group) -> torch.Tensor:
    size = group_size(group)
    if size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(size)]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=-1)


class _CopyToTensorParallelRegion(torch.autograd.Function):
    """f: forward identity, backward all-reduce."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad.clone(), ctx.group), None


class _ReduceFromTensorParallelRegion(torch.autograd.Function):
    """g: forward all-reduce (of x itself when `inplace` and x is contiguous, else of a copy), backward identity."""

    @staticmethod
    def forward(ctx, x, group, inplace):
        if not (inplace and x.is_contiguous()):
            return _all_reduce(x.clone(memory_format=torch.contiguous_format), group)
        ctx.mark_dirty(x)
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


class _ScatterToTensorParallelRegion(torch.autograd.Function):
    """Forward: keep this rank's slice of the last dim; backward: all-gather the gradient."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split_last_dim(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_last_dim(grad, ctx.group), None


class _GatherFromTensorParallelRegion(torch.autograd.Function):
    """Forward: all-gather along the last dim; backward: keep this rank's slice."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather_last_dim(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _split_last_dim(grad, ctx.group), None


def copy_to_tensor_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    """The paper's f: identity forward, all-reduce backward (entry of a parallel block)."""
    return x if group_size(group) == 1 else _CopyToTensorParallelRegion.apply(x, group)


def reduce_from_tensor_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    """The paper's g: all-reduce forward, identity backward (exit of a parallel block). The sum is a
    new tensor (x itself at TP=1): x is left as it was."""
    return x if group_size(group) == 1 else _ReduceFromTensorParallelRegion.apply(x, group, False)


def reduce_from_tensor_parallel_region_(x: torch.Tensor, group) -> torch.Tensor:
    """g in place (torch's trailing underscore), as Megatron does: x is overwritten with the sum and
    returned, saving a copy of b*s*h per layer and direction. Only for a fresh matmul or embedding
    output that no autograd node saved and nothing else reads (RowParallelLinear, VocabParallelEmbedding);
    anything else goes through reduce_from_tensor_parallel_region."""
    return x if group_size(group) == 1 else _ReduceFromTensorParallelRegion.apply(x, group, True)


def scatter_to_tensor_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    """Split the last dim across TP ranks forward; all-gather backward."""
    return x if group_size(group) == 1 else _ScatterToTensorParallelRegion.apply(x, group)


def gather_from_tensor_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    """All-gather the last dim forward; split backward."""
    return x if group_size(group) == 1 else _GatherFromTensorParallelRegion.apply(x, group)
