"""Benchmark: what building micro batches costs the training loop, in the trainer's process or in workers.

    python -m repro.data.bench_loader [--step-ms 25] [--batches 60] [--out results/bench]

Real data: WikiText-2 validation from the data mirror, prepared once into a temporary directory as
BERT WordPiece sentences (samples of 512 tokens) and as GPT-2 BPE (samples of 1024 tokens). For
each family, micro batches of 8 through the trainer's own loader (`bert_loader` / `gpt_loader`):

- build cost: seconds a micro batch takes to build in the training process (no step);
- stall: seconds the loop waits in `next(loader)` per micro batch while a simulated step of
  --step-ms runs between batches (a sleep: the CPU is free, as it is while a GPU computes), with
  `workers` 0 (Megatron-LM's `num_workers=0`) and 2 (this trainer's default), in one run, alternating.

Both must yield the same batches (checked). Writes data_loader.json and data_loader.md into --out.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

from repro.data.bench import machine
from repro.provenance import git_sha, write_atomic

MICRO_BATCH = 8
FAMILIES = {"bert": 512, "gpt": 1024}


def _prepare(family: str, data_dir: Path, out: Path) -> str:
    from repro.data.filters import FilterOptions
    from repro.data.preprocess import PrepareOptions, prepare

    prefix = str(out / family)
    prepare(PrepareOptions(input=data_dir / "wikitext" / "wikitext-2.valid.tokens", output_prefix=prefix,
                           tokenizer="bert" if family == "bert" else "gpt2", data_dir=data_dir, workers=1,
                           split="100,0,0", progress=False, layout="wikitext",
                           filters=FilterOptions(min_tokens=0, dedup=False, eval_overlap=False)))
    return prefix + "_train"


def _loader(family: str, prefix: str, data_dir: Path, cache: Path, workers: int):
    if family == "bert":
        from repro.data.bert_dataset import BertDataset, BertOptions, bert_loader
        from repro.data.tokenizers import build_tokenizer

        data = BertDataset(prefix, build_tokenizer("bert", data_dir), BertOptions(max_seq_length=FAMILIES["bert"]),
                           cache_dir=str(cache))
        return bert_loader(data, MICRO_BATCH, workers=workers)
    from repro.data.gpt_dataset import GPTDataset, gpt_loader

    return gpt_loader(GPTDataset(prefix, FAMILIES["gpt"], cache_dir=str(cache)), MICRO_BATCH, workers=workers)


def _same(a, b) -> bool:
    pairs = zip(a.values(), b.values()) if isinstance(a, dict) else zip(a, b)
    return all(torch.equal(x, y) for x, y in pairs)


def _stalls(loader, batches: int, step_s: float) -> tuple[list[float], list]:
    """Seconds waited in next() per micro batch (the first, which starts the workers, left out)."""
    it, waits = iter(loader), []
    seen = [next(it)]
    for _ in range(batches):
        time.sleep(step_s)
        began = time.perf_counter()
        seen.append(next(it))
        waits.append(time.perf_counter() - began)
    it.close()
    return waits, seen


def measure(family: str, prefix: str, data_dir: Path, cache: Path, batches: int, step_s: float,
            rounds: int) -> dict:
    """Build cost and per-batch stall at workers 0 and 2, best (lowest median) of `rounds`."""
    build = []
    for _ in range(rounds):
        it = iter(_loader(family, prefix, data_dir, cache, 0))
        began = time.perf_counter()
        for _ in range(batches):
            next(it)
        build.append((time.perf_counter() - began) / batches)
    stall: dict[int, list[float]] = {0: [], 2: []}
    same = True
    for _ in range(rounds):
        reference = None
        for workers in (0, 2):
            waits, seen = _stalls(_loader(family, prefix, data_dir, cache, workers), batches, step_s)
            stall[workers].append(sorted(waits)[len(waits) // 2])
            if reference is None:
                reference = seen
            else:
                same = same and len(seen) == len(reference) and all(map(_same, seen, reference))
    return {"seq_length": FAMILIES[family], "micro_batch": MICRO_BATCH, "build_s": min(build),
            "stall_median_s": {str(w): min(v) for w, v in stall.items()}, "same_batches": same}


def write_markdown(record: dict, path: Path) -> None:
    """A short table for results/."""
    m = record["machine"]
    lines = ["# Data loader: building micro batches in the training process or in 2 workers", "",
             f"{record['date']}, git {record['git_sha']}, `{record['command']}`  ",
             f"{m['cpu']}, {m['usable_cores']} usable of {m['cores']} cores; Python {m['python']}; best of "
             f"{record['rounds']} alternating runs of {record['batches']} micro batches; 1-min load average "
             f"{record['load_average_1min_at_end']} at the end (a shared machine)", "",
             f"WikiText-2 validation, micro batch {MICRO_BATCH}; stall = median wait in `next(loader)` while a "
             f"simulated step of {record['step_ms']:g} ms (a sleep: the CPU is free, as under a GPU step) runs "
             "between batches.", "",
             "| family | seq | build ms / micro batch | stall ms, 0 workers | stall ms, 2 workers | same batches |",
             "|---|---:|---:|---:|---:|---|"]
    for family, r in record["families"].items():
        lines.append(f"| {family} | {r['seq_length']} | {1e3 * r['build_s']:.2f} | "
                     f"{1e3 * r['stall_median_s']['0']:.2f} | {1e3 * r['stall_median_s']['2']:.3f} | "
                     f"{r['same_batches']} |")
    write_atomic(path, "\n".join(lines) + "\n")


def run(args: argparse.Namespace) -> dict:
    """Prepare both datasets, measure, write JSON and Markdown."""
    from repro.data.fetch import data_dir_from_env

    data_dir = Path(args.data_dir) if args.data_dir else Path(os.environ.get("REPRO_DATA_MIRROR") or data_dir_from_env())
    families = {}
    with tempfile.TemporaryDirectory() as tmp:
        for family in FAMILIES:
            prefix = _prepare(family, data_dir, Path(tmp))
            families[family] = measure(family, prefix, data_dir, Path(tmp), args.batches, args.step_ms / 1e3,
                                       args.rounds)
    record = {"date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
              "command": " ".join([Path(sys.executable).name, "-m", "repro.data.bench_loader", *sys.argv[1:]]),
              "git_sha": git_sha(("repro/data",)), "machine": machine(), "torch": torch.__version__,
              "rounds": args.rounds, "batches": args.batches, "step_ms": args.step_ms, "families": families,
              "load_average_1min_at_end": round(os.getloadavg()[0], 2)}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_atomic(out / "data_loader.json", json.dumps(record, indent=2) + "\n")
    write_markdown(record, out / "data_loader.md")
    return record


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--step-ms", type=float, default=25.0, help="simulated step between micro batches")
    parser.add_argument("--batches", type=int, default=60)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--data-dir", default="", help="holds wikitext/ and vocab/ (default: the mirror, else REPRO_DATA_DIR)")
    parser.add_argument("--out", default="results/bench")
    args = parser.parse_args(argv)
    record = run(args)
    print(Path(args.out, "data_loader.md").read_text(encoding="utf-8"))
    return 0 if all(r["same_batches"] for r in record["families"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
