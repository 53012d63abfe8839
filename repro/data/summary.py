"""`repro data inspect`: what a prepared dataset holds, before a long run trains on it.

    repro data inspect data/corpus                       # its _train/_valid/_test: counts, lengths, a preview
    repro data inspect --config experiments/gpt2/gpt2_8.3b.yaml   # + samples and epochs of that run

Per split: documents, sequences (BERT: sentences), tokens, tokens per document (mean, median, 99th
percentile, max), computed from the index alone (memory-mapped; no token is read except the
previewed documents). With a sequence length and global batch (from --config, or given), a GPT
corpus also gets its samples and iterations per epoch, and a config the number of epochs its
train_iters make; the paper's GPT-2 runs did 300k iterations of 512 x 1024 tokens at 68,507
iterations per epoch (4.38 epochs of a 35.9B-token corpus).
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from repro.data.errors import DataError
from repro.data.gpt_dataset import samples_per_epoch
from repro.data.indexed_dataset import IndexedDataset
from repro.data.prepare_checks import base_prefix, is_output_prefix
from repro.data.preprocess import SPLIT_NAMES

PAPER_ITERS_PER_EPOCH = 68_507  # GPT-2 runs: global batch 512, seq 1024 (PAPER.md §3)


@dataclass(frozen=True)
class SplitSummary:
    """Counts of one indexed dataset (PREFIX.bin/.idx)."""

    prefix: str
    documents: int
    sequences: int
    tokens: int
    doc_tokens_mean: float
    doc_tokens_median: float
    doc_tokens_p99: float
    doc_tokens_max: int


def document_lengths(data: IndexedDataset) -> np.ndarray:
    """Tokens of each document from the memory-mapped sequence pointers: O(documents) memory, not
    O(sentences) (a BERT corpus at the paper's scale has ~1.5B of them)."""
    bounds = np.asarray(data.document_indices, dtype=np.int64)
    pointers, end = data.sequence_pointers, data.num_tokens * np.dtype(data.dtype).itemsize
    if len(pointers) == 0:
        return np.zeros(len(bounds) - 1, dtype=np.int64)
    at = np.where(bounds < len(pointers), pointers[np.minimum(bounds, len(pointers) - 1)], end)
    return np.diff(at) // np.dtype(data.dtype).itemsize


def summarize(prefix: str | Path) -> SplitSummary:
    """Counts and document-length statistics of one indexed dataset, from its index alone."""
    data = IndexedDataset(prefix)
    per_doc = document_lengths(data)
    stats = (float(per_doc.mean()), float(np.median(per_doc)), float(np.percentile(per_doc, 99)),
             int(per_doc.max())) if len(per_doc) else (0.0, 0.0, 0.0, 0)
    return SplitSummary(str(prefix), data.num_documents, len(data), data.num_tokens, *stats)


def split_prefixes(prefix: str | Path) -> list[str]:
    """PREFIX itself when it is a dataset, else its existing PREFIX_{train,valid,test}; prepare's
    --output-prefix (PREFIX_prepare.json there) is never taken for a split of another dataset."""
    if Path(f"{prefix}.idx").exists() and not is_output_prefix(prefix):
        return [str(prefix)]
    found = [f"{prefix}_{name}" for name in SPLIT_NAMES if Path(f"{prefix}_{name}.idx").exists()]
    if not found:
        raise DataError(f"{prefix}: no {prefix}.idx nor {prefix}_train.idx. Fix: give the --output-prefix "
                        "of `repro data prepare`, or one of its PREFIX_train/_valid/_test")
    return found


def gpt_epoch(tokens: int, seq_length: int, global_batch: int) -> tuple[int, int]:
    """(samples, iterations) per epoch of a GPT corpus, by GPTDataset's rule."""
    samples = samples_per_epoch(tokens, seq_length)
    return samples, samples // global_batch


def prepare_report(prefix: str | Path) -> dict | None:
    """The PREFIX_prepare.json `repro data prepare` wrote beside the splits, if any (an unreadable
    one is skipped with a warning: the datasets themselves are what counts)."""
    path = Path(f"{base_prefix(prefix)}_prepare.json")
    if not path.is_file():
        return None
    try:
        report = json.loads(path.read_text())
        report["report"]["kept"]
        return report
    except (OSError, ValueError, KeyError, TypeError) as err:
        warnings.warn(f"{path}: not a readable prepare report ({err}); skipped", stacklevel=2)
        return None


def format_summaries(rows: list[SplitSummary]) -> str:
    """A table of split summaries."""
    head = f"{'dataset':<40} {'documents':>12} {'sequences':>13} {'tokens':>16}  tokens/doc mean / median / p99 / max"
    lines = [head]
    for r in rows:
        lines.append(f"{r.prefix:<40} {r.documents:>12,} {r.sequences:>13,} {r.tokens:>16,}  "
                     f"{r.doc_tokens_mean:,.0f} / {r.doc_tokens_median:,.0f} / {r.doc_tokens_p99:,.0f} / "
                     f"{r.doc_tokens_max:,}")
    return "\n".join(lines)


def format_epochs(tokens: int, seq_length: int, global_batch: int, train_iters: int | None) -> str:
    """Samples and iterations per epoch of a GPT training split, and the epochs train_iters make."""
    samples, iters = gpt_epoch(tokens, seq_length, global_batch)
    text = (f"GPT, seq {seq_length}, global batch {global_batch}: {samples:,} samples = {iters:,} iterations "
            f"per epoch (the paper's GPT-2 corpus: {PAPER_ITERS_PER_EPOCH:,})")
    if train_iters is not None and samples:
        text += f"; {train_iters:,} iterations = {train_iters * global_batch / samples:.2f} epochs"
    return text


def preview(prefix: str, tokenizer, documents: int, chars: int) -> list[str]:
    """The first `chars` characters of the first `documents` documents, decoded."""
    data = IndexedDataset(prefix)
    out = []
    for d in range(min(documents, data.num_documents)):
        text = tokenizer.decode(data.document_tokens(d)[: 4 * chars])
        out.append(text[:chars].replace("\n", "\\n"))
    return out
