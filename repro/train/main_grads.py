"""fp32 gradient accumulation and DP all-reduce for a half-precision model (Megatron-LM's main_grad).

bf16 keeps 8 significant bits, so a gradient summed over micro batches (or over DP ranks) in bf16
loses every contribution smaller than 2^-9 of the running sum. With `precision.main_grads: fp32`
each half parameter gets a hook that takes its gradient as soon as autograd has produced it; once a
bucket (below) holds every gradient of a backward, one foreach call widens them all into the fp32
buffer (copies on a step's first micro batch, adds on later ones) and the half ones are freed. That is
a few kernel launches a bucket instead of one per parameter, which matters where a compiled backward
hands all ~500 gradients of a 1.2B model over at its end. The fp32 master weights' `.grad` are views
of that buffer, so the optimizer, the TP-aware norm and the loss scaler read them with no copy.

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


@dataclass(eq=False)
class _Slot:
    view: torch.Tensor
    bucket: "_Bucket"
    offset: int
    """Where `view` starts in `bucket.flat` (elements)."""
    written: bool = False
    """The view holds this step's gradient: later micro batches add into it."""


@dataclass(eq=False)  # compared by identity: fields hold tensors
class _Bucket:
    flat: torch.Tensor
    params: list[nn.Parameter]
    arrived: dict[nn.Parameter, torch.Tensor] = field(default_factory=dict)
    """This backward's half gradients not yet widened into `flat`."""
    handle: object | None = None
    ready: bool = False
    launched: bool = False

    def widen(self, slots: dict[nn.Parameter, _Slot]) -> None:
        """Copy (first micro batch) or add (later ones) the arrived gradients into their fp32 views."""
        fresh = [(slots[p], g) for p, g in self.arrived.items() if not slots[p].written]
        again = [(slots[p], g) for p, g in self.arrived.items() if slots[p].written]
        if fresh:  # the step's first gradient overwrites the buffer: no zeroing pass
            torch._foreach_copy_([s.view for s, _ in fresh], [g for _, g in fresh])
            for slot, _ in fresh:
                slot.written = True
        if again:
            torch._foreach_add_([s.view for s, _ in again], [g for _, g in again])
        self.arrived.clear()


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
        bucket = _Bucket(flat, group)
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
            self._widen_all()  # buckets with a parameter that got no gradient in this micro batch

    def _widen_all(self) -> None:
        for bucket in self.buckets:
            if bucket.arrived:
                bucket.widen(self.slots)

    @torch.no_grad()
    def _on_grad(self, param: nn.Parameter) -> None:
        bucket = self.slots[param].bucket
        if bucket.ready:
            raise RuntimeError("a gradient arrived after its bucket's all-reduce started (or was queued): a "
                               "second backward in one step must run inside MainGrads.no_sync()")
        if param in bucket.arrived:  # a second backward before this one's bucket was complete
            bucket.widen(self.slots)
        bucket.arrived[param] = param.grad
        param.grad = None
        if len(bucket.arrived) == len(bucket.params):
            bucket.widen(self.slots)
            if self.sync:
                bucket.ready = True
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
        self._widen_all()
        for bucket in self.buckets[self.next_bucket:]:
            for p in bucket.params:
                if not self.slots[p].written:
                    self.slots[p].view.zero_()
            bucket.ready = True
        self._launch_ready()
        for bucket in self.buckets:
            if bucket.handle is not None:
                bucket.handle.wait()
            bucket.handle, bucket.ready, bucket.launched = None, False, False
        self.next_bucket = 0
        for slot in self.slots.values():
            slot.written = False
        return self.masters
