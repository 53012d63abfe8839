"""Where a training step's time goes: torch.profiler over a few steps of a named size, by kernel.

    python -m repro.perf.gpu_profile --out results/bench/gpu_h200 --params half   # CUDA, 1.2B, batch 8
    python -m repro.perf.gpu_profile --out /tmp/p --tiny                     # CPU smoke run

Writes profile_<params>.txt (`--params fp32`: autocast over fp32 weights; `half`: a bf16 model with
fp32 master weights and the trainer's fp32 main grads; both the step gpu_bench times, gradient
clipping included): the top kernels by device time and the share of matrix-multiply kernels (GEMM /
attention) against everything else (element-wise, norms, softmax, optimizer, copies).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from repro.models.gpt import GPT
from repro.models.sizes import SIZES
from repro.perf.gpu_bench import GPT_SIZES, TINY, FlagError, RunSpec, at_least, pick_device, timed_step
from repro.provenance import OutDirError, make_out_dir, write_atomic
from repro.train.main_grads import MainGrads
from repro.train.mixed_precision import MasterWeights

RANGE_PREFIXES = ("ProfilerStep", "Optimizer.")
MATMUL_MARKERS = ("gemm", "matmul", "::mm", "::bmm", "addmm", "cutlass", "sm90", "flash", "attention",
                  "xmma", "nvjet", "scaled_dot")


def _is_range(event) -> bool:
    """A named range, not a kernel: torch reports the optimizer's `Optimizer.step#AdamW.step` (and
    record_function ranges) on the GPU timeline too, spanning kernels already counted. Matched by
    name prefix, never by a bare `#`: CUDA kernels built from lambdas carry one too
    (`GeluCUDAKernelImpl(...)::{lambda(c10::BFloat16)#1}`), and the 2026-12-04 H200 profile lost
    every such kernel (GELU, dropout backward, copies) to that test."""
    return bool(getattr(event, "is_user_annotation", False)) or event.key.startswith(RANGE_PREFIXES)


KERNEL_CATEGORIES = (  # first match wins; lower-case substrings of kernel names
    ("attention", ("sdpa", "flash", "fmha", "attention", "cudnn")),
    ("matrix multiply", ("gemm", "nvjet", "cutlass", "xmma", "matmul", "::mm", "addmm", "sm90_xmma")),
    ("optimizer", ("fusedoptimizer", "adam")),
    ("layer norm", ("layer_norm", "layernorm", "gammabeta")),
    ("dropout", ("dropout", "masked_scale", "philox")),
    ("copy / cat", ("copy", "memcpy", "catarray", "cat_")),
    ("memset", ("memset",)),
    ("multi-tensor (norm, clip, casts)", ("multi_tensor_apply",)),
    ("reduction", ("reduce_kernel", "softmax", "logsoftmax")),
)


def kernel_category(name: str) -> str:
    """A coarse class of a kernel by its name; everything unmatched is element-wise or other."""
    lowered = name.lower()
    for category, markers in KERNEL_CATEGORIES:
        if any(m in lowered for m in markers):
            return category
    return "element-wise / other"


def _by_category(events, attr: str, steps: int) -> list[str]:
    totals: dict[str, list[float]] = {}
    for e in events:
        entry = totals.setdefault(kernel_category(e.key), [0.0, 0])
        entry[0] += getattr(e, attr)
        entry[1] += e.count
    return [f"{us / 1e3 / steps:9.2f} ms/step  x{n // steps:<5} {cat}"
            for cat, (us, n) in sorted(totals.items(), key=lambda kv: -kv[1][0])]


def _summary(prof, device_type: str, top: int, steps: int = 1) -> str:
    events = [e for e in prof.key_averages() if (e.device_type.name.lower() == device_type.upper().lower()
              or device_type == "cpu") and not (device_type == "cuda" and _is_range(e))]
    attr = "self_device_time_total" if device_type == "cuda" else "self_cpu_time_total"
    events = sorted(events, key=lambda e: getattr(e, attr), reverse=True)
    total = sum(getattr(e, attr) for e in events) or 1.0
    matmul = sum(getattr(e, attr) for e in events if any(m in e.key.lower() for m in MATMUL_MARKERS))
    lines = [f"device time profiled: {total / 1e3:.1f} ms ({total / 1e3 / steps:.1f} ms a step); matrix-multiply/"
             f"attention kernels {100 * matmul / total:.1f}%, everything else {100 * (1 - matmul / total):.1f}%", ""]
    if device_type == "cuda":
        lines += ["by kind of kernel:"] + _by_category(events, attr, steps) + ["", "top kernels:"]
    lines += [f"{100 * getattr(e, attr) / total:6.2f}%  {getattr(e, attr) / 1e3:9.2f} ms  x{e.count:<5} {e.key[:110]}"
              for e in events[:top]]
    return "\n".join(lines) + "\n"


def _gaps(prof) -> str:
    """gpu_gaps' summary of the profiled steps (from a chrome trace in a temporary file)."""
    import json
    import tempfile

    from repro.perf.gpu_gaps import gap_summary

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        return gap_summary(json.loads(path.read_text())).text()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m repro.perf.gpu_profile", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--size", default="scaling-1.2b", choices=GPT_SIZES, help="a repro.models.sizes GPT name")
    parser.add_argument("--batch", type=at_least(1), default=8)
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--steps", type=at_least(1), default=2, help="profiled steps (after 3 untimed)")
    parser.add_argument("--params", choices=("fp32", "half"), default="fp32",
                        help="fp32: bf16 autocast over fp32 weights; half: bf16 model, fp32 masters")
    parser.add_argument("--compile", action="store_true", help="profile torch.compile(model.loss), as gpu_bench --compile")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        device = pick_device(args, "this profiles the 1.2B config on a GPU (hours on a CPU)")
    except FlagError as err:
        parser.error(str(err))
    try:
        make_out_dir(args.out, "results/bench/gpu_h200_new")
    except OutDirError as err:
        parser.error(str(err))
    cfg = TINY if args.tiny else SIZES[args.size].model_config()
    model = GPT(cfg, seed=0).to(device).train()
    spec = RunSpec("bf16", checkpointing=False, batch=args.batch, params=args.params)
    masters = MasterWeights(model, torch.bfloat16) if args.params == "half" else None
    main = MainGrads(masters.pairs()) if masters is not None else None
    opt = torch.optim.AdamW((masters or model).parameters(), lr=1e-5, fused=True)
    ids = torch.randint(0, cfg.vocab_size, (args.batch, cfg.seq_length), device=device)

    loss_fn = torch.compile(model.loss) if args.compile else model.loss

    def step() -> None:  # gpu_bench's timed step: forward, backward, clipping, AdamW
        timed_step(model, loss_fn, opt, None, ids, spec, device, masters, main)

    for _ in range(3):
        step()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(args.steps):
            step()
        if device.type == "cuda":
            torch.cuda.synchronize()
    recipe = "bf16 autocast over fp32 weights" if masters is None else "bf16 model, fp32 master weights"
    mode = "compiled" if args.compile else "eager"
    text = f"{args.size if not args.tiny else 'tiny'}, batch {args.batch}, {recipe}, {args.steps} steps, {mode}\n"
    text += _summary(prof, device.type, top=30, steps=args.steps)
    if device.type == "cuda":
        text += "\n" + _gaps(prof)
    write_atomic(args.out / f"profile_{args.params}{'_compiled' if args.compile else ''}.txt", text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
