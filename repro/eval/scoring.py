"""Token scoring shared by the evaluations: NLL and argmax from vocab-parallel logits, DP sums.

Logits stay split over the vocabulary: the NLL comes from the vocab-parallel cross-entropy (three
all-reduces of n scalars) and the argmax from a vocab-parallel argmax (two), never an all-gather.
Only the positions that are scored go through the output layer, which is most of the cost of a
small model with a 50k vocabulary (a stride-32 window scores 32 of its 1024 positions).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from repro.parallel.cross_entropy import vocab_parallel_cross_entropy
from repro.parallel.groups import ProcessGroups
from repro.parallel.mappings import group_rank, group_size


def vocab_parallel_argmax(logits: torch.Tensor, tp_group=None) -> torch.Tensor:
    """Global argmax ids (...) of vocab-parallel logits (..., V/tp); ties go to the lowest id.

    Worked example, tp=2, V=4: rank 0 holds ids 0-1 with logits [1, 5], rank 1 ids 2-3 with
    [5, 2]. Local maxima 5 @ 1 and 5 @ 3; the all-reduced max is 5; both ranks hold it, so the
    all-reduced min of the candidate ids gives 1, as torch.argmax of [1, 5, 5, 2] does.
    """
    local_max, local_idx = logits.max(dim=-1)  # first occurrence on this rank
    if group_size(tp_group) == 1:
        return local_idx
    global_max = local_max.clone()
    dist.all_reduce(global_max, op=dist.ReduceOp.MAX, group=tp_group)
    candidate = local_idx + group_rank(tp_group) * logits.shape[-1]
    no_candidate = torch.iinfo(candidate.dtype).max
    candidate = torch.where(local_max == global_max, candidate, torch.full_like(candidate, no_candidate))
    dist.all_reduce(candidate, op=dist.ReduceOp.MIN, group=tp_group)
    return candidate


def selected_logits(model, ids: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """This rank's logits (n, V/tp) at the positions where keep (b, s) is True, row-major order."""
    if hasattr(model, "hidden_states") and hasattr(model, "output_layer"):  # GPT: only the kept rows
        return model.output_layer(model.hidden_states(ids)[keep])
    return model(ids)[keep]  # any module returning local logits (b, s, V/tp)


@torch.no_grad()
def score_positions(model, tp_group, ids: torch.Tensor, targets: torch.Tensor,
                    keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Float64 NLL (n,) and argmax-correct flags (n,) of targets at the kept positions."""
    logits = selected_logits(model, ids, keep)
    wanted = targets[keep]
    nll = vocab_parallel_cross_entropy(logits, wanted, tp_group).double()
    correct = vocab_parallel_argmax(logits, tp_group) == wanted
    return nll, correct


def perplexity(mean_nll: float) -> float:
    """exp(mean NLL), inf where that overflows a float (a diverged model's huge finite losses): the
    evaluation still reports and saves its sums instead of raising OverflowError."""
    try:
        return math.exp(mean_nll)
    except OverflowError:
        return math.inf


def model_device(model) -> torch.device:
    """The device of the model's first parameter (CPU for a parameter-less module)."""
    param = next(iter(model.parameters()), None)
    return param.device if param is not None else torch.device("cpu")


def max_positions(model) -> int | None:
    """The model's maximum sequence length, or None when it has no such limit."""
    cfg = getattr(model, "cfg", None)
    return getattr(cfg, "seq_length", None)


def dp_share(items: list, pg: ProcessGroups) -> list:
    """This DP rank's items (every dp_size-th from dp_rank); TP ranks of a group get the same."""
    return items[pg.dp_rank::pg.dp_size]


def dp_sum(values: list[float], pg: ProcessGroups, device=None) -> list[float]:
    """Float64 sums of `values` over the DP group (each rank contributes its own partial sums)."""
    totals = torch.tensor(values, dtype=torch.float64, device=device)
    if pg.dp_size > 1:
        dist.all_reduce(totals, group=pg.dp_group)
    return totals.tolist()
