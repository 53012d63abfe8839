"""Benchmark: building the BERT sample map, the old per-sentence loop against the vectorized builder.

    python -m repro.data.bench_bert_map [--sentences 1500000] [--large 50000000] [--out results/bench]

Synthetic documents (fixed seed): 1-60 sentences each, 3-50 tokens a sentence. The baseline is a
copy of the pre-vectorized `build_sample_map` (a Python loop over sentences); it and the new
builder run on the same corpus in the same process, alternating, best of --rounds. At
short_seq_prob 0 (no random targets) both must give the same map. The new builder alone then runs
on --large sentences: the time of a plain run, and the peak memory it allocates, measured by
tracemalloc in a second run (numpy's buffers included, the input corpus excluded). Writes
bert_sample_map.json and bert_sample_map.md into --out.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import resource
import sys
import time
import tracemalloc
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from repro.data.bench import machine
from repro.data.bert_dataset import BertOptions, build_sample_map
from repro.provenance import git_sha, write_atomic


def baseline_build_sample_map(data, opts: BertOptions) -> np.ndarray:
    """BASELINE: the pre-vectorized builder (a Python loop over every sentence), verbatim but for
    today's sample end: never one sentence left behind (Megatron-LM's rule)."""
    rng = np.random.default_rng([opts.seed, 7])
    max_tokens, lengths = opts.max_seq_length - 3, data.sequence_lengths
    rows: list[tuple[int, int, int]] = []
    for d in range(data.num_documents):
        lo, hi = int(data.document_indices[d]), int(data.document_indices[d + 1])
        start, size, target = lo, 0, max_tokens
        for j in range(lo, hi):
            size += int(lengths[j])
            if (size >= target and j > start and hi - j - 1 > 1) or (j == hi - 1 and j > start):
                rows.append((start, j + 1, target))
                start, size = j + 1, 0
                target = (int(rng.integers(2, max_tokens + 1))
                          if rng.random() < opts.short_seq_prob else max_tokens)
    return np.array(rows, dtype=np.int64).reshape(-1, 3)


def synthetic_corpus(sentences: int, seed: int = 0) -> SimpleNamespace:
    """Whole documents of 1-60 sentences (3-50 tokens each), up to `sentences` sentences in all."""
    rng = np.random.default_rng(seed)
    counts = rng.integers(1, 61, sentences // 30 + 100)
    bounds = np.concatenate([[0], np.cumsum(counts)])
    bounds = bounds[bounds <= sentences]
    lengths = rng.integers(3, 51, int(bounds[-1]), dtype=np.int32)
    return SimpleNamespace(sequence_lengths=lengths, document_indices=bounds,
                           num_documents=len(bounds) - 1)


def _seconds(build, data, opts) -> tuple[float, np.ndarray]:
    start = time.perf_counter()
    out = build(data, opts)
    return time.perf_counter() - start, out


def compare(sentences: int, rounds: int, opts: BertOptions) -> dict:
    """Best-of-rounds ns per sentence of the baseline and the new builder on the same corpus."""
    data = synthetic_corpus(sentences)
    n = len(data.sequence_lengths)
    best = {"baseline": float("inf"), "new": float("inf")}
    for _ in range(rounds):
        for name, build in (("baseline", baseline_build_sample_map), ("new", build_sample_map)):
            seconds, out = _seconds(build, data, opts)
            best[name] = min(best[name], seconds)
    exact = BertOptions(max_seq_length=opts.max_seq_length, short_seq_prob=0.0, seed=opts.seed)
    same = np.array_equal(baseline_build_sample_map(data, exact), build_sample_map(data, exact))
    return {"sentences": n, "documents": data.num_documents, "samples": len(out),
            "baseline_ns_per_sentence": best["baseline"] / n * 1e9,
            "new_ns_per_sentence": best["new"] / n * 1e9, "speedup": best["baseline"] / best["new"],
            "same_map_at_short_seq_prob_0": bool(same)}


def large(sentences: int, opts: BertOptions) -> dict:
    """Time (plain run) and tracemalloc peak (second run) of the new builder alone."""
    data = synthetic_corpus(sentences, seed=1)
    n = len(data.sequence_lengths)
    seconds, out = _seconds(build_sample_map, data, opts)
    del out
    tracemalloc.start()
    out = build_sample_map(data, opts)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return {"sentences": n, "documents": data.num_documents, "samples": len(out),
            "seconds": seconds, "ns_per_sentence": seconds / n * 1e9,
            "traced_peak_bytes": peak, "output_bytes": out.nbytes,
            "input_bytes": data.sequence_lengths.nbytes + data.document_indices.nbytes}


def write_markdown(record: dict, path: Path) -> None:
    """A short table of the benchmark for results/."""
    m, c, big = record["machine"], record["compare"], record["large"]
    mib = 2**20
    at_paper = big["ns_per_sentence"] * 1.5e9 / 1e9
    lines = [
        "# BERT sample map: per-sentence loop vs vectorized builder", "",
        f"{record['date']}, git {record['git_sha']}, `{record['command']}`  ",
        f"{m['cpu']}, {m['usable_cores']} usable of {m['cores']} cores; numpy {record['numpy']}, "
        f"Python {m['python']}; best of {record['rounds']} alternating runs; 1-min load average "
        f"{record['load_average_1min_at_end']} at the end (a shared machine)", "",
        f"Synthetic documents (1-60 sentences, 3-50 tokens a sentence, fixed seed), "
        f"max_seq_length {record['max_seq_length']}, short_seq_prob {record['short_seq_prob']}.", "",
        "| builder | sentences | ns per sentence | speed-up |", "|---|---:|---:|---:|",
        f"| baseline: old per-sentence Python loop | {c['sentences']:,} | "
        f"{c['baseline_ns_per_sentence']:.1f} | 1.0 |",
        f"| vectorized `build_sample_map` | {c['sentences']:,} | {c['new_ns_per_sentence']:.1f} | "
        f"{c['speedup']:.1f}x |",
        f"| vectorized `build_sample_map` | {big['sentences']:,} | {big['ns_per_sentence']:.1f} | |",
        "",
        f"Same map as the baseline at short_seq_prob 0: {c['same_map_at_short_seq_prob_0']} (the "
        "random targets differ by design: hashed per sample instead of a sequential RNG).", "",
        f"{big['sentences']:,} sentences: {big['seconds']:.2f} s, {big['samples']:,} samples; peak "
        f"memory allocated by the builder (tracemalloc, second run, input of "
        f"{big['input_bytes'] / mib:.0f} MiB excluded) {big['traced_peak_bytes'] / mib:.0f} MiB, of "
        f"which the output is {big['output_bytes'] / mib:.0f} MiB. Process max RSS at the end "
        f"(everything, inputs included): {record['process_max_rss_bytes'] / mib:.0f} MiB. "
        f"Linear extrapolation to 1.5B sentences: {at_paper:.0f} s.",
    ]
    write_atomic(path, "\n".join(lines) + "\n")


def run(args: argparse.Namespace) -> dict:
    """Time both builders, then the new one at scale; write JSON and Markdown."""
    opts = BertOptions(max_seq_length=args.max_seq_length, short_seq_prob=args.short_seq_prob)
    compared, big = compare(args.sentences, args.rounds, opts), large(args.large, opts)
    record = {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.executable).name, "-m", "repro.data.bench_bert_map",
                             *sys.argv[1:]]),
        "git_sha": git_sha(("repro/data",)), "machine": machine(), "numpy": np.__version__,
        "rounds": args.rounds, "max_seq_length": args.max_seq_length,
        "short_seq_prob": args.short_seq_prob, "compare": compared, "large": big,
        "process_max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "load_average_1min_at_end": round(os.getloadavg()[0], 2),
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_atomic(out / "bert_sample_map.json", json.dumps(record, indent=2) + "\n")
    write_markdown(record, out / "bert_sample_map.md")
    return record


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sentences", type=int, default=1_500_000, help="for the comparison")
    parser.add_argument("--large", type=int, default=50_000_000, help="for the new builder alone")
    parser.add_argument("--rounds", type=int, default=3, help="best of this many runs each")
    parser.add_argument("--max-seq-length", type=int, default=512)
    parser.add_argument("--short-seq-prob", type=float, default=0.1)
    parser.add_argument("--out", default="results/bench")
    args = parser.parse_args(argv)
    record = run(args)
    print(Path(args.out, "bert_sample_map.md").read_text(encoding="utf-8"))
    return 0 if record["compare"]["same_map_at_short_seq_prob_0"] else 1


if __name__ == "__main__":
    sys.exit(main())
