"""`repro generate`: text from a GPT checkpoint at any TP degree (greedy, temperature, top-k, top-p).

    repro generate --checkpoint runs/gpt-demo --prompt "The tower is" --max-new-tokens 40 --top-k 40
    torchrun --nproc-per-node 2 $(which repro) generate --checkpoint CKPT --tp 2 --greedy --prompt ...

Each new token runs the model over the last seq_length tokens (no KV cache: a tool for looking at a
model, not for serving), gathers the last position's vocab-parallel logits over the TP group (V
numbers) and draws from them in float64 on the CPU with a generator seeded alike on every rank, so
every TP rank draws the same token without a broadcast, and a seed gives the same text at any TP
degree and on any device (up to the last bits of the logits). An empty prompt samples
unconditionally, after the end-of-text token that separates training documents.
"""

from __future__ import annotations

import datetime
import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from repro.cli import UserError
from repro.eval.scoring import model_device
from repro.parallel.mappings import group_size


@dataclass(frozen=True)
class Sampling:
    """How each next token is chosen; temperature 0 is greedy (the most probable token)."""

    max_new_tokens: int = 64
    temperature: float = 1.0
    top_k: int = 0
    """keep the k most probable tokens (0: all)"""
    top_p: float = 1.0
    """keep the most probable tokens whose probabilities sum to top_p (1: all)"""
    seed: int = 1234

    def problems(self) -> list[str]:
        """What is wrong with these settings, each with its fix (empty when valid)."""
        found = []
        if self.max_new_tokens < 1:
            found.append(f"--max-new-tokens {self.max_new_tokens}: give 1 or more")
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):
            found.append(f"--temperature {self.temperature}: give 0 (greedy) or a positive number")
        if self.top_k < 0:
            found.append(f"--top-k {self.top_k}: give 0 (off) or a positive count")
        if not 0 < self.top_p <= 1:
            found.append(f"--top-p {self.top_p}: give a probability in (0, 1] (1: off)")
        if not -2**63 <= self.seed < 2**64:  # what torch.Generator.manual_seed takes
            found.append(f"--seed {self.seed}: give an integer in [0, 2**64), e.g. --seed 1234")
        return found


def filter_logits(logits: torch.Tensor, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """A copy of 1-D logits with the tokens outside the top-k and outside the nucleus at -inf.

    Top-k keeps every token tied with the k-th. The nucleus is the smallest set of most probable
    tokens whose probabilities reach top_p; the most probable token is always kept.
    """
    logits = logits.clone()
    if 0 < top_k < logits.numel():
        kth = torch.topk(logits, top_k).values[-1]
        logits[logits < kth] = float("-inf")
    if top_p < 1:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        mass_before = probs.cumsum(-1) - probs  # of the strictly more probable tokens
        logits[order[mass_before >= top_p]] = float("-inf")
    return logits


def choose(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator) -> int:
    """The next token from full next-token logits (V,) on the CPU."""
    if sampling.temperature == 0:
        return int(logits.argmax())  # ties: the lowest id
    logits = logits.double()  # the most probable at 0 first: a tiny temperature sends the rest to -inf, not nan
    kept = filter_logits((logits - logits.max()) / sampling.temperature, sampling.top_k, sampling.top_p)
    return int(torch.multinomial(kept.softmax(-1), 1, generator=generator))


def next_token_logits(model, ids: torch.Tensor, tp_group) -> torch.Tensor:
    """Float64 CPU logits (V,) over the real vocabulary after the last of `ids` (1, s); the same
    tensor on every TP rank (one all-gather of V/tp numbers)."""
    local = model.output_layer(model.hidden_states(ids)[:, -1])[0]  # (V/tp,)
    tp = group_size(tp_group)
    if tp > 1:
        shards = [torch.empty_like(local) for _ in range(tp)]
        dist.all_gather(shards, local.contiguous(), group=tp_group)
        local = torch.cat(shards)
    return local[:model.cfg.vocab_size].double().cpu()


@torch.no_grad()
def generate(model, tp_group, prompt: list[int], sampling: Sampling, eod: int,
             generator: torch.Generator, vocab_size: int | None = None) -> list[int]:
    """New token ids after `prompt` (empty: after end-of-text), stopping at end-of-text (not
    returned) or after sampling.max_new_tokens. The context is the last seq_length tokens.
    `vocab_size`: the tokenizer's; ids at or above it (a model's extra rows: 50,304 for GPT-2's
    50,257) are never drawn, as if their logits were -inf, since they would decode to nothing."""
    ids, device, window = list(prompt) or [eod], model_device(model), model.cfg.seq_length
    new: list[int] = []
    while len(new) < sampling.max_new_tokens:
        context = torch.tensor([(ids + new)[-window:]], device=device)
        token = choose(next_token_logits(model, context, tp_group)[:vocab_size], sampling, generator)
        if token == eod:
            break
        new.append(token)
    return new


SAMPLING_DEFAULTS = {"temperature": 1.0, "top_k": 0, "top_p": 1.0}  # (the options default to None: not given)


def _sampling(args) -> Sampling:
    _check_greedy(args)
    given = {key: getattr(args, key) for key in SAMPLING_DEFAULTS if getattr(args, key) is not None}
    settings = {**SAMPLING_DEFAULTS, **given, **({"temperature": 0.0} if args.greedy else {})}
    sampling = Sampling(args.max_new_tokens, seed=args.seed, **settings)
    problems = sampling.problems() + ([f"--num-samples {args.num_samples}: give 1 or more"]
                                      if args.num_samples < 1 else [])
    if problems:
        raise UserError("; ".join(problems))
    return sampling


def _check_greedy(args) -> None:
    """A UserError for --greedy with a sampling option, which greedy decoding would ignore."""
    given = [f"--{key.replace('_', '-')} {getattr(args, key)}" for key in SAMPLING_DEFAULTS
             if getattr(args, key) is not None]
    if args.greedy and given:
        raise UserError(f"--greedy takes the most probable token, so {' and '.join(given)} would be ignored. "
                        "Fix: leave out --greedy to sample, or leave out the sampling option(s)")


def _prompt(args) -> str:
    if args.prompt_file is None:
        return args.prompt or ""
    path = Path(args.prompt_file)
    if args.prompt is not None:
        raise UserError(f"--prompt and --prompt-file {path} both give the prompt. Fix: give only one of them")
    if not path.is_file():
        raise UserError(f"--prompt-file {path}: no such file. Fix: give a UTF-8 text file, or --prompt TEXT")
    from repro.tracking.run_dir import TrackingError, read_text

    try:
        return read_text(path, "Fix: give a readable UTF-8 text file, or --prompt TEXT")
    except TrackingError as err:
        raise UserError(f"--prompt-file {err}") from None


def _out_path(out: str | None, overwrite: bool = False) -> Path | None:
    """--out, checked before loading and sampling: a file this process can create, or replace with --overwrite."""
    from repro.provenance import unwritable_ancestor

    if out is None:
        return None
    path = Path(out)
    if path.is_dir():
        raise UserError(f"--out {path} is a directory: give a file, e.g. --out {path / 'samples.json'}")
    if not path.absolute().parent.is_dir():
        raise UserError(f"--out {path}: {path.absolute().parent} is not a directory. Fix: create it first")
    if (path.exists() or path.is_symlink()) and not overwrite:
        raise UserError(f"--out {path} already exists, and generate would replace it. Fix: give a new file, or "
                        "add --overwrite to replace it")
    blocked = unwritable_ancestor(path)
    if blocked is not None:
        raise UserError(f"--out {path}: {blocked} is not writable. Fix: give a writable path")
    return path


def _record(ckpt: Path, run_id: str | None, sampling: Sampling, tp: int, prompt: str,
            samples: list[dict]) -> dict:
    """What --out holds: the samples with the settings, checkpoint and code that made them."""
    from repro.provenance import git_sha
    from repro.train.checkpoint import read_meta

    return {"checkpoint": str(ckpt.resolve()), "iteration": read_meta(ckpt).get("iteration"),
            "training_run_id": run_id, "tp": tp, "sampling": asdict(sampling),
            "prompt": prompt, "samples": samples, "git_sha": git_sha(),
            "time_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def _handle(args) -> int:
    from repro.data.fetch import data_dir_from_env
    from repro.data.tokenizers import build_tokenizer
    from repro.eval.commands import gpt_checkpoint, load_gpt, process_groups
    from repro.provenance import write_atomic

    sampling, prompt, out = _sampling(args), _prompt(args), _out_path(args.out, args.overwrite)
    ckpt = gpt_checkpoint(Path(args.checkpoint), purpose="generation")
    pg = process_groups(args.tp, "generate ...")
    if pg.dp_size > 1:
        raise UserError(f"generate runs tensor parallel only: launch exactly --tp {args.tp} ranks, "
                        f"not {pg.world_size}")
    tokenizer = build_tokenizer("gpt2", Path(args.data_dir) if args.data_dir else data_dir_from_env())
    model, run_id = load_gpt(ckpt, pg)
    generator, samples = torch.Generator().manual_seed(sampling.seed), []
    for i in range(args.num_samples):
        tokens = generate(model, pg.tp_group, tokenizer.encode(prompt), sampling, tokenizer.eod, generator,
                          tokenizer.vocab_size)
        text = tokenizer.decode(tokens)
        stop = "max_new_tokens" if len(tokens) == sampling.max_new_tokens else "end_of_text"
        samples.append({"text": text, "tokens": tokens, "stopped_at": stop})
        if pg.rank == 0:
            print(f"=== sample {i + 1}/{args.num_samples} ({len(tokens)} tokens, stopped at {stop}) ===")
            print(prompt + text, flush=True)
    if pg.rank == 0 and out is not None:
        try:
            write_atomic(out, json.dumps(_record(ckpt, run_id, sampling, pg.tp_size, prompt, samples), indent=2))
        except OSError as err:  # checked before sampling; changed since
            raise UserError(f"--out {out}: cannot write it ({err.strerror or err}); the samples are printed "
                            "above. Fix: give a writable path") from None
        print(f"wrote {out}")
    return 0


def register(subparsers) -> None:
    """Add `repro generate`."""
    parser = subparsers.add_parser("generate", help="sample text from a GPT checkpoint (greedy, top-k, top-p)")
    parser.add_argument("--checkpoint", required=True, help="checkpoint directory of a GPT training run")
    parser.add_argument("--prompt", default=None, help="text to continue (default: none, unconditional: from the end-of-document token; a "
                             "spelled-out '<|endoftext|>' is text, not that token)")
    parser.add_argument("--prompt-file", default=None, help="read the prompt from this UTF-8 file (not with --prompt)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=None, help="0 = greedy [1.0]")
    parser.add_argument("--top-k", type=int, default=None, help="sample among the k most probable tokens [0: off]")
    parser.add_argument("--top-p", type=float, default=None, help="nucleus sampling mass [1: off]")
    parser.add_argument("--greedy", action="store_true",
                        help="always the most probable token (not with --temperature, --top-k or --top-p)")
    parser.add_argument("--num-samples", type=int, default=1)
    parser.add_argument("--seed", type=int, default=1234, help="the same seed gives the same text")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size (launch this many ranks)")
    parser.add_argument("--data-dir", default=None, help="data directory with the GPT-2 vocabulary "
                                                         "(default: $REPRO_DATA_DIR or ./data)")
    parser.add_argument("--out", default=None, help="also write the samples and settings to this JSON file "
                                                    "(an existing file is refused unless --overwrite)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --out file")
    parser.set_defaults(func=_handle)
