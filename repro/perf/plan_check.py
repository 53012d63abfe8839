"""Check `repro plan`'s memory model against measured peaks; writes results/plan/memory_check.{json,md}.

    python -m repro.perf.plan_check --out results/plan          # CPU: about 2 minutes on 2 cores

CPU: the trainer itself (engine build and two steps of a 4-layer h=128 GPT on random tokens), for
every precision recipe, attention kernel and checkpointing setting, with gradient accumulation, at
TP=2, at DP=2 (torch DDP, and DeepSpeed ZeRO-1/2, whose 5e8-element reduce bucket dominates there;
bf16 ZeRO-1 summing in fp32 runs on DeepSpeed's BF16_Optimizer, which has none), an 8-layer h=256
half model whose waiting half gradients show, and of the same-size BERT on random padded batches;
the peak is c10's running total of CPU allocations at the allocations and frees torch.profiler
records, frees on gloo's threads included (repro.perf.activations.peak_bytes_during). CUDA: the
peaks `repro.perf.gpu_bench` measured with
torch.cuda.max_memory_allocated (a results JSON given with --gpu-json), against the plan for the
same configuration. On CPU a dropout mask has its input's dtype and attention dropout selects the
math SDPA kernel; the plan is told the device, so each side is modelled as it runs.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from repro.provenance import OutDirError, git_sha, make_out_dir, write_atomic

EXPERIMENTS = Path(__file__).resolve().parents[2] / "experiments"
CONFIGS = {"gpt": EXPERIMENTS / "tiny" / "gpt_tiny.yaml", "bert": EXPERIMENTS / "bert" / "tiny_cpu.yaml"}
RECIPES = {
    "fp32": {"precision.precision": "fp32"},
    "bf16 autocast": {"precision.precision": "bf16"},
    "bf16 half, fp32 main grads": {"precision.precision": "bf16", "precision.params": "half"},
    "bf16 half, bf16 grads": {"precision.precision": "bf16", "precision.params": "half", "precision.main_grads": "param"},
}


# a model whose parameters outweigh its checkpointed activations: DDP's gradient copy would show
DDP_STATE = {**RECIPES["fp32"], "model.attention_dropout": 0.0, "model.activation_checkpointing": "true",
                 "model.num_layers": 8, "model.hidden_size": 256}


def overrides(extra: dict, global_batch: int) -> list[str]:
    """The 4-layer h=128 CPU model with micro batch 4 and `extra` settings."""
    base = {"model.num_layers": 4, "model.hidden_size": 128, "model.num_attention_heads": 4,
            "model.seq_length": 128, "model.vocab_size": 1000, "model.make_vocab_size_divisible_by": 128,
            "train.micro_batch_size": 4,
            "train.global_batch_size": global_batch, "train.device": "cpu", "tracking.enabled": "false"}
    return [f"{k}={v}" for k, v in {**base, **extra}.items()]


def _micro_batches(cfg, accum: int) -> list:
    """`accum` random micro batches of the family's layout (BERT's with padding and ~20% predicted)."""
    if cfg.family == "bert":
        from repro.models.bert import as_bert_config
        from repro.models.bert_checks import random_bert_batch

        return [random_bert_batch(as_bert_config(cfg.model), 4, seed=i) for i in range(accum)]
    gen = torch.Generator().manual_seed(0)
    return [tuple(torch.randint(0, 1000, (4, 128), generator=gen) for _ in range(2)) for _ in range(accum)]


def measured_and_planned(extra: dict, accum: int = 1, world: int = 1, family: str = "gpt") -> tuple[int, int]:
    """(measured peak, planned peak) in bytes on this rank: engine build and two training steps."""
    from repro.parallel.groups import ParallelDims, ProcessGroups, build_process_groups
    from repro.parallel.half_gemm import native_half_gemm
    from repro.perf.activations import peak_bytes_during
    from repro.perf.plan import memory_plan
    from repro.train.config import derive, load_config
    from repro.train.engine import build_engine
    from repro.train.step import train_step

    dp = world // int(extra.get("parallel.tp", 1))
    cfg = load_config(CONFIGS[family], overrides(extra, 4 * accum * dp))
    derived = derive(cfg, world)
    pg = ProcessGroups.single() if world == 1 else build_process_groups(ParallelDims.from_world(cfg.parallel.tp, world))
    batches = _micro_batches(cfg, accum)

    def run():
        eng = build_engine(cfg, derived, pg)
        for _ in range(2):
            train_step(eng, batches)

    with native_half_gemm():  # a GPU's allocations, not the fp32 copies of a CPU without half kernels
        _, peak = peak_bytes_during(run)
    return peak, memory_plan(cfg, derived, "cpu").peak


def two_rank_case(extra: dict, accum: int = 1) -> tuple[int, int]:
    """measured_and_planned on each of 2 ranks (for repro.parallel.spawn.run_ranks)."""
    return measured_and_planned(extra, accum, world=2)


def cpu_cases() -> list[tuple[str, dict, int, int, str]]:
    """(name, settings, accumulation steps, ranks, family) of every CPU check."""
    cases = []
    for recipe, settings in RECIPES.items():
        for dropout, kernel in ((0.0, "fused attention"), (0.1, "math attention")):
            for ckpt in (False, True):
                name = f"{recipe}, {kernel}, checkpointing {'on' if ckpt else 'off'}"
                cases.append((name, {**settings, "model.attention_dropout": dropout,
                                     "model.activation_checkpointing": str(ckpt).lower()}, 1, 1, "gpt"))
    fused = {"model.attention_dropout": 0.0}
    cases += [("fp32, 2 accumulation steps", {**RECIPES["fp32"], **fused}, 2, 1, "gpt"),
              ("bf16 half, bf16 grads, 2 accumulation steps", {**RECIPES["bf16 half, bf16 grads"], **fused}, 2, 1, "gpt"),
              ("fp32, TP=2 (per rank)", {**RECIPES["fp32"], **fused, "parallel.tp": 2}, 1, 2, "gpt"),
              ("bf16 half, bf16 grads, DP=2 with torch DDP (per rank)", {**RECIPES["bf16 half, bf16 grads"], **fused},
               1, 2, "gpt"),
              ("fp32, checkpointing on, 8 layers h=256 (weights, gradients and Adam's state outweigh the "
               "activations), DP=2 with torch DDP (per rank)", DDP_STATE, 1, 2, "gpt"),
              ("the same with 2 accumulation steps (no_sync gradients beside the buckets), DP=2 (per rank)",
               DDP_STATE, 2, 2, "gpt"),
              ("bf16 half, fp32 main grads, checkpointing on, 8 layers h=256 (half gradients waiting in "
               "MainGrads' bucket)", {**DDP_STATE, **RECIPES["bf16 half, fp32 main grads"]}, 1, 1, "gpt"),
              ("bf16, DeepSpeed ZeRO-1, DP=2 (per rank)",
               {**RECIPES["bf16 autocast"], **fused, "train.zero_stage": 1}, 1, 2, "gpt"),
              ("fp32, DeepSpeed ZeRO-2, DP=2 (per rank)", {**RECIPES["fp32"], **fused, "train.zero_stage": 2}, 1, 2, "gpt")]
    for recipe in ("fp32", "bf16 autocast", "bf16 half, fp32 main grads"):
        for ckpt in (False, True):
            cases.append((f"BERT, {recipe}, fused attention, checkpointing {'on' if ckpt else 'off'}",
                          {**RECIPES[recipe], **fused, "model.activation_checkpointing": str(ckpt).lower()}, 1, 1, "bert"))
    return cases


def run_cpu_checks() -> list[dict]:
    from tqdm import tqdm

    from repro.parallel.spawn import run_ranks

    rows = []
    for name, settings, accum, world, family in tqdm(cpu_cases(), desc="memory checks", unit="case"):
        pairs = ([measured_and_planned(settings, accum, family=family)] if world == 1
                 else run_ranks(two_rank_case, 2, settings, accum))
        for rank, (measured, planned) in enumerate(pairs):
            rows.append({"device": "cpu", "case": name + (f", rank {rank}" if world > 1 else ""),
                         "measured_mib": measured / 2**20, "planned_mib": planned / 2**20,
                         "error": planned / measured - 1})
    return rows


def gpu_rows(path: Path) -> list[dict]:
    """The plan against a gpu_bench results JSON's measured peaks (eager configurations)."""
    from repro.models.config import ModelConfig
    from repro.perf.gpu_bench import RunSpec, planned_memory_gib

    report = json.loads(path.read_text())
    cfg = ModelConfig(**report["config"])
    rows = []
    for r in report["results"]:
        spec = RunSpec(**r["spec"])
        if r["status"] != "ok" or spec.compile or r.get("peak_memory_gib") is None:
            continue
        planned = planned_memory_gib(cfg, spec, "cuda")
        rows.append({"device": report["provenance"]["device"],
                     "case": f"{report['model']}: {spec.dtype}, params {spec.params}, checkpointing "
                             f"{'on' if spec.checkpointing else 'off'}, batch {spec.batch} ({path})",
                     "measured_mib": r["peak_memory_gib"] * 1024, "planned_mib": planned * 1024,
                     "error": planned / r["peak_memory_gib"] - 1})
    return rows


def markdown(rows: list[dict], provenance: dict) -> str:
    lines = ["# `repro plan`'s memory model against measured peaks\n",
             f"Measured on {provenance['host']} ({provenance['cpu']}), torch {provenance['torch']}, "
             f"{provenance['date_utc']}, git {provenance['git_sha']}; command `{provenance['command']}`. "
             "CUDA rows come from the gpu_bench JSON named in the row (its own provenance). Error = planned / "
             "measured - 1; the plan aims at 2% below to 3% above a measured peak (CUDA-side buffers it does "
             "not count are left to its headroom).\n",
             "| device | case | measured MiB | planned MiB | error |", "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['device']} | {r['case']} | {r['measured_mib']:.2f} | {r['planned_mib']:.2f} | "
                     f"{r['error']:+.2%} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    import datetime
    import platform

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("results/plan"))
    parser.add_argument("--gpu-json", type=Path, action="append", default=[],
                        help="a repro.perf.gpu_bench results JSON to compare with (repeatable)")
    args = parser.parse_args(argv)
    for path in args.gpu_json:  # before the CPU checks' minutes, not after
        if not path.is_file():
            parser.error(f"--gpu-json {path}: no such file (a gpu_bench bench.json, e.g. "
                         "results/bench/gpu_h200_2026-12-04/eager/bench.json)")
    try:
        make_out_dir(args.out, "results/plan")
    except OutDirError as err:
        parser.error(str(err))
    rows = run_cpu_checks() + [row for path in args.gpu_json for row in gpu_rows(path)]
    provenance = {"host": platform.node(), "cpu": platform.processor() or platform.machine(),
                  "torch": torch.__version__, "git_sha": git_sha(),
                  "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                  "command": " ".join(["python -m repro.perf.plan_check", *(argv if argv is not None else sys.argv[1:])])}
    write_atomic(args.out / "memory_check.json", json.dumps({"provenance": provenance, "rows": rows}, indent=2).encode())
    md = markdown(rows, provenance)
    write_atomic(args.out / "memory_check.md", md.encode())
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
