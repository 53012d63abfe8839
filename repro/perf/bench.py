"""`repro bench` (CPU): our GPT against Hugging Face GPT-2, TP=2 communication, memory per rank.

    repro bench --out results/bench             # about 2-4 minutes on 2 cores

a. step time (forward, backward, AdamW) of this project's GPT at TP=1 and of
   transformers.GPT2LMHeadModel at the identical configuration, threads and dtype, interleaved
   round by round (alternating which goes first), medians and the ratio HF / ours;
b. TP=2 collectives and bytes of one forward+backward, intercepted, against the paper's count;
c. parameters, gradients and Adam state per rank at TP=1/2 (and ZeRO-1/2 at DP=2 through
   DeepSpeed on gloo), measured against repro.perf.memory's analytic numbers.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from repro.models.config import ModelConfig
from repro.perf.gpu_bench import _finite, _median, provenance, write_atomic
from repro.perf.memory import memory_per_rank


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
    med = {n: {k: _median([t[k] for t in ts]) for k in ts[0]} for n, ts in times.items()}
    return {"config": asdict(cfg), "batch": st.batch, "threads": st.threads, "dtype": "fp32",
            "rounds": st.rounds, "median_s": med,
            "ratio_hf_over_ours": {k: med["hf"][k] / med["ours"][k] for k in med["ours"]}}


def _tp_rank(cfg_dict: dict, batch: int, zero_stage: int, tp: int) -> dict:
    """One rank: collectives of one fwd+bwd (tp > 1) and bytes of params, grads, Adam state."""
    import torch.distributed as dist

    from repro.models.gpt import GPT
    from repro.parallel.accounting import count_collectives
    from repro.parallel.groups import ParallelDims, build_process_groups

    pg = build_process_groups(ParallelDims.from_world(tp, dist.get_world_size()))
    cfg = ModelConfig(**cfg_dict)
    model = GPT(cfg, pg.tp_group).train()
    ids = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_length), generator=torch.Generator().manual_seed(0))
    if zero_stage:
        return _zero_memory(model, pg, ids, zero_stage)
    with count_collectives() as log:
        loss = model.loss(ids, ids).mean()
        log.phase = "backward"
        loss.backward()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    grads = _nbytes(p.grad for p in model.parameters() if p.grad is not None)
    opt.step()
    return {"calls": [list(c) for c in log.calls], "params": _nbytes(model.parameters()), "grads": grads,
            "optimizer": _nbytes(v for st in opt.state.values() for k, v in st.items() if k != "step")}


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _zero_memory(model, pg, ids, stage: int) -> dict:
    """Bytes per rank under DeepSpeed ZeRO-`stage` (fp32), after one step."""
    import deepspeed

    config = {"train_micro_batch_size_per_gpu": ids.shape[0], "train_batch_size": ids.shape[0] * pg.dp_size,
              "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True,
              "steps_per_print": 10**9}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    engine, zopt, _, _ = deepspeed.initialize(model=model, optimizer=opt, mpu=pg, config=config,
                                              dist_init_required=False)
    loss = engine(ids, ids).mean()
    engine.backward(loss)
    grads = _zero_grad_bytes(model, zopt)
    engine.step()
    state = _nbytes(v for s in zopt.optimizer.state.values() for k, v in s.items() if k != "step")
    master = _nbytes(getattr(zopt, "single_partition_of_fp32_groups", []))
    return {"params": _nbytes(model.parameters()), "grads_after_backward": grads, "optimizer": state + master}


def _zero_grad_bytes(model, zopt) -> int:
    """Bytes of every distinct gradient storage DeepSpeed holds after backward (p.grad, p.grad_accum,
    ZeRO-2's partition buffers), each storage counted once; communication buckets excluded."""
    found = [t for p in model.parameters() for t in (p.grad, getattr(p, "grad_accum", None))]
    for name in ("grads_in_partition", "averaged_gradients"):
        held = getattr(zopt, name, None)
        held = held.values() if isinstance(held, dict) else (held if isinstance(held, list) else [held])
        for item in held:
            found += item if isinstance(item, (list, tuple)) else [item]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in found if isinstance(t, torch.Tensor)}
    return sum(storages.values())


def _compare_comm(per_rank: list[dict], cfg: ModelConfig, batch: int) -> dict:
    """Intercepted TP=2 collectives per phase against expected_tp_collectives, exactly."""
    from repro.parallel.accounting import expected_tp_collectives

    want = expected_tp_collectives(cfg.num_layers, batch, cfg.seq_length, cfg.hidden_size)
    calls = per_rank[0]["calls"]
    out = {"equal_on_every_rank": True, "phases": {}}
    for phase in ("forward", "backward"):
        got = {}
        for ph, op, n, _ in calls:
            if ph == phase:
                got[(op, n)] = got.get((op, n), 0) + 1
        for rank in per_rank:
            mine = {}
            for ph, op, n, _ in rank["calls"]:
                if ph == phase:
                    mine[(op, n)] = mine.get((op, n), 0) + 1
            out["equal_on_every_rank"] &= mine == dict(want[phase])
        out["phases"][phase] = {
            "measured": [{"op": op, "elements": n, "calls": c} for (op, n), c in sorted(got.items())],
            "analytic": [{"op": op, "elements": n, "calls": c} for (op, n), c in sorted(want[phase].items())],
            "measured_bytes": sum(b for ph, _, _, b in calls if ph == phase),
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
    return [_memory_row(f"ZeRO-{stage} DP=2 rank {r}", {**m, "grads": m["grads_after_backward"]}, want)
            for r, m in enumerate(got)]


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
    lines = ["\n## c. Bytes per rank (fp32 Adam): measured vs analytic\n",
             "| layout | params | analytic | grads | analytic | optimizer | analytic |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['layout']} | not measured: {r['error'][:80]} | {r['analytic_params']} | | "
                         f"{r['analytic_grads']} | | {r['analytic_optimizer']} |")
            continue
        lines.append(f"| {r['layout']} | {r['measured_params']} | {r['analytic_params']} | {r['measured_grads']} | "
                     f"{r['analytic_grads']} | {r['measured_optimizer']} | {r['analytic_optimizer']} |")
    lines.append("\nParameters and Adam state (ZeRO: fp32 partition + m + v) are measured exactly. The ZeRO "
                 "gradient column counts every distinct storage DeepSpeed 0.19.8 holds after backward (p.grad, "
                 "p.grad_accum, grads_in_partition, averaged_gradients); it does not match the analytic ZeRO "
                 "numbers and differs between ranks - not yet explained (flat buffers larger than the partition "
                 "are suspected), so read it as an upper bound, not a check.")
    return lines


def run_bench(out: Path, st: BenchSettings, argv: list[str]) -> dict:
    """Run parts a-c, write out/{hf_compare,tp_comm,memory}.json, out/bench_cpu.json and out/bench_cpu.md."""
    out.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    prov = provenance(torch.device("cpu"), argv, prog="repro")
    a = bench_vs_hf(st)
    b, c = bench_comm_and_memory(st)
    report = {"provenance": prov, "settings": asdict(st), "elapsed_s": time.monotonic() - start,
              "hf_compare": a, "tp_comm": b, "memory": c}
    for name, part in (("hf_compare", a), ("tp_comm", b), ("memory", c)):
        write_atomic(out / f"{name}.json", json.dumps(_finite({"provenance": prov, name: part}), indent=2))
    write_atomic(out / "bench_cpu.json", json.dumps(_finite(report), indent=2))
    head = [f"# repro bench (CPU)\n", f"Machine {prov['device']} ({prov['host']}); torch {prov['torch']}; "
            f"{prov['date_utc']}; git {prov['git_sha']}; `{prov['command']}`; {report['elapsed_s']:.0f} s.\n"]
    write_atomic(out / "bench_cpu.md", "\n".join(head + _md_hf(a) + _md_comm(b) + _md_memory(c)) + "\n")
    return report
