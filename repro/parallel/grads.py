"""Gradient utilities aware of tensor parallelism: the global norm and clipping, DP averaging."""

from __future__ import annotations

from typing import Iterable

import torch
import torch.distributed as dist

from repro.parallel.layers import is_tensor_parallel
from repro.parallel.mappings import group_rank, group_size


def global_grad_norm(params: Iterable[torch.nn.Parameter], tp_group=None) -> torch.Tensor:
    """L2 norm of all gradients of the model, counting each sharded parameter once and each
    replicated one once (only TP rank 0 adds the replicated ones before the TP all-reduce)."""
    params = [p for p in params if p.grad is not None]
    count_replicated = group_rank(tp_group) == 0
    squares = [  # half gradients summed in fp32; fp32 and fp64 in their own precision
        p.grad.detach().to(torch.promote_types(p.grad.dtype, torch.float32)).pow(2).sum()
        for p in params
        if is_tensor_parallel(p) or count_replicated
    ]
    device = params[0].grad.device if params else torch.device("cpu")
    total = torch.stack(squares).sum() if squares else torch.zeros((), device=device)
    if group_size(tp_group) > 1:
        dist.all_reduce(total, group=tp_group)
    return total.sqrt()


def clip_grad_norm(params: Iterable[torch.nn.Parameter], max_norm: float, tp_group=None) -> torch.Tensor:
    """Scale gradients so the TP-aware global norm is at most `max_norm`; return the norm before."""
    params = [p for p in params if p.grad is not None]
    norm = global_grad_norm(params, tp_group)
    scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    for p in params:
        p.grad.detach().mul_(scale.to(p.grad.dtype))
    return norm


def all_reduce_gradients(params: Iterable[torch.nn.Parameter], dp_group=None) -> None:
    """Average gradients over the DP group in one flattened buffer per dtype."""
    size = group_size(dp_group)
    if size == 1:
        return
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for p in params:
        if p.grad is not None:
            by_dtype.setdefault(p.grad.dtype, []).append(p.grad)
    for grads in by_dtype.values():
        flat = torch._utils._flatten_dense_tensors(grads)
        dist.all_reduce(flat, group=dp_group)
        flat.div_(size)
        for grad, synced in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
            grad.copy_(synced)
