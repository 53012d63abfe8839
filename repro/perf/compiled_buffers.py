"""What a compiled training step allocates, read off inductor's generated code.

    python -m repro.perf.compiled_buffers --out /tmp/buffers --tiny                   # CPU, seconds
    python -m repro.perf.compiled_buffers --out results/bench/gpu/buffers --layers 2  # the 1.2B shapes

Inductor turns the compiled forward and backward into a Python wrapper that allocates every buffer a
kernel writes (`bufN = empty_strided_cuda(shape, stride, dtype)`; `_cpu` on CPU) and then calls the
kernels. Which intermediates become buffers is decided by its scheduler, shared by the CPU (C++) and
GPU (Triton) backends, so a CPU compile already shows most needless passes: two full passes over the
logits were found this way (docs/training.md). This builds `gpu_bench`'s headline step (half model,
fp32 masters and main grads, `torch.compile(model.loss)`, dropout as configured), compiles one step
with `--layers` transformer layers (the other layers repeat the same buffers), and lists every
buffer: its graph, shape, dtype, bytes and the kernel that first writes it; buffers the size of
the logits (tokens x padded vocab) are marked. Allocations are not traffic: a buffer inductor
reuses is not counted again, and kernels also read their inputs. Writes buffers.json and buffers.md.
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from collections import Counter
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from repro.provenance import OutDirError, make_out_dir, measurement_provenance, write_report

ALLOCATION = re.compile(r"^\s*(buf\w*) = empty_strided_\w+\(\(([^)]*)\), \([^)]*\), (?:device='\w+', )?torch\.(\w+)\)")
AOT_ID = re.compile(r"# AOT ID: \['([^']*)'\]")


@dataclass(frozen=True)
class Buffer:
    graph: str
    """The AOT graph the wrapper runs, e.g. 0_forward, 0_backward."""
    name: str
    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    writer: str
    """The first call that takes the buffer after its allocation (a fused kernel or an extern op)."""


def buffers(code: str) -> list[Buffer]:
    """Every buffer one generated wrapper allocates (dynamic sizes are not parsed: compile statically)."""
    aot_id = AOT_ID.search(code)
    graph = aot_id.group(1) if aot_id else "graph"
    lines = code.splitlines()
    found = []
    for i, line in enumerate(lines):
        match = ALLOCATION.match(line)
        if not match:
            continue
        name, sizes, dtype = match.groups()
        shape = tuple(int(s) for s in sizes.replace(" ", "").split(",") if s)
        itemsize = torch.empty((), dtype=getattr(torch, dtype)).element_size()
        found.append(Buffer(graph, name, shape, dtype, math.prod(shape) * itemsize, _writer(lines[i + 1:], name)))
    return found


def _writer(lines: list[str], name: str) -> str:
    """The callee of the first call after the allocation that passes `name` on, following the
    wrapper's aliases (`buf9 = buf4; del buf4  # reuse`, `buf9 = reinterpret_tensor(buf4, ...)`)."""
    names = {name}
    for line in lines:
        text = line.strip()
        if text.startswith(("#", "del ")) or not any(re.search(rf"\b{n}\b", text) for n in names):
            continue
        alias = re.match(r"(buf\w*) = (?:reinterpret_tensor\()?(buf\w*)\b", text)
        if alias and alias.group(2) in names:
            names.add(alias.group(1))
            continue
        call = re.match(r"(?:[\w, ]+ = )?([\w.]+)\(", text)
        return call.group(1) if call else text[:60]
    return "(none)"


def report(found: list[Buffer], tokens: int, padded_vocab: int) -> dict:
    """Totals by graph and the buffers grouped by (graph, shape, dtype, writer), largest first."""
    groups = Counter((b.graph, b.shape, b.dtype, b.writer) for b in found)
    nbytes = {(b.graph, b.shape, b.dtype, b.writer): b.nbytes for b in found}
    rows = [{"graph": g, "shape": list(shape), "dtype": dtype, "writer": writer, "count": n,
             "bytes_each": nbytes[g, shape, dtype, writer], "logit_sized": math.prod(shape) == tokens * padded_vocab}
            for (g, shape, dtype, writer), n in groups.items()]
    rows.sort(key=lambda r: -r["bytes_each"] * r["count"])
    totals = Counter()
    for b in found:
        totals[b.graph] += b.nbytes
    return {"tokens": tokens, "padded_vocab": padded_vocab, "totals_bytes": dict(totals), "groups": rows,
            "buffers": [asdict(b) for b in found]}


def markdown(result: dict, top: int = 30) -> str:
    p = result["provenance"]
    lines = [f"# Buffers of one compiled step: {result['model']}\n",
             f"Device {p['device']}; torch {p['torch']}; {p['date_utc']}; git {p['git_sha']}. "
             f"Command: `{p['command']}`. {result['tokens']:,} tokens, padded vocab {result['padded_vocab']:,}.\n",
             "| graph | MB allocated |", "|---|---|"]
    lines += [f"| {g} | {b / 1e6:,.1f} |" for g, b in result["totals_bytes"].items()]
    lines += ["", f"The {top} largest groups (a group: the same graph, shape, dtype and writer):\n",
              "| graph | shape | dtype | count | MB each | first written by | logit-sized |", "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['graph']} | {tuple(r['shape'])} | {r['dtype']} | {r['count']} | {r['bytes_each'] / 1e6:,.2f} | "
              f"`{r['writer'][:70]}` | {'yes' if r['logit_sized'] else ''} |" for r in result["groups"][:top]]
    return "\n".join(lines) + "\n"


def compiled_step_code(cfg, batch: int, device: torch.device, dtype: str = "bf16") -> list[str]:
    """The generated wrappers of one compiled step of gpu_bench's half-parameter headline."""
    from torch._inductor.utils import run_and_get_code

    from repro.perf.gpu_bench import RunSpec, build_model, compiled_loss
    from repro.train.main_grads import MainGrads
    from repro.train.mixed_precision import MasterWeights

    model = build_model(cfg, device)
    masters = MasterWeights(model, {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype])
    main = MainGrads(masters.pairs())
    ids = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_length), generator=torch.Generator().manual_seed(0)).to(device)
    spec = RunSpec(dtype, False, batch, compile=True, params="half")
    with compiled_loss(model, spec) as loss_fn:
        def step():
            loss_fn(ids, ids).float().mean().backward()
            main.finish()

        _, codes = run_and_get_code(step)
    return codes


def build_parser() -> argparse.ArgumentParser:
    from repro.perf.gpu_bench import GPT_SIZES, at_least

    parser = argparse.ArgumentParser(prog="python -m repro.perf.compiled_buffers", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for buffers.json and buffers.md")
    parser.add_argument("--tiny", action="store_true", help="gpu_bench's tiny model (a CPU smoke run)")
    parser.add_argument("--size", default="scaling-1.2b", choices=GPT_SIZES,
                        help="a repro.models.sizes GPT name (its shapes)")
    parser.add_argument("--layers", type=at_least(1), default=2, help="transformer layers to compile (the rest repeat)")
    parser.add_argument("--batch", type=at_least(1), default=8)
    parser.add_argument("--dtype", default="bf16", choices=("bf16", "fp16"))
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        make_out_dir(args.out, "/tmp/buffers")
    except OutDirError as err:
        parser.error(str(err))
    from repro.models.sizes import SIZES
    from repro.perf.gpu_bench import TINY

    cfg = replace(TINY if args.tiny else SIZES[args.size].model_config(), num_layers=args.layers)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    found = [b for code in compiled_step_code(cfg, args.batch, device, args.dtype) for b in buffers(code)]
    result = {"model": f"{'tiny' if args.tiny else args.size}, {args.layers} layers, batch {args.batch}, {args.dtype}",
              **report(found, args.batch * cfg.seq_length, cfg.padded_vocab_size(1)),
              "provenance": measurement_provenance(device, sys.argv[1:] if argv is None else argv,
                                                  prog="python -m repro.perf.compiled_buffers")}
    write_report(args.out, "buffers", result, markdown(result))
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
