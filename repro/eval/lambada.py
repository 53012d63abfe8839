"""LAMBADA zero-shot accuracy as the paper computes it (Appendix E).

Each passage is scored on its own (batched, right-padded: the model is causal, so padding after a
passage never changes its scores). Strict (the paper's): the example counts only if every BPE token
of the last word is the argmax under teacher forcing. Non-strict (option): only the passage's last
BPE token, with the rest of the passage, last word's first pieces included, as context.

The last word is the jsonl's `continuation` (OpenAI's file split at the last space, which is also
lm-evaluation-harness's `text.split(' ')[-1]`). Megatron-LM's code instead takes
`text.split()[-1]` (split at any whitespace); the two differ on 7 of the 5,153 passages, whose
continuation holds a newline ("of\\n\\nPower"). `megatron_split=True` uses Megatron's definition.

A passage longer than the model's seq_length + 1 tokens loses context tokens from the left (none
does at 1024; a short-context demo model truncates some); the count is reported.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from repro.eval.scoring import dp_share, dp_sum, max_positions, model_device, perplexity, score_positions
from repro.parallel.groups import ProcessGroups


@dataclass(frozen=True)
class Example:
    """Context token ids and target token ids (the scored ones)."""

    context: list[int]
    target: list[int]


@dataclass(frozen=True)
class ExampleScore:
    """Summed NLL of an example's target tokens, their count, and whether all were the argmax."""

    nll: float
    num_tokens: int
    correct: bool


def read_passages(path: Path | str) -> list[tuple[str, str]]:
    """(context, continuation) of every line of the LAMBADA jsonl."""
    lines = Path(path).read_text(encoding="utf-8").splitlines()
    return [(r["context"], r["continuation"]) for r in map(json.loads, filter(str.strip, lines))]


def megatron_resplit(context: str, continuation: str) -> tuple[str, str]:
    """Megatron-LM's split: the last word is text.split()[-1], the context the stripped rest."""
    text = f"{context} {continuation}"
    word = text.split()[-1]
    return text[:text.rfind(word)].strip(), word


def build_examples(passages: list[tuple[str, str]], tokenizer, strict: bool = True,
                   megatron_split: bool = False) -> list[Example]:
    """Token ids of every passage: strict targets the whole last word, non-strict its last token.
    `megatron_split` picks the last word as Megatron-LM's strict mode does; non-strict always scores
    the passage as written (so does Megatron's: a re-split would join a word across a line break)."""
    if not strict:
        whole = tokenizer.encode_batch([f"{c} {w}" for c, w in passages])
        return [Example(ids[:-1], ids[-1:]) for ids in whole]
    if megatron_split:
        passages = [megatron_resplit(c, w) for c, w in passages]
    contexts = tokenizer.encode_batch([c.strip() for c, _ in passages])
    targets = tokenizer.encode_batch([f" {w}" for _, w in passages])
    return [Example(c, t) for c, t in zip(contexts, targets)]


def _fit(example: Example, limit: int | None) -> tuple[list[int], int]:
    """The example's tokens cut from the left to at most limit + 1, and how many were cut."""
    seq = example.context + example.target
    if limit is None or len(seq) <= limit + 1:
        return seq, 0
    if len(example.target) > limit:
        raise ValueError(f"a target of {len(example.target)} tokens does not fit seq_length={limit}")
    return seq[len(seq) - limit - 1:], len(seq) - limit - 1


def _score_batch(model, tp_group, batch: list[Example], limit, pad_id: int) -> list[ExampleScore]:
    seqs = [_fit(e, limit)[0] for e in batch]
    s = max(len(q) for q in seqs) - 1
    ids = torch.full((len(batch), s), pad_id, dtype=torch.long)
    targets, keep = torch.full_like(ids, pad_id), torch.zeros_like(ids, dtype=torch.bool)
    for i, (q, e) in enumerate(zip(seqs, batch)):
        ids[i, :len(q) - 1], targets[i, :len(q) - 1] = torch.tensor(q[:-1]), torch.tensor(q[1:])
        keep[i, len(q) - 1 - len(e.target):len(q) - 1] = True
    device = model_device(model)
    nll, correct = score_positions(model, tp_group, ids.to(device), targets.to(device), keep.to(device))
    sizes = [len(e.target) for e in batch]
    return [ExampleScore(n.sum().item(), len(n), bool(c.all()))
            for n, c in zip(nll.cpu().split(sizes), correct.cpu().split(sizes))]


def score_examples(model, tp_group, examples: list[Example], batch_size: int = 16,
                   pad_id: int = 0, progress: bool = False) -> list[ExampleScore]:
    """Per-example scores in input order; batches group examples of similar length. `progress`: a bar
    on stderr over the examples."""
    from tqdm import tqdm

    if any(not e.context or not e.target for e in examples):
        raise ValueError("every example needs a non-empty context and target (prefix an eod token)")
    limit = max_positions(model)
    order = sorted(range(len(examples)), key=lambda i: len(examples[i].context) + len(examples[i].target))
    scores: list[ExampleScore | None] = [None] * len(examples)
    with tqdm(total=len(order), desc="lambada", unit="passage", disable=not progress) as bar:
        for b in range(0, len(order), batch_size):
            idx = order[b:b + batch_size]
            for i, score in zip(idx, _score_batch(model, tp_group, [examples[i] for i in idx], limit, pad_id)):
                scores[i] = score
            bar.update(len(idx))
    return scores  # type: ignore[return-value]


@dataclass(frozen=True)
class LambadaResult:
    """Counts and sums over the whole set (all DP ranks)."""

    num_examples: int
    num_correct: int
    sum_nll: float
    num_target_tokens: int
    num_truncated: int

    @property
    def accuracy(self) -> float:
        return self.num_correct / self.num_examples

    @property
    def target_ppl(self) -> float:
        """exp(mean NLL of the target tokens)."""
        return perplexity(self.sum_nll / self.num_target_tokens)

    def metrics(self) -> dict[str, float]:
        return dict(accuracy=self.accuracy, num_examples=self.num_examples, num_correct=self.num_correct,
                    target_ppl=self.target_ppl, sum_nll=self.sum_nll,
                    num_target_tokens=self.num_target_tokens, num_truncated=self.num_truncated)


def evaluate_lambada(model, pg: ProcessGroups, examples: list[Example], batch_size: int = 16,
                     pad_id: int = 0, progress: bool = True) -> LambadaResult:
    """Accuracy and target perplexity; examples split over DP ranks, sums all-reduced in float64.
    `progress`: a bar on stderr over rank 0's passages."""
    mine = dp_share(examples, pg)
    scores = score_examples(model, pg.tp_group, mine, batch_size, pad_id, progress=progress and pg.rank == 0)
    limit = max_positions(model)
    truncated = sum(_fit(e, limit)[1] > 0 for e in mine)
    totals = dp_sum([len(scores), sum(s.correct for s in scores), sum(s.nll for s in scores),
                     sum(s.num_tokens for s in scores), truncated], pg, model_device(model))
    n, correct, nll, tokens, cut = totals
    return LambadaResult(int(n), int(correct), nll, int(tokens), int(cut))
