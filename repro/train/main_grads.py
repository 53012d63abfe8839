"""fp32 gradient accumulation and DP all-reduce for a half-precision model (Megatron-LM's main_grad).

bf16 keeps 8 significant bits, so a gradient summed over micro batches (or over DP ranks) in bf16
loses every contribution smaller than 2^-9 of the running sum. With `precision.main_grads: fp32`
each half parameter gets a hook that, as soon as autograd has produced its gradient, adds it into
an fp32 buffer and frees the half one. The fp32 master weights' `.grad` are views of that buffer,
so the optimizer, the TP-aware norm and the loss scaler read them with no copy.

The buffer is cut into buckets in the order backward produces gradients (reverse parameter order).
On the last micro batch of a step (outside `no_sync()`) a bucket is averaged and its all-reduce over
the DP group starts asynchronously once its last gradient is in, overlapped with the rest of
backward like torch DDP's reducer. Buckets start strictly in order (a complete bucket waits for the
ones before it), so every rank issues the same collectives in the same order; `finish()` waits.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from repro.parallel.grads import consecutive_groups
from repro.parallel.layers import is_tensor_parallel
from repro.parallel.mappings import group_size

DEFAULT_BUCKET_NUMEL = 2**24  # 64 MiB of fp32 per bucket


@dataclass(eq=False)  # compared by identity: fields hold tensors
class _Bucket:
    flat: torch.Tensor
    params: list[nn.Parameter]
    pending: int = 0
    handle: object | None = None
    ready: bool = False
    launched: bool = False


@dataclass(eq=False)
class _Slot:
    view: torch.Tensor
    bucket: _Bucket
    offset: int
    """Where `view` starts in `bucket.flat` (elements)."""
    written: bool = field(default=False)


class MainGrads:
    """fp32 main gradients of half parameters, accumulated by hooks and all-reduced in buckets."""

    def __init__(self, pairs: list[tuple[nn.Parameter, nn.Parameter]], dp_group=None,
                 bucket_numel: int = DEFAULT_BUCKET_NUMEL) -> None:
        """`pairs`: (half model parameter, its fp32 master), in the model's parameter order."""
        self.dp_group, self.dp_size = dp_group, group_size(dp_group)
        self.masters = [m for _, m in pairs]
        master_of = {p: m for p, m in pairs}
        self.slots: dict[nn.Parameter, _Slot] = {}
        self.buckets: list[_Bucket] = []
        backward_order = [p for p, _ in reversed(pairs)]
        for group in consecutive_groups(backward_order, bucket_numel, nn.Parameter.numel):
            self.buckets.append(self._bucket(group, master_of))
        self.sync, self.next_bucket = True, 0
        self.hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p, _ in pairs]

    def _bucket(self, group: list[nn.Parameter], master_of: dict) -> _Bucket:
        # weight matrices first, then the 1-D parameters AdamW does not decay, each TP-sharded before
        # replicated: a fused optimizer over the flat buffer (repro.train.flat_adamw) then steps two
        # contiguous runs per bucket and takes the TP-aware norm over four, not one per layer
        group = sorted(group, key=lambda p: (p.ndim < 2, not is_tensor_parallel(p)))
        flat = torch.zeros(sum(p.numel() for p in group), dtype=torch.float32, device=group[0].device)
        bucket = _Bucket(flat, group, pending=len(group))
        offset = 0
        for p in group:
            view = flat[offset:offset + p.numel()].view_as(p)
            master_of[p].grad = view
            self.slots[p] = _Slot(view, bucket, offset)
            offset += p.numel()
        return bucket

    def remove(self) -> None:
        """Detach from the model: its gradients land in `.grad` again (the masters keep theirs)."""
        for hook in self.hooks:
            hook.remove()
        self.hooks = []

    @contextmanager
    def no_sync(self):
        """Accumulate only: the micro batches before a step's last one."""
        self.sync = False
        try:
            yield
        finally:
            self.sync = True

    @torch.no_grad()
    def _on_grad(self, param: nn.Parameter) -> None:
        slot = self.slots[param]
        if slot.bucket.ready:
            raise RuntimeError("a gradient arrived after its bucket's all-reduce started (or was queued): a "
                               "second backward in one step must run inside MainGrads.no_sync()")
        if slot.written:
            slot.view.add_(param.grad)
        else:  # the step's first gradient overwrites the buffer: no zeroing pass
            slot.view.copy_(param.grad)
            slot.written = True
        param.grad = None
        if self.sync:
            slot.bucket.pending -= 1
            if slot.bucket.pending == 0:
                slot.bucket.ready = True
                self._launch_ready()

    def _launch_ready(self) -> None:
        """Start the all-reduces of the complete buckets at the front of the queue, in order."""
        while self.next_bucket < len(self.buckets) and self.buckets[self.next_bucket].ready:
            self._launch(self.buckets[self.next_bucket])
            self.next_bucket += 1

    def _launch(self, bucket: _Bucket) -> None:
        bucket.launched = True
        if self.dp_size > 1:
            bucket.flat.div_(self.dp_size)
            bucket.handle = dist.all_reduce(bucket.flat, group=self.dp_group, async_op=True)

    @torch.no_grad()
    def finish(self) -> list[nn.Parameter]:
        """Wait for the step's all-reduces (starting those of buckets with a parameter that got no
        gradient, whose slot is zeroed) and ready the next step; returns the masters."""
        for bucket in self.buckets[self.next_bucket:]:
            for p in bucket.params:
                if not self.slots[p].written:
                    self.slots[p].view.zero_()
            bucket.ready = True
        self._launch_ready()
        for bucket in self.buckets:
            if bucket.handle is not None:
                bucket.handle.wait()
            bucket.handle, bucket.ready, bucket.launched, bucket.pending = None, False, False, len(bucket.params)
        self.next_bucket = 0
        for slot in self.slots.values():
            slot.written = False
        return self.masters
