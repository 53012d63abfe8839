"""`repro bench` (CPU): our GPT against Hugging Face GPT-2, TP=2 communication, memory per rank.

    repro bench --out results/bench             # about 2-4 minutes on 2 cores

a. step time (forward, backward, AdamW) of this project's GPT at TP=1 and of
   transformers.GPT2LMHeadModel at the identical configuration, threads and dtype, interleaved
   round by round (alternating which goes first), medians and the ratio HF / ours;
b. TP=2 collectives and bytes of one forward+backward, intercepted, against the paper's count;
c. parameters, gradients and Adam state per rank at TP=1/2 (and ZeRO-1/2 at DP=2 through
   DeepSpeed on gloo), measured against repro.perf.memory's analytic numbers, and DeepSpeed's
   gradient buffers through one ZeRO step against zero_grad_lifecycle's formulas
   (repro.perf.bench_zero);
d. the trainer's optimizer step (fused AdamW, the clip folded in) against foreach AdamW after a clip
   pass, interleaved, and the ratio.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from repro.models.config import ModelConfig
from repro.perf.bench_zero import md_zero_grads, nbytes, param_numels, zero_grad_lifecycle, zero_memory
from repro.perf.memory import memory_per_rank
from repro.provenance import finite_json, measurement_provenance, write_atomic


@dataclass
class BenchSettings:
    """Model size and repetitions of the CPU benchmark."""

    num_layers: int = 4
    hidden_size: int = 256
    num_attention_heads: int = 8
    seq_length: int = 128
    vocab_size: int = 50304  # GPT-2's 50,257 rounded to a multiple of 128: no padding on either side
    batch: int = 8
    rounds: int = 8
    warmup: int = 2
    threads: int = 1
    zero: bool = True

    def model_config(self, dropout: float = 0.1) -> ModelConfig:
        return ModelConfig(num_layers=self.num_layers, hidden_size=self.hidden_size,
                           num_attention_heads=self.num_attention_heads, seq_length=self.seq_length,
                           vocab_size=self.vocab_size, make_vocab_size_divisible_by=128,
                           hidden_dropout=dropout, attention_dropout=dropout)


def _step(loss_fn, opt) -> dict[str, float]:
    t0 = time.perf_counter()
    loss = loss_fn()
    t1 = time.perf_counter()
    loss.backward()
    t2 = time.perf_counter()
    opt.step()
    opt.zero_grad(set_to_none=True)
    t3 = time.perf_counter()
    return {"forward": t1 - t0, "backward": t2 - t1, "optimizer": t3 - t2, "step": t3 - t0}


def _contestants(cfg: ModelConfig, ids: torch.Tensor) -> dict:
    """name -> (loss closure, optimizer) for our GPT and HF's GPT2LMHeadModel on the same weights."""
    from repro.models.gpt import GPT
    from repro.models.hf import to_hf_gpt2

    ours = GPT(cfg).train()
    hf = to_hf_gpt2(ours).train()
    hf.config._attn_implementation = "sdpa"  # both use scaled_dot_product_attention
    return {
        "ours": (lambda: ours.loss(ids, ids).mean(), torch.optim.AdamW(ours.parameters(), lr=1e-5)),
        "hf": (lambda: hf(input_ids=ids, labels=ids).loss, torch.optim.AdamW(hf.parameters(), lr=1e-5)),
    }


def bench_vs_hf(st: BenchSettings) -> dict:
    """Interleaved step times of our GPT and HF GPT-2; ratio > 1 means ours is faster."""
    torch.set_num_threads(st.threads)
    cfg = st.model_config()
    ids = torch.randint(0, cfg.vocab_size, (st.batch, cfg.seq_length), generator=torch.Generator().manual_seed(0))
    runs = _contestants(cfg, ids)
    times: dict[str, list[dict]] = {name: [] for name in runs}
    for r in range(st.warmup + st.rounds):
        for name in (["ours", "hf"] if r % 2 == 0 else ["hf", "ours"]):
            timing = _step(*runs[name])
            if r >= st.warmup:
                times[name].append(timing)
    med = {n: {k: statistics.median([t[k] for t in ts]) for k in ts[0]} for n, ts in times.items()}
    return {"config": asdict(cfg), "batch": st.batch, "threads": st.threads, "dtype": "fp32",
            "rounds": st.rounds, "median_s": med,
            "ratio_hf_over_ours": {k: med["hf"][k] / med["ours"][k] for k in med["ours"]}}


def bench_optimizer_step(st: BenchSettings) -> dict:
    """The trainer's optimizer step (torch's fused AdamW, the clip folded into it: `clip_and_step`)
    against torch's default foreach AdamW after a separate clip pass, interleaved round by round on two
    copies of this GPT holding the same gradients; ratio > 1 means the fused step is faster."""
    from repro.models.gpt import GPT
    from repro.train.config import OptimConfig
    from repro.train.optim import build_optimizer, clip_and_step

    torch.set_num_threads(st.threads)
    runs = {}
    for name in ("fused", "foreach"):
        model = GPT(st.model_config(), seed=0)
        gen = torch.Generator().manual_seed(1)
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=gen)
        runs[name] = (list(model.parameters()), build_optimizer(model, OptimConfig(fused=name == "fused")))
    times: dict[str, list[float]] = {name: [] for name in runs}
    for r in range(st.warmup + st.rounds):
        for name in (["fused", "foreach"] if r % 2 == 0 else ["foreach", "fused"]):
            t0 = time.perf_counter()
            clip_and_step(runs[name][1], runs[name][0], clip=1.0)
            if r >= st.warmup:
                times[name].append(time.perf_counter() - t0)
    med = {name: statistics.median(ts) for name, ts in times.items()}
    return {"parameters": sum(p.numel() for p in runs["fused"][0]), "threads": st.threads, "rounds": st.rounds,
            "median_s": med, "ratio_foreach_over_fused": med["foreach"] / med["fused"]}


def _half_recipe_memory(model, ids) -> dict:
    """Bytes of the trainer's half recipe: bf16 model, fp32 main grads, fp32 masters + Adam state."""
    from repro.train.main_grads import MainGrads
    from repro.train.mixed_precision import MasterWeights

    masters = MasterWeights(model, torch.bfloat16)
    main = MainGrads(masters.pairs())
    model.loss(ids, ids).mean().backward()
    opt = torch.optim.AdamW(main.finish(), lr=1e-5)
    opt.step()
    state = [v for st in opt.state.values() for k, v in st.items() if k != "step"]
    return {"params": nbytes(model.parameters()), "grads": nbytes(b.flat for b in main.buckets),
            "optimizer": nbytes(masters.parameters()) + nbytes(state),
            "model_grads_left": sum(p.grad is not None for p in model.parameters())}


def _tp_rank(cfg_dict: dict, batch: int, zero_stage: int, tp: int, half: bool = False) -> dict:
    """One rank: collectives of one fwd+bwd (tp > 1) and bytes of params, grads, Adam state
    (`half`: those of the trainer's bf16 recipe instead)."""
    import torch.distributed as dist

    from repro.models.gpt import GPT
    from repro.parallel.accounting import count_collectives
    from repro.parallel.groups import ParallelDims, build_process_groups

    pg = build_process_groups(ParallelDims.from_world(tp, dist.get_world_size()))
    cfg = ModelConfig(**cfg_dict)
    model = GPT(cfg, pg.tp_group).train()
    ids = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_length), generator=torch.Generator().manual_seed(0))
    if zero_stage:
        return zero_memory(model, pg, ids, zero_stage)
    if half:
        return _half_recipe_memory(model, ids)
    with count_collectives() as log:
        loss = model.loss(ids, ids).mean()
        log.phase = "backward"
        loss.backward()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    grads = nbytes(p.grad for p in model.parameters() if p.grad is not None)
    opt.step()
    return {"calls": [list(c) for c in log.calls], "params": nbytes(model.parameters()), "grads": grads,
            "optimizer": nbytes(v for st in opt.state.values() for k, v in st.items() if k != "step")}


def _compare_comm(per_rank: list[dict], cfg: ModelConfig, batch: int) -> dict:
    """Intercepted TP=2 collectives per phase against expected_tp_collectives, exactly."""
    from repro.parallel.accounting import CollectiveLog, expected_tp_collectives

    want = expected_tp_collectives(cfg.num_layers, batch, cfg.seq_length, cfg.hidden_size)
    logs = [CollectiveLog(calls=[tuple(call) for call in rank["calls"]]) for rank in per_rank]
    out = {"equal_on_every_rank": True, "phases": {}}
    for phase in ("forward", "backward"):
        out["equal_on_every_rank"] &= all(log.counts(phase) == want[phase] for log in logs)
        out["phases"][phase] = {
            "measured": [{"op": op, "elements": n, "calls": c} for (op, n), c in sorted(logs[0].counts(phase).items())],
            "analytic": [{"op": op, "elements": n, "calls": c} for (op, n), c in sorted(want[phase].items())],
            "measured_bytes": logs[0].total_bytes(phase),
            "analytic_bytes": sum(4 * n * c for (_, n), c in want[phase].items()),  # fp32
        }
    return out


def bench_comm_and_memory(st: BenchSettings) -> tuple[dict, list[dict]]:
    """Parts b and c: TP=2 collectives, then memory per rank at TP=1, TP=2 and ZeRO-1/2 at DP=2."""
    from repro.parallel.spawn import run_ranks

    cfg = st.model_config(dropout=0.0)
    cfg_dict = asdict(cfg)
    tp1 = run_ranks(_tp_rank, 1, cfg_dict, st.batch, 0, 1)
    tp2 = run_ranks(_tp_rank, 2, cfg_dict, st.batch, 0, 2)
    comm = _compare_comm(tp2, cfg, st.batch)
    rows = [_memory_row("TP=1", tp1[0], memory_per_rank(cfg, 1)),
            *[_memory_row(f"TP=2 rank {r}", m, memory_per_rank(cfg, 2)) for r, m in enumerate(tp2)]]
    for tp in (1, 2):
        half = run_ranks(_tp_rank, tp, cfg_dict, st.batch, 0, tp, True)
        want = memory_per_rank(cfg, tp, precision="bf16", fp32_main_grads=True)
        rows += [_memory_row(f"TP={tp}{f' rank {r}' if tp > 1 else ''} bf16 model, fp32 main grads", m, want)
                 for r, m in enumerate(half)]
    for stage in ((1, 2) if st.zero else ()):
        rows += _zero_rows(cfg_dict, cfg, st.batch, stage)
    return comm, rows


def _zero_rows(cfg_dict, cfg, batch, stage) -> list[dict]:
    from repro.parallel.spawn import run_ranks

    want = memory_per_rank(cfg, 1, 2, stage, "fp32")
    try:
        got = run_ranks(_tp_rank, 2, cfg_dict, batch, stage, 1, timeout=240)
    except (RuntimeError, TimeoutError) as err:
        return [{"layout": f"ZeRO-{stage} DP=2", "error": str(err)[-300:], **_analytic(want)}]
    numels = param_numels(cfg)
    return [{**_memory_row(f"ZeRO-{stage} DP=2 rank {r}", m, want), "grad_lifecycle": m["grad_lifecycle"],
             "grad_lifecycle_formula": zero_grad_lifecycle(numels, 2, r, m["deepspeed"]["reduce_bucket_size"]),
             "deepspeed": m["deepspeed"]} for r, m in enumerate(got)]


def _analytic(want) -> dict:
    return {"analytic_params": want.params, "analytic_grads": want.grads, "analytic_optimizer": want.optimizer}


def _memory_row(layout: str, got: dict, want) -> dict:
    row = {"layout": layout, **_analytic(want)}
    for key in ("params", "grads", "optimizer"):
        row[f"measured_{key}"] = got[key]
        row[f"rel_error_{key}"] = got[key] / row[f"analytic_{key}"] - 1
    return row


def _md_hf(a: dict) -> list[str]:
    lines = ["## a. Step time: this GPT (TP=1) vs transformers.GPT2LMHeadModel\n",
             f"fp32, {a['threads']} thread(s), batch {a['batch']}, config {_shape(a['config'])}, "
             f"median of {a['rounds']} interleaved rounds.\n",
             "| phase | ours s | HF s | HF / ours |", "|---|---|---|---|"]
    for k in ("forward", "backward", "optimizer", "step"):
        lines.append(f"| {k} | {a['median_s']['ours'][k]:.4f} | {a['median_s']['hf'][k]:.4f} | "
                     f"{a['ratio_hf_over_ours'][k]:.2f} |")
    return lines


def _md_optimizer(d: dict) -> list[str]:
    return ["\n## d. Optimizer step: fused AdamW with the clip folded in (the trainer's) vs foreach AdamW\n",
            f"fp32 AdamW and clipping to norm 1.0 over this GPT's {d['parameters']:,} parameters, {d['threads']} "
            f"thread(s), median of {d['rounds']} interleaved rounds.\n",
            "| step | seconds |", "|---|---|",
            f"| fused AdamW, clip as its gradient divisor (`optim.fused: true`, the default) | {d['median_s']['fused']:.4f} |",
            f"| foreach AdamW after a foreach clip pass (`optim.fused: false`) | {d['median_s']['foreach']:.4f} |",
            f"\nforeach / fused: **{d['ratio_foreach_over_fused']:.2f}x**."]


def _shape(c: dict) -> str:
    return f"l={c['num_layers']} h={c['hidden_size']} heads={c['num_attention_heads']} s={c['seq_length']} V={c['vocab_size']}"


def _md_comm(b: dict) -> list[str]:
    lines = ["\n## b. TP=2 collectives of one forward+backward (fp32) vs the paper's count\n",
             f"Exactly equal on every rank: **{b['equal_on_every_rank']}**.\n",
             "| phase | op | elements | measured calls | analytic calls | measured bytes | analytic bytes |",
             "|---|---|---|---|---|---|---|"]
    for phase, d in b["phases"].items():
        want = {(x["op"], x["elements"]): x["calls"] for x in d["analytic"]}
        for x in d["measured"]:
            lines.append(f"| {phase} | {x['op']} | {x['elements']} | {x['calls']} | "
                         f"{want.get((x['op'], x['elements']), 0)} | {d['measured_bytes']} | {d['analytic_bytes']} |")
    return lines


def _md_memory(rows: list[dict]) -> list[str]:
    lines = ["\n## c. Bytes per rank (Adam): measured vs analytic\n",
             "| layout | params | analytic | grads | analytic | optimizer | analytic |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['layout']} | not measured: {r['error'][:80]} | {r['analytic_params']} | | "
                         f"{r['analytic_grads']} | | {r['analytic_optimizer']} |")
            continue
        lines.append(f"| {r['layout']} | {r['measured_params']} | {r['analytic_params']} | {r['measured_grads']} | "
                     f"{r['analytic_grads']} | {r['measured_optimizer']} | {r['analytic_optimizer']} |")
    lines.append("\nParameters, gradients and Adam state (ZeRO: fp32 partition + m + v) per rank, all measured "
                 "exactly. fp32 Adam unless the layout names the trainer's half recipe (precision.params: half): "
                 "a bf16 model (2 bytes/parameter), fp32 main grads (4) and fp32 masters + m + v (12), 18 bytes "
                 "against the 16 of ZeRO's accounting with half gradients. The ZeRO gradient column is what the stage keeps for its step: ZeRO-1 does not "
                 "partition gradients, so a rank holds all of them (p.grad) until DeepSpeed reduces them at the "
                 "accumulation boundary after backward - measured when that reduction starts; ZeRO-2 keeps only "
                 "its reduced share - measured as the fp32 gradient partition DeepSpeed hands to the inner AdamW.")
    return lines + md_zero_grads([r for r in rows if "grad_lifecycle" in r])


def run_bench(out: Path, st: BenchSettings, argv: list[str]) -> dict:
    """Run parts a-d, write out/{hf_compare,tp_comm,memory,optimizer_step}.json, out/bench_cpu.json and out/bench_cpu.md."""
    out.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    prov = measurement_provenance(torch.device("cpu"), argv, prog="repro")
    a = bench_vs_hf(st)
    b, c = bench_comm_and_memory(st)
    d = bench_optimizer_step(st)
    report = {"provenance": prov, "settings": asdict(st), "elapsed_s": time.monotonic() - start,
              "hf_compare": a, "tp_comm": b, "memory": c, "optimizer_step": d}
    for name, part in (("hf_compare", a), ("tp_comm", b), ("memory", c), ("optimizer_step", d)):
        write_atomic(out / f"{name}.json", json.dumps(finite_json({"provenance": prov, name: part}), indent=2))
    write_atomic(out / "bench_cpu.json", json.dumps(finite_json(report), indent=2))
    head = ["# repro bench (CPU)\n", f"Machine {prov['device']} ({prov['host']}); torch {prov['torch']}; "
            f"{prov['date_utc']}; git {prov['git_sha']}; `{prov['command']}`; {report['elapsed_s']:.0f} s.\n"]
    write_atomic(out / "bench_cpu.md", "\n".join(head + _md_hf(a) + _md_comm(b) + _md_memory(c) + _md_optimizer(d)) + "\n")
    return report
