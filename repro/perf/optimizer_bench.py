"""Where the optimizer phase of a half-parameter training step spends its time, part by part.

    python -m repro.perf.optimizer_bench --out results/bench/gpu     # CUDA: the 1.2B config's parameters
    python -m repro.perf.optimizer_bench --out /tmp/o --tiny          # CPU smoke run

Builds the model of `gpu_bench` in bf16 with fp32 masters and main grads (random gradients, no
forward or backward) and times each part of `gpu_bench.timed_step`'s optimizer phase alone: the
host's time to issue it (`cpu ms`: Python and kernel launches, measured without a sync) and its time
to finish (`wall ms`: from a synced start to a sync after it). A part whose cpu ms is close to its
wall ms is bound by the host: in the trainer, where backward is still running on the GPU when the
optimizer phase is issued, that time overlaps; after a sync it does not. Medians of `--reps` calls
after two warm-up calls. Writes optimizer.json and optimizer.md.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch

from repro.models.sizes import SIZES
from repro.parallel.grads import global_grad_norm
from repro.perf.gpu_bench import GPT_SIZES, TINY, FlagError, _sync, at_least, build_model, pick_device
from repro.provenance import OutDirError, make_out_dir, measurement_provenance, write_report
from repro.train.flat_adamw import FlatMasterAdamW
from repro.train.main_grads import MainGrads
from repro.train.mixed_precision import MasterWeights
from repro.train.optim import clip_and_step, param_groups


def time_part(fn: Callable[[], object], device: torch.device, reps: int) -> dict[str, float]:
    """Median host-issue and wall milliseconds of `fn` over `reps` calls after two warm-up calls."""
    cpu, wall = [], []
    for i in range(reps + 2):
        _sync(device)
        start = time.perf_counter()
        fn()
        issued = time.perf_counter()
        _sync(device)
        done = time.perf_counter()
        if i >= 2:
            cpu.append((issued - start) * 1e3)
            wall.append((done - start) * 1e3)
    return {"cpu_ms": statistics.median(cpu), "wall_ms": statistics.median(wall)}


def _all_written(main: MainGrads) -> None:
    """Mark every main-grad slot written, as after a backward (finish() then zeroes nothing)."""
    for slot in main.slots.values():
        slot.written = True
    for bucket in main.buckets:
        bucket.ready = True
    main.next_bucket = len(main.buckets)


def parts(model, masters: MasterWeights, main: MainGrads, device) -> dict[str, Callable[[], object]]:
    """The optimizer phase and its parts, each a callable."""
    params = masters.parameters()
    grads = [p.grad for p in params]
    opt = torch.optim.AdamW(param_groups(masters, 0.01), lr=1e-8, fused=device.type == "cuda")  # the trainer's groups
    flat = [torch.zeros_like(b.flat, requires_grad=True) for b in main.buckets]
    for f, b in zip(flat, main.buckets):
        f.grad = b.flat
    flat_opt = torch.optim.AdamW(flat, lr=1e-8, weight_decay=0.01, fused=device.type == "cuda")
    # its own AdamW state; the masters and model parameters become views of its flat buffers
    flat_master = FlatMasterAdamW(torch.optim.AdamW(param_groups(masters, 0.01), lr=1e-8), masters, main)
    one = torch.ones((), device=device)

    def phase():
        _all_written(main)
        stepped = main.finish()
        clip_and_step(opt, stepped, 1.0)
        masters.masters_to_model()

    def flat_phase():
        _all_written(main)
        clip_and_step(opt, main.finish(), 1.0, flat=flat_master)

    return {
        "whole phase (finish, norm, folded clip + fused AdamW, masters to model)": phase,
        "main grads finish()": lambda: (_all_written(main), main.finish()),
        "global_grad_norm": lambda: global_grad_norm(params),
        "_foreach_norm, dtype=float32": lambda: torch._foreach_norm(grads, 2, dtype=torch.float32),
        "_foreach_norm, no dtype": lambda: torch._foreach_norm(grads, 2),
        "fused AdamW step": opt.step,
        "clip_and_step, folded (norm + fused AdamW with grad_scale)": lambda: clip_and_step(opt, params, 1.0),
        "clip_and_step, foreach clip then fused AdamW": lambda: clip_and_step(opt, params, 1.0, fold=False),
        f"fused AdamW step on {len(flat)} flat buckets": flat_opt.step,
        "masters_to_model (_foreach_copy_ fp32 -> bf16)": masters.masters_to_model,
        "FlatMasterAdamW grad_norm (over its flat runs)": flat_master.grad_norm,
        "FlatMasterAdamW step (AdamW + masters to model, one kernel a bucket compiled)": lambda: flat_master.step(one),
        "whole phase, flat (finish, norm, FlatMasterAdamW with the clip folded)": flat_phase,
    }


def markdown(report: dict) -> str:
    p = report["provenance"]
    lines = [f"# Optimizer phase by part: {report['model']}, {report['parameters']:,} parameters\n",
             f"Device {p['device']}; torch {p['torch']}, CUDA {p['cuda']}; {p['date_utc']}; git {p['git_sha']}.",
             f"Command: `{p['command']}`. Medians of {report['reps']} calls.\n",
             "| part | cpu ms (issue) | wall ms |", "|---|---|---|"]
    lines += [f"| {name} | {r['cpu_ms']:.2f} | {r['wall_ms']:.2f} |" for name, r in report["parts"].items()]
    return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m repro.perf.optimizer_bench", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for optimizer.json and optimizer.md")
    parser.add_argument("--tiny", action="store_true", help="a tiny model (CPU smoke run)")
    parser.add_argument("--size", default="scaling-1.2b", choices=GPT_SIZES, help="a repro.models.sizes GPT name")
    parser.add_argument("--reps", type=at_least(1), default=10, help="timed calls per part (their median is kept)")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        device = pick_device(args, "this times the 1.2B config's optimizer step on a GPU "
                             "(tens of GB of host memory on a CPU)")
    except FlagError as err:
        parser.error(str(err))
    try:
        make_out_dir(args.out, "results/bench/gpu_h200_new/optimizer")
    except OutDirError as err:
        parser.error(str(err))
    cfg = TINY if args.tiny else SIZES[args.size].model_config()
    model = build_model(cfg, device)
    masters = MasterWeights(model, torch.bfloat16)
    main_grads = MainGrads(masters.pairs())
    gen = torch.Generator(device=device).manual_seed(0)
    for bucket in main_grads.buckets:
        bucket.flat.normal_(0.0, 1e-4, generator=gen)
    results = {name: time_part(fn, device, args.reps) for name, fn in parts(model, masters, main_grads, device).items()}
    report = {"model": "tiny" if args.tiny else args.size, "parameters": sum(p.numel() for p in masters.parameters()),
              "reps": args.reps, "parts": results,
              "provenance": measurement_provenance(device, sys.argv[1:] if argv is None else argv,
                                                  prog="python -m repro.perf.optimizer_bench")}
    write_report(args.out, "optimizer", report, markdown(report))
    print(markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
