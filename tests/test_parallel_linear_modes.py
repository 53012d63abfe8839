"""The layers' gather and scatter modes (repro/parallel/mappings.py's all-gather forward / split
backward and split forward / all-gather backward): ColumnParallelLinear(gather_output=True) feeding
RowParallelLinear(input_is_parallel=False) on 2 gloo ranks equals a serial nn.Linear pair, values and
every gradient. The model's own layers keep their outputs parallel, so only this test reaches the
gradients of these two paths."""

from __future__ import annotations

import torch

from repro.parallel.checks import rel_error
from repro.parallel.spawn import run_ranks

IN, HIDDEN, OUT = 6, 8, 5  # HIDDEN is split across the 2 ranks: 4 columns of the first layer each
TOLERANCE = 1e-10
"""float64: TP only reorders sums (the row layer's two partial products, the all-reduce of the input
gradient), ~1e-16 relative each; a wrong shard in either backward is an O(1) error."""


def _serial_pair(gen: torch.Generator) -> tuple[torch.nn.Linear, torch.nn.Linear]:
    """Two nn.Linear layers with random weights and biases (float64), the same on every rank."""
    first, second = torch.nn.Linear(IN, HIDDEN).double(), torch.nn.Linear(HIDDEN, OUT).double()
    with torch.no_grad():
        for p in [*first.parameters(), *second.parameters()]:
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64))
    return first, second


def _gathered_then_scattered() -> dict[str, float]:
    """This rank's worst relative error of each output and gradient against the serial pair."""
    import torch.distributed as dist

    from repro.parallel.layers import ColumnParallelLinear, RowParallelLinear

    group, rank = dist.group.WORLD, dist.get_rank()
    gen = torch.Generator().manual_seed(3)
    first, second = _serial_pair(gen)
    x = torch.randn(2, 3, IN, generator=gen, dtype=torch.float64)
    weights = torch.randn(2, 3, OUT, generator=gen, dtype=torch.float64)  # a loss no symmetry can fool

    column = ColumnParallelLinear(IN, HIDDEN, tp_group=group, gather_output=True, dtype=torch.float64)
    row = RowParallelLinear(HIDDEN, OUT, tp_group=group, input_is_parallel=False, dtype=torch.float64)
    with torch.no_grad():  # this rank's shards of the serial weights
        column.weight.copy_(first.weight.chunk(2, dim=0)[rank])
        column.bias.copy_(first.bias.chunk(2, dim=0)[rank])
        row.weight.copy_(second.weight.chunk(2, dim=1)[rank])
        row.bias.copy_(second.bias)

    x_ref, x_tp = x.clone().requires_grad_(), x.clone().requires_grad_()
    hidden_ref, hidden_tp = first(x_ref), column(x_tp)
    hidden_ref.retain_grad()
    hidden_tp.retain_grad()
    out_ref, out_tp = second(hidden_ref), row(hidden_tp)
    (out_ref * weights).sum().backward()
    (out_tp * weights).sum().backward()
    return {
        "gathered hidden": rel_error(hidden_tp, hidden_ref),
        "output": rel_error(out_tp, out_ref),
        "hidden grad (scatter backward)": rel_error(hidden_tp.grad, hidden_ref.grad),
        "input grad": rel_error(x_tp.grad, x_ref.grad),
        "column weight grad (gather backward)": rel_error(column.weight.grad, first.weight.grad.chunk(2, 0)[rank]),
        "column bias grad (gather backward)": rel_error(column.bias.grad, first.bias.grad.chunk(2, 0)[rank]),
        "row weight grad": rel_error(row.weight.grad, second.weight.grad.chunk(2, 1)[rank]),
        "row bias grad": rel_error(row.bias.grad, second.bias.grad),
    }


def test_gathered_column_into_scattered_row_equals_the_serial_pair():
    """Every gradient, on each rank, within 1e-10 of the serial pair's (float64): a backward that
    kept another rank's slice (the gather) or gathered anything but each rank's own gradient (the
    scatter) gives rank 1 (or both) another layer's worth of gradient."""
    ranks = run_ranks(_gathered_then_scattered, 2)
    assert len(ranks) == 2 and all(len(errors) == 8 for errors in ranks)
    bad = {(rank, name): err for rank, errors in enumerate(ranks) for name, err in errors.items() if err > TOLERANCE}
    assert not bad, bad
