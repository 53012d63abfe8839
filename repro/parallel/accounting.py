"""Count the collectives a step issues (by intercepting torch.distributed) and the paper's analytic count."""

from __future__ import annotations

import contextlib
from collections import Counter
from dataclasses import dataclass, field

import torch.distributed as dist

_INTERCEPTED = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter",
                "reduce_scatter_tensor", "broadcast", "all_to_all", "all_to_all_single")


@dataclass
class CollectiveLog:
    """Every intercepted call as (phase, op, elements, bytes); set `phase` between passes."""

    phase: str = "forward"
    calls: list[tuple[str, str, int, int]] = field(default_factory=list)

    def counts(self, phase: str | None = None) -> Counter:
        """(op, elements) -> number of calls, for one phase or all."""
        return Counter((op, n) for ph, op, n, _ in self.calls if phase in (None, ph))

    def total_bytes(self, phase: str | None = None) -> int:
        return sum(b for ph, _, _, b in self.calls if phase in (None, ph))


def _numel_and_bytes(args) -> tuple[int, int]:
    first = args[0]
    tensors = first if isinstance(first, (list, tuple)) else [first]
    if len(args) > 1 and hasattr(args[1], "numel"):  # all_gather(list, tensor) / *_into_tensor(out, in)
        tensors = [args[1]]
    numel = sum(t.numel() for t in tensors)
    return numel, sum(t.numel() * t.element_size() for t in tensors)


@contextlib.contextmanager
def count_collectives():
    """Patch torch.distributed's collectives to record every call made through the module."""
    log = CollectiveLog()
    originals = {name: getattr(dist, name) for name in _INTERCEPTED}

    def wrap(name, fn):
        def recorded(*args, **kwargs):
            numel, nbytes = _numel_and_bytes(args)
            log.calls.append((log.phase, name, numel, nbytes))
            return fn(*args, **kwargs)
        return recorded

    for name, fn in originals.items():
        setattr(dist, name, wrap(name, fn))
    try:
        yield log
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)


def expected_tp_collectives(num_layers: int, batch: int, seq: int, hidden: int) -> dict[str, Counter]:
    """The paper's count for one forward+backward of GPT at tp > 1 (all are all-reduces).

    forward:  2 per layer (g after attention and MLP) + 1 (g of the vocab-parallel embedding), each
              b*s*h elements, + 3 of b*s (max, target logit, sum-exp of the parallel cross-entropy);
    backward: 2 per layer (f before attention and MLP) + 1 (f before the tied output layer), b*s*h.
    """
    bsh, bs = batch * seq * hidden, batch * seq
    return {
        "forward": Counter({("all_reduce", bsh): 2 * num_layers + 1, ("all_reduce", bs): 3}),
        "backward": Counter({("all_reduce", bsh): 2 * num_layers + 1}),
    }
