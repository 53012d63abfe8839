"""One-device training-step benchmark of the 1.2B config (Table 1 row 1): tokens/s, TFLOP/s, MFU.

    python -m repro.perf.gpu_bench --out results/bench/gpu            # CUDA: 1.2B, batch 8, seq 1024
    python -m repro.perf.gpu_bench --out /tmp/b --tiny                 # CPU smoke run, tiny model

Each configuration (dtype x activation checkpointing x parameter dtype) times full training steps:
forward, backward, gradient clipping to norm 1.0 (the trainer's default, `--clip`) and a fused AdamW
step, the clip applied as the trainer applies it (`clip_and_step`: on a GPU a foreach pass before the
step, on CPU folded into the step as its gradient divisor; `--fold-clip` or `--foreach-clip` force
one). Two precision recipes: `params fp32` autocasts to bf16/fp16 over fp32 weights; `params half` is
Megatron's recipe, a bf16/fp16 model without autocast whose fp32 master weights live in the optimizer
(repro.train.mixed_precision), with the trainer's fp32 main grads (repro.train.main_grads: backward
then includes adding each gradient into its fp32 buffer, the optimizer phase rounding the masters
back). fp16 adds the trainer's dynamic loss scaler; the cross-entropy is computed in fp32. Warm-up
steps are excluded; a step is timed on the wall clock up to its one host sync (the loss read, as the
trainer's divergence check reads it) and its phases by CUDA events, so the CPU queues each phase while
the GPU still runs the one before, as in the trainer (until 2026-12-04 a sync between phases exposed
the optimizer's Python time: 6-8 ms a step on an H200). A configuration that fails (OOM or other
error) is recorded, not raised; after a total time budget the script stops. JSON and Markdown are
rewritten atomically after every configuration, with provenance (device, versions, date, git SHA,
command). `--optimizer flat` replaces the half-parameter recipe's fused AdamW and its copy of the
masters into the model by one compiled kernel per flat main-grad bucket (repro.train.flat_adamw).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch

from repro.models.config import ModelConfig
from repro.models.sizes import SIZES
from repro.perf.flops import flops_per_iteration
from repro.perf.peaks import match_device, measure_cpu_peak
from repro.provenance import OutDirError, make_out_dir, measurement_provenance, write_report
from repro.train.flat_adamw import FlatMasterAdamW
from repro.train.main_grads import MainGrads
from repro.train.mixed_precision import MasterWeights
from repro.train.optim import DynamicLossScaler, clip_and_step, param_groups

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
TINY = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=64, vocab_size=1000)
GPT_SIZES = tuple(name for name, size in SIZES.items() if size.family == "gpt")
"""The repro.models.sizes names these GPT tools (`--size`) can build."""


class FlagError(SystemExit):
    """Flags gpu_bench refuses: exits 2, as argparse's errors; str() is the message, naming the fix."""

    def __init__(self, message: str) -> None:
        super().__init__(2)
        self.message = message

    def __str__(self) -> str:
        return self.message


def at_least(minimum: int) -> Callable[[str], int]:
    """An argparse type: an integer of at least `minimum` (argparse exits 2 naming the flag)."""
    def parse(text: str) -> int:
        value = int(text)
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{value}: must be at least {minimum}")
        return value

    parse.__name__ = "int"  # argparse's "invalid int value: 'x'" for a non-number
    return parse


@dataclass
class RunSpec:
    """One configuration to time."""

    dtype: str
    checkpointing: bool
    batch: int
    compile: bool = False
    params: str = "fp32"
    """fp32: autocast over fp32 weights; half: half-precision model, fp32 main grads and masters."""
    clip: float = 1.0
    """Gradient clipping to this global norm, as the trainer's `optim.clip_grad` (0: none)."""
    fold_clip: bool | None = None
    """Unscale and clip as the fused AdamW's gradient divisor (True) or in foreach passes (False);
    None: as the trainer does on this device (clip_and_step)."""
    compile_scope: str = "objective"
    """With compile: objective (model.loss as one graph) or blocks (each layer, the trainer at DP > 1)."""
    compile_mode: str = "default"
    """torch.compile's mode (reduce-overhead: CUDA graphs)."""
    main_grads: str = "fp32"
    """With params half: fp32 main grads added by a hook per parameter during backward (the trainer's
    default), or `param`: half gradients cast to fp32 once in the optimizer phase (no hooks)."""
    optimizer: str = "torch"
    """torch: the fused torch AdamW, then the masters copied into the half model (the trainer's step);
    flat (params half, fp32 main grads): one compiled kernel per flat main-grad bucket that steps the
    masters and rounds them into the model (repro.train.flat_adamw), the clip folded into it."""


@dataclass
class RunResult:
    """What one configuration measured (or why it could not)."""

    spec: RunSpec
    status: str = "ok"  # ok | oom | error | skipped (budget)
    error: str = ""
    steps_timed: int = 0
    step_s_median: float = float("nan")
    phase_s_median: dict[str, float] = field(default_factory=dict)
    tokens_per_s: float = float("nan")
    model_tflops: float = float("nan")
    hardware_tflops: float = float("nan")
    mfu: float = float("nan")
    hfu: float = float("nan")
    peak_memory_gib: float | None = None
    planned_memory_gib: float | None = None
    """`repro plan`'s peak for this configuration (repro.perf.plan; eager execution)."""
    peak_tflops: float | None = None
    loss_first: float = float("nan")
    loss_last: float = float("nan")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def build_model(cfg: ModelConfig, device: torch.device):
    """The serial GPT with fp32 master weights built directly on `device`.

    Built on the meta device and initialised in place (N(0, std) weights, unit layer-norm scales,
    zero biases): the timing does not depend on the values, and a 1.2B CPU init would take ~30 s.
    """
    from repro.models.gpt import GPT

    with torch.device("meta"):
        model = GPT(cfg)
    model.to_empty(device=device)
    gen = torch.Generator(device=device).manual_seed(1234)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.zero_()
            elif ".ln_" in name or name.startswith("transformer.ln_f"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, cfg.init_method_std, generator=gen)
    if any(True for _ in model.buffers()):
        raise RuntimeError("GPT gained buffers: initialise them in build_model")
    return model.train()


class PhaseClock:
    """Phase boundaries on the device's own timeline: CUDA events on a GPU, so no host sync splits a
    step and the CPU queues the next phase while the device still runs this one (as in the trainer);
    the wall clock on CPU, where every op finishes before the next starts."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.marks: list = []

    def mark(self) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())

    def seconds(self) -> list[float]:
        """Seconds between consecutive marks (after the step's host sync)."""
        pairs = zip(self.marks, self.marks[1:])
        if self.cuda:
            return [a.elapsed_time(b) / 1e3 for a, b in pairs]
        return [b - a for a, b in pairs]


def timed_step(model, loss_fn, opt, scaler: DynamicLossScaler | None, ids, spec: RunSpec, device,
                masters=None, main=None, flat: FlatMasterAdamW | None = None) -> tuple[dict[str, float], float]:
    """One training step as the trainer's (repro.train.step); returns its seconds (`step`, wall clock
    from the first launch to the end of the step's one host sync, which reads the loss as the trainer's
    divergence check does) and per phase (`PhaseClock`), and the loss value."""
    clock = PhaseClock(device)
    start = time.perf_counter()
    clock.mark()
    autocast = spec.dtype != "fp32" and masters is None
    with torch.autocast(device.type, dtype=DTYPES[spec.dtype], enabled=autocast):
        loss = loss_fn(ids, ids).float().mean()
    clock.mark()
    (loss * scaler.scale if scaler is not None else loss).backward()
    clock.mark()
    if main is not None:
        stepped = main.finish()
    elif masters is not None:
        stepped = masters.grads_to_masters()
    else:
        stepped = [p for p in model.parameters() if p.grad is not None]
    _, skipped = clip_and_step(opt, stepped, spec.clip, scaler=scaler, fold=spec.fold_clip, flat=flat)
    if scaler is not None:
        scaler.update(skipped)
    if masters is not None and not skipped and flat is None:  # the flat kernel rounded them in already
        masters.masters_to_model()
    if main is None:  # main grads are overwritten by the next step's first gradient
        opt.zero_grad(set_to_none=True)
    clock.mark()
    loss_value = float(loss.detach())
    _sync(device)
    step_s = time.perf_counter() - start
    forward, backward, optimizer = clock.seconds()
    return {"step": step_s, "forward": forward, "backward": backward, "optimizer": optimizer}, loss_value


def _fill(result: RunResult, cfg: ModelConfig, phases: list[dict], losses: list[float], peak) -> None:
    spec = result.spec
    steps = [p["step"] for p in phases]
    result.steps_timed = len(steps)
    result.step_s_median = statistics.median(steps)
    result.phase_s_median = {k: statistics.median([p[k] for p in phases]) for k in phases[0] if k != "step"}
    result.tokens_per_s = spec.batch * cfg.seq_length / result.step_s_median
    model_f = flops_per_iteration(cfg, spec.batch, recompute=False)
    hw_f = flops_per_iteration(cfg, spec.batch, recompute=spec.checkpointing)
    result.model_tflops = model_f / result.step_s_median / 1e12
    result.hardware_tflops = hw_f / result.step_s_median / 1e12
    if peak:
        result.mfu, result.hfu = result.model_tflops / peak, result.hardware_tflops / peak
    result.loss_first, result.loss_last = losses[0], losses[-1]


def planned_memory_gib(cfg: ModelConfig, spec: RunSpec, device_type: str) -> float:
    """The memory model's peak for this configuration on one device (the trainer's step: AdamW,
    fp32 main grads for half parameters)."""
    from dataclasses import replace

    from repro.perf.plan import memory_plan
    from repro.train.config import PrecisionConfig, RunConfig, TrainConfig, derive

    run = RunConfig(model=replace(cfg, activation_checkpointing=spec.checkpointing),
                    precision=PrecisionConfig(precision=spec.dtype, params=spec.params, main_grads=spec.main_grads),
                    train=TrainConfig(micro_batch_size=spec.batch, global_batch_size=spec.batch))
    return memory_plan(run, derive(run, 1), device_type).peak / 2**30


def run_config(model, cfg: ModelConfig, spec: RunSpec, device, steps: int, warmup: int,
               peak: float | None, deadline: float) -> RunResult:
    """Time `steps` training steps after `warmup` ones; stops early at the deadline."""
    try:  # the plan is a side note: it must never cost a measurement
        planned = planned_memory_gib(cfg, spec, device.type)
    except Exception:  # noqa: BLE001
        planned = None
    result = RunResult(spec, peak_tflops=peak, planned_memory_gib=planned)
    model.cfg.activation_checkpointing = spec.checkpointing
    masters = MasterWeights(model, DTYPES[spec.dtype]) if spec.params == "half" else None
    main = MainGrads(masters.pairs()) if masters is not None and spec.main_grads == "fp32" else None
    try:
        _time_steps(result, model, cfg, spec, device, steps, warmup, peak, deadline, masters, main)
    finally:
        if masters is not None:  # back to the fp32 model the next configuration expects
            if main is not None:
                main.remove()
            model.float()
            masters.masters_to_model()
    return result


@contextmanager
def compiled_loss(model, spec: RunSpec):
    """model.loss as the configuration runs it: eager, compiled whole, or with each layer compiled
    (undone on exit: the next configuration gets the eager model)."""
    if not spec.compile:
        yield model.loss
    elif spec.compile_scope == "objective":
        yield torch.compile(model.loss, mode=None if spec.compile_mode == "default" else spec.compile_mode)
    else:
        from repro.train.engine import compiled, transformer_layers

        try:
            compiled(model, model, "blocks")
            yield model.loss
        finally:
            for layer in transformer_layers(model):
                layer._compiled_call_impl = None


def _time_steps(result, model, cfg, spec, device, steps, warmup, peak, deadline, masters, main) -> None:
    with compiled_loss(model, spec) as loss_fn:
        _time_compiled(result, model, loss_fn, cfg, spec, device, steps, warmup, peak, deadline, masters, main)


def _time_compiled(result, model, loss_fn, cfg, spec, device, steps, warmup, peak, deadline, masters, main) -> None:
    # the trainer's two param groups (no decay on 1-D parameters): two fused launches, two flat runs a bucket
    opt = torch.optim.AdamW(param_groups(masters or model, 0.01), lr=1e-5, fused=True)
    flat = FlatMasterAdamW(opt, masters, main) if spec.optimizer == "flat" else None  # before the first compiled call
    scaler = DynamicLossScaler(scale=2.0**16) if spec.dtype == "fp16" else None  # GradScaler's start
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (spec.batch, cfg.seq_length), generator=gen).to(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    phases, losses = [], []
    for i in range(warmup + steps):
        if time.monotonic() > deadline:
            result.error = f"time budget reached after {len(phases)} timed steps"
            break
        timing, loss = timed_step(model, loss_fn, opt, scaler, ids, spec, device, masters, main, flat)
        losses.append(loss)
        if i >= warmup:
            phases.append(timing)
    if device.type == "cuda":
        result.peak_memory_gib = torch.cuda.max_memory_allocated(device) / 2**30
    if phases:
        _fill(result, cfg, phases, losses, peak)
    else:
        result.status = "skipped"


def _cleanup(model, device) -> None:
    model.zero_grad(set_to_none=True)
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def safe_run(model, cfg, spec, device, steps, warmup, peak, deadline) -> RunResult:
    """run_config, recording OOM and other errors instead of raising."""
    result = None
    try:
        result = run_config(model, cfg, spec, device, steps, warmup, peak, deadline)
    except torch.OutOfMemoryError as err:
        result = RunResult(spec, status="oom", error=str(err).splitlines()[0][:300])
    except Exception as err:  # noqa: BLE001 - a benchmark records every failure and goes on
        result = RunResult(spec, status="error", error=f"{type(err).__name__}: {str(err)[:300]}")
    _cleanup(model, device)
    return result


def _fmt(x, spec: str) -> str:
    return "-" if x is None or x != x else format(x, spec)


def _clip_label(fold: bool | None) -> str:
    return {None: "", True: ", folded clip", False: ", foreach clip"}[fold]


def _compiled(spec: dict) -> str:
    if not spec["compile"]:
        return "-"
    mode = spec.get("compile_mode", "default")
    return spec.get("compile_scope", "objective") + ("" if mode == "default" else f", {mode}")


def _params_label(spec: dict) -> str:
    grads = ", half grads" if spec.get("params") == "half" and spec.get("main_grads", "fp32") == "param" else ""
    if spec.get("optimizer", "torch") == "flat":
        return f"{spec['params']}{grads}, flat AdamW"
    return f"{spec.get('params', 'fp32')}{grads}{_clip_label(spec.get('fold_clip', True))}"


def markdown(report: dict) -> str:
    """The results as a Markdown table with the provenance above it."""
    p, lines = report["provenance"], []
    lines.append(f"# Single-device training step: {report['model']}\n")
    lines.append(f"Device {p['device']}; torch {p['torch']}, CUDA {p['cuda']}; {p['date_utc']}; git {p['git_sha']}.")
    lines.append(f"Command: `{p['command']}`. Peak TFLOP/s per dtype: {report['peak_source']}.")
    lines.append(f"{report['precision']} TFLOP/s: {report['flops_formula']}.\n")
    lines.append("| dtype | params | ckpt | batch | compile | status | step s | tokens/s | model TFLOP/s | MFU | "
                 "HFU | peak TFLOP/s | peak GiB | planned GiB | fwd / bwd / opt s |")
    lines.append("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in report["results"]:
        s, ph = r["spec"], r["phase_s_median"]
        phases = " / ".join(f"{ph[k]:.3f}" for k in ("forward", "backward", "optimizer")) if ph else "-"
        lines.append(
            f"| {s['dtype']} | {_params_label(s)} | {'on' if s['checkpointing'] else 'off'} | {s['batch']} | {_compiled(s)} | "
            f"{r['status']} {r['error'][:60]} | {_fmt(r['step_s_median'], '.4f')} | {_fmt(r['tokens_per_s'], ',.0f')} | "
            f"{_fmt(r['model_tflops'], '.3g')} | {_fmt(r['mfu'], '.1%')} | {_fmt(r['hfu'], '.1%')} | "
            f"{_fmt(r['peak_tflops'], '.3g')} | {_fmt(r['peak_memory_gib'], '.1f')} | "
            f"{_fmt(r.get('planned_memory_gib'), '.1f')} | {phases} |")
    return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m repro.perf.gpu_bench", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for bench.json and bench.md")
    parser.add_argument("--tiny", action="store_true", help="a tiny model (CPU smoke run)")
    parser.add_argument("--size", default="scaling-1.2b", choices=GPT_SIZES, help="a repro.models.sizes GPT name")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--dtypes", default="bf16,fp16")
    parser.add_argument("--checkpointing", default="off,on", help="comma list of on/off")
    parser.add_argument("--params", default="fp32,half",
                        help="comma list: fp32 (autocast over fp32 weights), half (half model, fp32 masters)")
    parser.add_argument("--clip", type=float, default=1.0,
                        help="clip gradients to this global norm as the trainer does (0: no clipping)")
    clip_way = parser.add_mutually_exclusive_group()
    clip_way.add_argument("--foreach-clip", dest="fold_clip", action="store_false", default=None,
                          help="unscale and clip in foreach passes before the fused AdamW (the trainer's way on a GPU)")
    clip_way.add_argument("--fold-clip", dest="fold_clip", action="store_true", default=None,
                          help="unscale and clip as the fused AdamW's gradient divisor (the trainer's way on CPU)")
    parser.add_argument("--steps", type=at_least(1), default=10, help="timed steps per configuration")
    parser.add_argument("--warmup", type=at_least(0), default=3, help="untimed steps before them")
    parser.add_argument("--budget-s", type=float, default=240.0, help="stop starting work after this")
    parser.add_argument("--compile", action="store_true", help="also time torch.compile(model.loss)")
    parser.add_argument("--compile-only", action="store_true", help="time only the compiled configurations")
    parser.add_argument("--compile-scope", default="objective", choices=("objective", "blocks"),
                        help="compile model.loss whole, or each transformer layer (the trainer's choice at DP > 1)")
    parser.add_argument("--compile-mode", default="default",
                        choices=("default", "reduce-overhead", "max-autotune-no-cudagraphs"),
                        help="torch.compile's mode for the whole-step compile (reduce-overhead: CUDA graphs)")
    parser.add_argument("--main-grads", default="fp32", choices=("fp32", "param"),
                        help="with params half: fp32 main grads by a hook per parameter during backward (the "
                             "trainer's default), or half gradients cast to fp32 once after backward")
    parser.add_argument("--optimizer", default="torch", choices=("torch", "flat"),
                        help="torch: fused torch AdamW, then the masters copied into the model (the trainer's step); "
                             "flat (--params half, fp32 main grads): one compiled kernel per flat bucket does both")
    parser.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    return parser


def parse_args(argv: list[str]) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def plan(args) -> list[RunSpec]:
    """Configurations in run order: every dtype x checkpointing x params, then compiled ones if asked.
    `params half` is not defined for fp32 and is left out there. Raises FlagError for flags it refuses."""
    for d in args.dtypes.split(","):
        if d not in DTYPES:
            raise FlagError(f"unknown dtype {d!r}; choose from {', '.join(DTYPES)}")
    for p in args.params.split(","):
        if p not in ("fp32", "half"):
            raise FlagError(f"unknown --params {p!r}; choose from fp32, half")
    for c in args.checkpointing.split(","):
        if c.strip() not in ("on", "off"):
            raise FlagError(f"unknown --checkpointing {c!r}; choose from on, off (e.g. --checkpointing off,on)")
    if args.batch < 1:
        raise FlagError(f"--batch {args.batch}: time at least one sequence a step (the paper's: --batch 8)")
    if args.compile_scope != "objective" and not (args.compile or args.compile_only):
        raise FlagError(f"--compile-scope {args.compile_scope} needs --compile or --compile-only")
    if args.compile_mode != "default" and (args.compile_scope != "objective" or not (args.compile or args.compile_only)):
        raise FlagError(f"--compile-mode {args.compile_mode} needs --compile or --compile-only (whole-step scope)")
    if args.optimizer == "flat" and (args.params != "half" or args.main_grads != "fp32" or args.fold_clip is not None):
        raise FlagError("--optimizer flat steps the fp32 masters over the flat main-grad buckets and folds the clip "
                         "into its kernel: use it with --params half, without --main-grads param and --fold-clip/--foreach-clip")
    ckpts = [c.strip() == "on" for c in args.checkpointing.split(",")]
    combos = [(d, c, p) for d in args.dtypes.split(",") for c in ckpts for p in args.params.split(",")
              if not (d == "fp32" and p == "half")]
    if not combos:
        raise FlagError(f"--dtypes {args.dtypes} --params {args.params} plans no configuration: half parameters "
                        "are bf16 or fp16. Fix: add bf16 or fp16 to --dtypes, or fp32 to --params")
    common = {"clip": args.clip, "fold_clip": args.fold_clip, "main_grads": args.main_grads,
              "optimizer": args.optimizer}
    specs = [] if args.compile_only else [RunSpec(d, c, args.batch, params=p, **common) for d, c, p in combos]
    if args.compile or args.compile_only:
        specs += [RunSpec(d, c, args.batch, compile=True, params=p, compile_scope=args.compile_scope,
                          compile_mode=args.compile_mode, **common) for d, c, p in combos]
    return specs


def _model_config(args) -> tuple[str, ModelConfig]:
    if args.tiny:
        return "tiny (2 layers, h 64, seq 64)", ModelConfig(**asdict(TINY))
    return args.size, SIZES[args.size].model_config()


def _refuse(parser: argparse.ArgumentParser, err: FlagError) -> None:
    """Print `err` as argparse prints its errors (usage, then the message) and raise it: exit 2."""
    parser.print_usage(sys.stderr)
    print(f"{parser.prog}: error: {err}", file=sys.stderr)
    raise err


def pick_device(args, what: str) -> torch.device:
    """`args.device` (absent or None: cuda if available, else cpu) as a device this machine has. Raises
    FlagError for one it lacks, and for the full config on CPU unless --tiny or --device cpu asks for it."""
    name = getattr(args, "device", None)
    if name is None:
        if torch.cuda.is_available() or args.tiny:
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        anyway = " (--device cpu to time the full config anyway)" if hasattr(args, "device") else ""
        raise FlagError(f"no CUDA device: {what}. Fix: run it on a GPU, or pass --tiny for a CPU smoke run{anyway}")
    try:
        device = torch.device(name)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise FlagError(f"--device {name}: not a device this runs on; choose cpu, cuda or cuda:N")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise FlagError(f"--device {name}: CUDA is not available here. Fix: run on a GPU, or pass --device cpu")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise FlagError(f"--device {name}: this machine has {torch.cuda.device_count()} CUDA device(s); "
                        f"choose cuda:0 to cuda:{torch.cuda.device_count() - 1}")
    return device


def _checked_plan(parser: argparse.ArgumentParser, args) -> list[RunSpec]:
    try:
        return plan(args)
    except FlagError as err:
        _refuse(parser, err)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    args = parser.parse_args(argv)
    specs = _checked_plan(parser, args)
    try:
        device = pick_device(args, "this is the GPU benchmark of the 1.2B config (hours on a CPU)")
    except FlagError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    name, cfg = _model_config(args)
    try:
        make_out_dir(args.out, "results/bench/gpu_h200_new")
    except OutDirError as err:
        _refuse(parser, FlagError(str(err)))
    start = time.monotonic()
    deadline = start + args.budget_s
    entry = match_device(torch.cuda.get_device_name(device)) if device.type == "cuda" else None
    report = {"model": name, "config": asdict(cfg), "provenance": measurement_provenance(device, argv),
              "precision": "params fp32: autocast over fp32 weights; params half: half model, fp32 main grads, "
                           "fp32 masters in the optimizer (fp16: + the trainer's dynamic loss scaler from 2^16); clipping to the "
                           f"global norm {args.clip:g} (0: none); fused AdamW, the unscale and clip as "
                           "the trainer does on this device unless `params` says folded or foreach clip",
              "flops_formula": "model = 72 B s l h^2 (1 + s/6h + V/12lh); hardware = 96 B s l h^2 "
                               "(1 + s/6h + V/16lh) with checkpointing (Narayanan et al. 2021), V = padded vocab",
              "peak_source": entry.source if entry else "measured fp32 matmul (CPU)",
              "peak_tflops": None, "results": []}
    model = build_model(cfg, device)
    cpu_peak = None if entry or device.type == "cuda" else measure_cpu_peak(512)
    for spec in specs:
        peak = entry.tflops.get(spec.dtype) if entry else cpu_peak
        report["peak_tflops"] = peak
        if time.monotonic() > deadline:
            result = RunResult(spec, status="skipped", error="time budget reached before start")
        else:
            result = safe_run(model, cfg, spec, device, args.steps, args.warmup, peak, deadline)
        report["results"].append(asdict(result))
        report["elapsed_s"] = time.monotonic() - start
        write_report(args.out, "bench", report, markdown(report))
        print(markdown(report).splitlines()[-1], flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
