"""Correctness checks of the tensor-parallel implementation against the serial model.

Each check runs on every rank of an initialised world and returns `Check` rows; the tests assert
them and `repro selftest` prints them. Tolerances (relative to the reference's max magnitude):
float32 1e-5 (TP changes only the order of floating-point sums: a few ulps of ~1e-7 each, grown by
two layers and the softmax), float64 1e-10.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace

import torch
import torch.distributed as dist
import torch.nn.functional as F

from repro.models.config import ModelConfig
from repro.models.gpt import GPT
from repro.parallel.accounting import count_collectives, expected_tp_collectives
from repro.parallel.cross_entropy import vocab_parallel_cross_entropy
from repro.parallel.grads import all_reduce_gradients, global_grad_norm
from repro.parallel.groups import ParallelDims, ProcessGroups, build_process_groups
from repro.parallel.layers import gather_full, is_tensor_parallel, pad_vocab_size
from repro.parallel.mappings import gather_from_tensor_parallel_region, group_size
from repro.parallel.random import RNGTracker, seed_default_generators

TOLERANCE = {torch.float32: 1e-5, torch.float64: 1e-10}
TINY = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=16,
                   vocab_size=1000, hidden_dropout=0.0, attention_dropout=0.0)


@dataclass
class Check:
    name: str
    max_error: float
    tolerance: float

    @property
    def passed(self) -> bool:
        return self.max_error <= self.tolerance

    def as_dict(self) -> dict:
        return {**asdict(self), "passed": self.passed}


def rel_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual - expected| / max |expected| (float64)."""
    actual, expected = actual.double(), expected.double()
    return ((actual - expected).abs().max() / expected.abs().max().clamp_min(1e-30)).item()


def tiny_dims(tp: int) -> dict[str, int]:
    """Heads and width of the tiny models at `tp`: lcm(4, tp) heads of 16 (TINY's sizes at tp 1, 2, 4)."""
    heads = math.lcm(TINY.num_attention_heads, tp)
    return {"num_attention_heads": heads, "hidden_size": TINY.head_dim * heads}


def tiny_config(tp: int, **overrides) -> ModelConfig:
    """The tiny GPT of the tests, sized so that any `tp` splits it into whole heads."""
    return replace(TINY, **tiny_dims(tp), **overrides)


def full_grads(model: torch.nn.Module, tp_group) -> dict[str, torch.Tensor]:
    grads = {}
    for name, p in model.named_parameters():
        g = p.grad
        if is_tensor_parallel(p) and group_size(tp_group) > 1:
            g.partition_dim, g.partition_stride = p.partition_dim, getattr(p, "partition_stride", 1)
            g = gather_full(g, tp_group)
        grads[name] = g
    return grads


def max_grad_error(grads: dict[str, torch.Tensor], ref_grads: dict[str, torch.Tensor]) -> float:
    """Worst rel_error over every gradient. Vocab-indexed ones are compared on the reference's rows:
    the padded vocab can grow with tp (lcm(divisible_by, tp)), and rows past it get zero gradient."""
    return max(rel_error(grads[n][: len(ref)], ref) for n, ref in ref_grads.items())


def random_batch(cfg: ModelConfig, batch: int, device, seed: int = 7):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_length + 1), generator=gen)
    return ids[:, :-1].to(device), ids[:, 1:].to(device)


def check_equivalence(pg: ProcessGroups, dtype=torch.float32, device="cpu", batch=4) -> list[Check]:
    """Logits, loss and every gradient of TP x DP equal the serial model on the whole batch."""
    cfg, tol, tag = tiny_config(pg.tp_size), TOLERANCE[dtype], f"tp={pg.tp_size} dp={pg.dp_size} {str(dtype)[6:]}"
    ids, labels = random_batch(cfg, batch * pg.dp_size, device)
    serial = GPT(cfg, seed=42).to(device, dtype)
    ref_logits = serial(ids)
    serial.loss(ids, labels).mean().backward()
    ref_loss = serial.loss(ids, labels).mean().detach()
    model = GPT(cfg, pg.tp_group, seed=42).to(device, dtype)
    mine = slice(pg.dp_rank * batch, (pg.dp_rank + 1) * batch)
    logits = gather_from_tensor_parallel_region(model(ids[mine]), pg.tp_group)
    loss = model.loss(ids[mine], labels[mine]).mean()
    loss.backward()
    all_reduce_gradients(model.parameters(), pg.dp_group)
    loss = loss.detach().clone()
    if pg.dp_size > 1:
        dist.all_reduce(loss, group=pg.dp_group)
        loss /= pg.dp_size
    v = cfg.vocab_size
    grads, ref_grads = full_grads(model, pg.tp_group), {n: p.grad for n, p in serial.named_parameters()}
    padded_masked = bool(torch.isinf(logits[..., v:]).all()) if logits.shape[-1] > v else True
    return [
        Check(f"{tag}: logits", rel_error(logits[..., :v], ref_logits[mine][..., :v]), tol),
        Check(f"{tag}: padded vocab never predicted", 0.0 if padded_masked else 1.0, 0.0),
        Check(f"{tag}: loss", rel_error(loss, ref_loss), tol),
        Check(f"{tag}: every gradient", max_grad_error(grads, ref_grads), tol),
        Check(f"{tag}: global gradient norm (clipping)", rel_error(global_grad_norm(model.parameters(), pg.tp_group),
                                                                  global_grad_norm(serial.parameters())), tol),
    ]


def check_cross_entropy(pg: ProcessGroups, device="cpu") -> list[Check]:
    """Vocab-parallel CE equals F.cross_entropy, values and gradients, targets on shard edges."""
    tp, v = pg.tp_size, 1000
    padded = pad_vocab_size(v, 128, tp)  # 1024 at tp 1, 2, 4, 8
    per_rank = padded // tp
    gen = torch.Generator().manual_seed(3)
    full = torch.randn(2, 8, padded, generator=gen, dtype=torch.float64).to(device)
    full[..., v:] = float("-inf")
    edges = [0, v - 1] + [e for r in range(1, tp) for e in (r * per_rank - 1, r * per_rank) if e < v]
    target = torch.tensor(edges + [5] * (16 - len(edges)), device=device).view(2, 8)
    weights = torch.rand(2, 8, generator=gen, dtype=torch.float64).to(device)
    ref_in = full[..., :v].clone().requires_grad_(True)
    ref = F.cross_entropy(ref_in.reshape(-1, v), target.reshape(-1), reduction="none").view(2, 8)
    (ref * weights).sum().backward()
    ref_grad = torch.cat([ref_in.grad, torch.zeros(2, 8, padded - v, dtype=torch.float64, device=device)], -1)
    tol, checks = TOLERANCE[torch.float64], []
    for inplace in (False, True):
        tag = f"tp={tp} float64{' in place' if inplace else ''}"
        local = full.chunk(tp, dim=-1)[pg.tp_rank].clone().requires_grad_(True)
        loss = vocab_parallel_cross_entropy(local, target, pg.tp_group, inplace=inplace)
        (loss * weights).sum().backward()
        checks += [
            Check(f"{tag}: parallel cross-entropy loss", rel_error(loss, ref), tol),
            Check(f"{tag}: parallel cross-entropy grad", rel_error(local.grad, ref_grad.chunk(tp, -1)[pg.tp_rank]), tol),
        ]
    return checks


def check_collectives(pg: ProcessGroups, device="cpu", batch=2) -> list[Check]:
    """One forward+backward issues exactly the paper's all-reduces and no all-gather of logits."""
    cfg = tiny_config(pg.tp_size)
    model = GPT(cfg, pg.tp_group, seed=1).to(device)
    ids, labels = random_batch(cfg, batch, device)
    with count_collectives() as log:
        loss = model.loss(ids, labels).mean()
        log.phase = "backward"
        loss.backward()
    want = expected_tp_collectives(cfg.num_layers, batch, cfg.seq_length, cfg.hidden_size)
    mismatches = sum(log.counts(ph) != want[ph] for ph in ("forward", "backward"))
    gathers = sum(1 for _, op, _, _ in log.calls if "gather" in op)
    return [Check(f"tp={pg.tp_size}: collectives == 2L fwd + 2L bwd (+ embedding, CE)", float(mismatches), 0.0),
            Check(f"tp={pg.tp_size}: no all-gather of logits", float(gathers), 0.0)]


def _train_step_grads(model: GPT, ids, labels, seed: int, tracker_state) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    seed_default_generators(seed, ids.device)
    model.rng.set_state(tracker_state)
    model.loss(ids, labels).mean().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def check_dropout(pg: ProcessGroups, device="cpu") -> list[Check]:
    """Dropout under the paper's RNG scheme, and checkpointing replays it bit-identically."""
    tp, tag = pg.tp_size, f"tp={pg.tp_size}"
    device = torch.device(device)
    cfg = tiny_config(tp, hidden_dropout=0.1)
    ids, labels = random_batch(cfg, 2, device)
    serial = GPT(cfg, rng=RNGTracker(5, 0, device), seed=9).to(device).train()
    model = GPT(cfg, pg.tp_group, rng=RNGTracker(5, pg.tp_rank, device), seed=9).to(device).train()
    seed_default_generators(11, device)
    ref = serial(ids)
    seed_default_generators(11, device)
    out = gather_from_tensor_parallel_region(model(ids), pg.tp_group)
    checks = [Check(f"{tag}: hidden dropout, train mode == serial", rel_error(out[..., :1000], ref[..., :1000]), 1e-5)]
    cfg = tiny_config(tp, hidden_dropout=0.1, attention_dropout=0.1)
    model = GPT(cfg, pg.tp_group, rng=RNGTracker(5, pg.tp_rank, device), seed=9).to(device).train()
    h = model.hidden_states(ids).detach()
    spread = gather_from_tensor_parallel_region(h.unsqueeze(-1), pg.tp_group)
    checks.append(Check(f"{tag}: replicated activations identical on TP ranks", (spread - h.unsqueeze(-1)).abs().max().item(), 0.0))
    with model.rng.fork():
        draw = torch.rand(8, device=device).unsqueeze(-1)
    draws = gather_from_tensor_parallel_region(draw, pg.tp_group)
    distinct = tp == 1 or all(not torch.equal(draws[:, 0], draws[:, r]) for r in range(1, tp))
    checks.append(Check(f"{tag}: TP-region dropout differs per TP rank", 0.0 if distinct else 1.0, 0.0))
    state = model.rng.get_state()
    plain = _train_step_grads(model, ids, labels, 13, state)
    model.cfg.activation_checkpointing = True
    recomputed = _train_step_grads(model, ids, labels, 13, state)
    model.cfg.activation_checkpointing = False
    diff = max((plain[n] - recomputed[n]).abs().max().item() for n in plain)
    checks.append(Check(f"{tag}: checkpointing gives bit-identical gradients", diff, 0.0))
    return checks


def check_huggingface(device="cpu") -> list[Check]:
    """The serial model's logits equal transformers.GPT2LMHeadModel's on the same weights."""
    from repro.models.hf import to_hf_gpt2

    cfg = TINY
    model = GPT(cfg, seed=21).to(device).eval()
    hf = to_hf_gpt2(model).to(device).eval()
    ids, _ = random_batch(cfg, 2, device)
    with torch.no_grad():
        ours, theirs = model(ids)[..., : cfg.vocab_size], hf(ids).logits
    return [Check("tp=1: logits == transformers.GPT2LMHeadModel", rel_error(ours, theirs), 1e-5)]


def run_all(layouts: list[tuple[int, int]], device="cpu", include_hf=True) -> list[dict]:
    """Every check for each (tp, dp) layout of the current world; rows as dicts."""
    rows: list[Check] = []
    for tp, dp in layouts:
        pg = build_process_groups(ParallelDims(tp, dp))
        for dtype in (torch.float32, torch.float64):
            rows += check_equivalence(pg, dtype, device)
        if dp == 1:
            rows += check_cross_entropy(pg, device) + check_dropout(pg, device)
            if tp > 1:
                rows += check_collectives(pg, device)
    if include_hf and dist.get_rank() == 0:
        rows += check_huggingface(device)
    return [r.as_dict() for r in rows]
