"""WikiText-103 zero-shot perplexity as the paper computes it (Appendix E).

The word-level test text is detokenized, BPE-tokenized (T tokens) and scored with a sliding window
of `window` tokens moved forward `stride` tokens at a time; each window scores only the targets no
earlier window scored (the first window scores all of its targets), so every one of the T - 1
targets is scored once, with between window - stride and window tokens of context. Reported:

    word ppl (paper)   exp(sum NLL / T_o)          T_o = space-split count of the original file
    word ppl (2020)    exp(sum NLL / (T_o - 1))    Megatron-LM 2020 code's "adjusted ppl"
    token ppl          exp(sum NLL / (T - 1))
    token ratio        (T - 1) / (T_o - 1)         1.1008 in the paper

Cost: about (T - window) / stride windows of `window` tokens, ~8.4k for T = 270k at 1024/32.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from repro.data.fetch import sha256_file
from repro.eval.detokenize import count_original_tokens, wikitext_detokenize
from repro.eval.scoring import dp_share, dp_sum, max_positions, model_device, perplexity, score_positions
from repro.parallel.groups import ProcessGroups

PAPER_WINDOW = 1024
PAPER_STRIDE = 32


@dataclass(frozen=True)
class WikitextData:
    """A tokenized evaluation text and the counts the paper divides by."""

    tokens: list[int]
    num_original_tokens: int
    sha256: str = ""
    path: str = ""


def _read_utf8(path: Path) -> str:
    """The file's text; a DataError naming it when it cannot be read or is not UTF-8."""
    from repro.data.errors import DataError

    try:
        return path.read_bytes().decode("utf-8")
    except OSError as err:
        raise DataError(f"{path} cannot be read ({err.strerror or err}). Fix: give a WikiText file you can read "
                        "(--file tokens, raw, or the path of WikiText-103's wiki.test.tokens)") from None
    except UnicodeDecodeError as err:
        raise DataError(f"{path} is not UTF-8 text ({err.reason} at byte {err.start}). Fix: convert it "
                        "(e.g. `iconv -f latin1 -t utf-8`), or use WikiText-103's own wiki.test.tokens, "
                        "which is UTF-8") from None


def load_wikitext(path: Path | str, tokenizer, max_lines: int | None = None) -> WikitextData:
    """Read a WikiText file (or its first max_lines lines), count T_o, detokenize, BPE-tokenize."""
    text = _read_utf8(Path(path))
    if max_lines is not None:
        text = "".join(text.splitlines(keepends=True)[:max_lines])
    tokens, words = tokenizer.encode(wikitext_detokenize(text)), count_original_tokens(text)
    if len(tokens) < 2 or words < 2:  # every perplexity divides by T - 1 or T_o - 1
        from repro.data.errors import DataError

        lines = f"its first {max_lines} lines hold" if max_lines is not None else "it holds"
        raise DataError(f"{path}: {lines} {words} word(s) (T_o: tokens between single spaces, as in WikiText's "
                        f"word-level files) and {len(tokens)} BPE token(s); perplexity needs at least 2 of each. Fix: "
                        "give word-level text with spaces between words, such as wiki.test.tokens (or a larger "
                        "--max-lines)")
    return WikitextData(tokens, words, sha256_file(Path(path)), str(path))


@dataclass(frozen=True)
class Window:
    """Inputs tokens[start : start + length], targets shifted by one; positions >= first_scored count."""

    start: int
    length: int
    first_scored: int


def sliding_windows(num_tokens: int, window: int, stride: int) -> list[Window]:
    """The paper's windows over num_tokens tokens: every target 1..T-1 scored exactly once."""
    if num_tokens < 2:
        raise ValueError(f"need at least 2 tokens to score a target, got {num_tokens}")
    if not 1 <= stride <= window:
        raise ValueError(f"stride={stride} must be between 1 and window={window}")
    out, scored_until, start = [], 0, 0
    while scored_until < num_tokens - 1:
        end = min(start + window, num_tokens - 1)  # index of the window's last target
        out.append(Window(start, end - start, scored_until - start))
        scored_until, start = end, start + stride
    return out


@dataclass(frozen=True)
class PerplexityResult:
    """Summed NLL and the counts; the derived perplexities are properties."""

    sum_nll: float
    num_targets: int
    num_tokens: int
    num_original_tokens: int
    num_windows: int
    window: int
    stride: int

    @property
    def avg_token_loss(self) -> float:
        return self.sum_nll / self.num_targets

    @property
    def token_ppl(self) -> float:
        return perplexity(self.avg_token_loss)

    @property
    def word_ppl(self) -> float:
        """The paper's exp(sum NLL / T_o)."""
        return perplexity(self.sum_nll / self.num_original_tokens)

    @property
    def word_ppl_2020(self) -> float:
        """Megatron-LM 2020 code: exp(sum NLL / (T_o - 1))."""
        return perplexity(self.sum_nll / (self.num_original_tokens - 1))

    @property
    def token_ratio(self) -> float:
        return (self.num_tokens - 1) / (self.num_original_tokens - 1)

    def metrics(self) -> dict[str, float]:
        """Every number, flat, for the table, MLflow and JSON."""
        return dict(num_original_tokens=self.num_original_tokens, num_bpe_tokens=self.num_tokens,
                    num_targets=self.num_targets, num_windows=self.num_windows,
                    sum_nll=self.sum_nll, avg_token_loss=self.avg_token_loss,
                    token_ppl=self.token_ppl, word_ppl=self.word_ppl,
                    word_ppl_2020=self.word_ppl_2020, token_ratio=self.token_ratio)


def _batch_tensors(tokens: torch.Tensor, windows: list[Window], pad_id: int):
    """Right-padded inputs, targets and the scored-position mask (b, s) of a batch of windows."""
    s = max(w.length for w in windows)
    ids = torch.full((len(windows), s), pad_id, dtype=torch.long)
    targets = torch.full_like(ids, pad_id)
    keep = torch.zeros_like(ids, dtype=torch.bool)
    for i, w in enumerate(windows):
        ids[i, :w.length] = tokens[w.start:w.start + w.length]
        targets[i, :w.length] = tokens[w.start + 1:w.start + w.length + 1]
        keep[i, w.first_scored:w.length] = True
    return ids, targets, keep


def _check_window(model, window: int) -> None:
    limit = max_positions(model)
    if limit is not None and window > limit:
        raise ValueError(f"window={window} exceeds the model's seq_length={limit}: "
                         f"pass a window of at most {limit} (the paper's 1024 needs a 1024-position model)")


def evaluate_perplexity(model, pg: ProcessGroups, data: WikitextData, window: int = PAPER_WINDOW,
                        stride: int = PAPER_STRIDE, batch_size: int = 8, pad_id: int = 0,
                        progress: bool = True) -> PerplexityResult:
    """Sliding-window perplexity; windows split over DP ranks, float64 sums all-reduced. `progress`: a
    bar on stderr over rank 0's windows (the paper's protocol is ~8.4k windows: hours on a small GPU)."""
    from tqdm import tqdm

    _check_window(model, window)
    windows = sliding_windows(len(data.tokens), window, stride)
    mine = dp_share(windows, pg)
    device = model_device(model)
    tokens = torch.tensor(data.tokens, dtype=torch.long)
    sum_nll, count = torch.zeros((), dtype=torch.float64, device=device), 0  # summed on the device: no sync a batch
    with tqdm(total=len(mine), desc="wikitext", unit="window", disable=not progress or pg.rank != 0) as bar:
        for i in range(0, len(mine), batch_size):
            ids, targets, keep = _batch_tensors(tokens, mine[i:i + batch_size], pad_id)
            nll, _ = score_positions(model, pg.tp_group, ids.to(device), targets.to(device), keep.to(device))
            sum_nll, count = sum_nll + nll.double().sum(), count + nll.numel()
            bar.update(len(ids))
    sum_nll, count = dp_sum([sum_nll.item(), float(count)], pg, device)
    if int(count) != len(data.tokens) - 1:
        raise RuntimeError(f"scored {int(count)} targets, expected T - 1 = {len(data.tokens) - 1}")
    return PerplexityResult(sum_nll, int(count), len(data.tokens), data.num_original_tokens,
                            len(windows), window, stride)
