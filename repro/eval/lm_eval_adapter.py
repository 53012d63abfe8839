"""The project's GPT as an lm-evaluation-harness model, registered as "megatron-repro".

lm-eval has no plugin entry point, so the class registers when this module is imported; run the
harness through this module (same arguments as `lm_eval`):

    python -m repro.eval.lm_eval_adapter --model megatron-repro \\
        --model_args checkpoint=runs/gpt-demo,data_dir=data --tasks wikitext,lambada_openai

Offline, use the local task YAMLs in repro/eval/tasks (`--include_path repro/eval/tasks --tasks
lambada_openai_local`). A checkpoint of any TP degree is merged to TP=1 on load.

Loglikelihood splits the tokens of context + continuation after the context's own tokens, as
lm-eval's Hugging Face model does, and scores them exactly as `repro eval lambada` does (same
batching code), so lm-eval's lambada `acc` equals the strict accuracy (on LAMBADA the split gives
the last word's own tokens in all 5,153 passages). Rolling loglikelihood uses lm-eval's own windows (`get_rolling_token_windows` with the
end-of-text prefix, then `make_disjoint_window`), as lm-eval's Hugging Face model does: each window
of the model's seq_length predicts the next seq_length tokens, and the last one takes a full
window of context. `rolling_stride=S` predicts S tokens a window instead (context_len = L - S + 1).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from repro.cli import UserError
from repro.eval.lambada import Example, score_examples
from repro.eval.scoring import model_device, vocab_parallel_argmax
from repro.parallel.groups import ProcessGroups


def _as_int(value, default: int) -> int:
    """lm-eval passes batch sizes as int, numeric string or 'auto'."""
    try:
        return int(value)
    except (TypeError, ValueError):
        return default


@register_model("megatron-repro")
class MegatronReproLM(LM):
    """loglikelihood, loglikelihood_rolling and greedy generate_until on one process (TP=1)."""

    def __init__(self, checkpoint: str | None = None, data_dir: str | None = None, batch_size=8,
                 device: str | None = None, rolling_stride=None, max_gen_toks=64,
                 model=None, tokenizer=None, **_ignored) -> None:
        super().__init__()
        self.model = model if model is not None else _load_checkpoint(checkpoint, device)
        self.tokenizer = tokenizer if tokenizer is not None else _gpt2_tokenizer(data_dir)
        self.batch_size_per_call = _as_int(batch_size, 8)
        self.max_length = self.model.cfg.seq_length
        self.rolling_stride = _as_int(rolling_stride, self.max_length)
        if self.rolling_stride < 1:
            raise ValueError(f"rolling_stride={rolling_stride}: give a positive number of tokens per window")
        self.max_gen_toks = _as_int(max_gen_toks, 64)

    def _encode_pair(self, context: str, continuation: str) -> Example:
        """As lm-eval's Hugging Face model: trailing spaces of the context move to the continuation,
        whose tokens are those of context + continuation after the context's own tokens (they differ
        from the continuation's alone where no space separates the two, e.g. "foo" + "bar"); an empty
        context is the end-of-text token."""
        n_spaces = len(context) - len(context.rstrip())
        if n_spaces:
            context, continuation = context[:-n_spaces], context[-n_spaces:] + continuation
        ctx = self.tokenizer.encode(context) if context else []
        if not ctx:
            return Example([self.tokenizer.eod], self.tokenizer.encode(continuation))
        target = self.tokenizer.encode(context + continuation)[len(ctx):]
        return Example(ctx, target or self.tokenizer.encode(continuation))  # never an empty target

    def loglikelihood(self, requests) -> list[tuple[float, bool]]:
        """(sum log p(continuation | context), continuation is the greedy output) per request."""
        examples = [self._encode_pair(*req.args) for req in requests]
        scores = score_examples(self.model, None, examples, self.batch_size_per_call, self.tokenizer.eod)
        return [(-s.nll, s.correct) for s in scores]

    def loglikelihood_rolling(self, requests) -> list[float]:
        """Sum log p of every token of each string, the first conditioned on end-of-text (0.0 for "")."""
        owners, examples = [], []
        for i, req in enumerate(requests):
            for ctx, cont in self._rolling_windows(req.args[0]):
                owners.append(i)
                examples.append(Example(ctx, cont))
        scores = score_examples(self.model, None, examples, self.batch_size_per_call, self.tokenizer.eod)
        out = [0.0] * len(requests)
        for i, score in zip(owners, scores):
            out[i] -= score.nll
        return out

    def _rolling_windows(self, text: str) -> list[tuple[list[int], list[int]]]:
        """lm-eval's (context, continuation) windows of a string, context and continuation disjoint."""
        context_len = self.max_length - min(self.rolling_stride, self.max_length) + 1
        windows = get_rolling_token_windows(self.tokenizer.encode(text), self.tokenizer.eod, self.max_length,
                                            context_len)
        return [make_disjoint_window(w) for w in windows]

    def generate_until(self, requests) -> list[str]:
        """Greedy continuation of each context until a stop string or max_gen_toks tokens."""
        return [self._greedy(context, dict(kwargs or {})) for context, kwargs in (r.args for r in requests)]

    @torch.no_grad()
    def _greedy(self, context: str, kwargs: dict) -> str:
        until = kwargs.get("until") or [self.tokenizer.decode([self.tokenizer.eod])]
        until = [until] if isinstance(until, str) else list(until)
        ids = self.tokenizer.encode(context) or [self.tokenizer.eod]
        new: list[int] = []
        for _ in range(_as_int(kwargs.get("max_gen_toks"), self.max_gen_toks)):
            window = torch.tensor([(ids + new)[-self.max_length:]], device=model_device(self.model))
            token = int(vocab_parallel_argmax(self.model(window)[0, -1], None))
            if token == self.tokenizer.eod:
                break
            new.append(token)
            text = self.tokenizer.decode(new)
            if any(stop in text for stop in until):
                break
        text = self.tokenizer.decode(new)
        cut = min((text.index(s) for s in until if s in text), default=len(text))
        return text[:cut]


def _load_checkpoint(checkpoint: str | None, device: str | None):
    if not checkpoint:
        raise ValueError("megatron-repro needs --model_args checkpoint=DIR (a training run's checkpoint)")
    from repro.eval.commands import load_gpt

    if not device or device == "auto" or (device.startswith("cuda") and not torch.cuda.is_available()):
        device = "cuda" if torch.cuda.is_available() else "cpu"  # lm-eval's default --device is cuda
    return load_gpt(Path(checkpoint), ProcessGroups.single(), torch.device(device))[0]


def _gpt2_tokenizer(data_dir: str | None):
    from repro.data.fetch import data_dir_from_env
    from repro.data.tokenizers import build_tokenizer

    return build_tokenizer("gpt2", data_dir or data_dir_from_env())


def main() -> None:
    """`repro-lm-eval ...`: lm-eval's own command line with the `megatron-repro` model registered."""
    from lm_eval.__main__ import cli_evaluate

    try:
        cli_evaluate()
    except UserError as err:  # as `repro` prints it: the problem and its fix, no traceback
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
