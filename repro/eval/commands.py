"""`repro eval wikitext|lambada --checkpoint DIR`: the paper's zero-shot numbers, printed and tracked.

    repro eval wikitext --checkpoint runs/gpt-demo --window 128 --stride 128   # the make-demo model
    torchrun --nproc-per-node 4 .venv/bin/repro eval lambada --checkpoint CKPT --tp 2    # TP2 x DP2
"""

from __future__ import annotations

import shlex
import sys
import time
from dataclasses import dataclass, fields
from pathlib import Path

from repro.cli import UserError
from repro.eval.report import EvalRecord, format_table, log_to_mlflow, write_json

WIKITEXT_FILES = {"tokens": "wikitext/wikitext-2.test.tokens", "raw": "wikitext/wiki.test.raw"}
LAMBADA_FILE = "lambada/lambada_openai.test.jsonl"
PAPER_WIKITEXT = {"num_original_tokens": 245566, "num_bpe_tokens": 270329, "token_ratio": 1.1008}
PAPER_LAMBADA = {"num_examples": 5153}


@dataclass(frozen=True)
class EvalOptions:
    """Settings of one evaluation (also the MLflow params)."""

    data_dir: Path
    window: int = 1024
    stride: int = 32
    batch_size: int = 8
    wikitext_file: str = "tokens"
    strict: bool = True
    megatron_split: bool = False
    max_lines: int | None = None
    max_examples: int | None = None


def wikitext_path(data_dir: Path, choice: str) -> Path:
    """The test file: `tokens` or `raw` from the checked data dir, or a user's file (WikiText-103's own)."""
    from repro.data.fetch import data_path

    if choice in WIKITEXT_FILES:
        return data_path(data_dir, WIKITEXT_FILES[choice])
    path = Path(choice)
    if not path.is_file():
        raise UserError(f"--file {choice}: neither {' nor '.join(sorted(WIKITEXT_FILES))} nor an existing file. "
                        "Fix: pass `tokens`, `raw`, or the path of WikiText-103's wiki.test.tokens "
                        "(wikitext-103-v1.zip)")
    return path


def run_wikitext(model, pg, tokenizer, opts: EvalOptions) -> EvalRecord:
    """WikiText perplexity of `model` on the chosen test file (all ranks call it)."""
    from repro.eval.wikitext import evaluate_perplexity, load_wikitext

    data = load_wikitext(wikitext_path(opts.data_dir, opts.wikitext_file), tokenizer, opts.max_lines)
    start = time.perf_counter()
    result = evaluate_perplexity(model, pg, data, opts.window, opts.stride, opts.batch_size, tokenizer.eod)
    metrics = {**result.metrics(), "eval_seconds": time.perf_counter() - start}
    params = dict(window=opts.window, stride=opts.stride, file=Path(data.path).name, data_sha256=data.sha256,
                  max_lines=opts.max_lines or "all", tp=pg.tp_size, dp=pg.dp_size)
    return EvalRecord("wikitext", metrics, params, paper=PAPER_WIKITEXT)


def run_lambada(model, pg, tokenizer, opts: EvalOptions) -> EvalRecord:
    """LAMBADA accuracy of `model` on the full test set (all ranks call it)."""
    from repro.data.fetch import data_path, sha256_file
    from repro.eval.lambada import build_examples, evaluate_lambada, read_passages

    path = data_path(opts.data_dir, LAMBADA_FILE)
    passages = read_passages(path)[:opts.max_examples]
    examples = build_examples(passages, tokenizer, opts.strict, opts.megatron_split)
    start = time.perf_counter()
    result = evaluate_lambada(model, pg, examples, opts.batch_size, tokenizer.eod)
    metrics = {**result.metrics(), "eval_seconds": time.perf_counter() - start}
    params = dict(strict=opts.strict, megatron_split=opts.megatron_split, data_sha256=sha256_file(path),
                  max_examples=opts.max_examples or "all", tp=pg.tp_size, dp=pg.dp_size)
    return EvalRecord("lambada", metrics, params, paper=PAPER_LAMBADA)


def process_groups(tp: int, command: str = "eval ..."):
    """This launch's groups (TP of `tp`, the rest DP); one process without a launcher is serial."""
    from repro.parallel.groups import LayoutError, ProcessGroups, discover_launch_env, init_distributed

    if tp < 1:
        raise UserError(f"--tp {tp}: give a tensor-parallel size of 1 or more (1: no tensor parallelism)")
    if discover_launch_env().world_size > 1:  # torchrun, or srun with several tasks
        try:
            return init_distributed(tp)
        except LayoutError as err:  # raised before any process group is made
            raise UserError(f"--tp {tp}: {err}") from None
    if tp > 1:
        raise UserError(f"--tp {tp} needs {tp} ranks: launch with `torchrun --nproc-per-node {tp} "
                        f"$(which repro) {command}`")
    return ProcessGroups.single()


def default_eval_tp(ckpt: Path, meta: dict) -> int:
    """--tp when not given: the checkpoint's own TP where this launch's ranks are a multiple of it (its
    shards load as saved, and it fit in training), else the largest divisor of the world size that
    divides the model's heads (a 20-head model saved at TP 4, on 6 ranks: TP 2 x DP 3)."""
    from repro.parallel.groups import discover_launch_env
    from repro.train.checkpoint import model_config

    world, saved, heads = discover_launch_env().world_size, meta["tp"], model_config(ckpt, meta).num_attention_heads
    if world % saved == 0:
        return saved
    return max(t for t in range(1, world + 1) if world % t == 0 and heads % t == 0)


def gpt_checkpoint(path: Path, purpose: str = "zero-shot eval") -> Path:
    """The GPT checkpoint directory `path` names; a UserError for none or another family's."""
    from repro.train.checkpoint import CheckpointError, read_meta, resolve

    try:
        ckpt = resolve(path)
        family = read_meta(ckpt).get("family", "gpt")
    except CheckpointError as err:
        raise UserError(str(err)) from err
    if family != "gpt":
        raise UserError(f"{path} is a {family.upper()} checkpoint; {purpose} needs a GPT. "
                        f"BERT is evaluated by `repro finetune race --checkpoint {path} ...`")
    return ckpt


def _out_path(out: str | None, ckpt: Path) -> Path:
    """--out, else zero_shot.jsonl in the training run's directory; checked before evaluating."""
    from repro.provenance import unwritable_ancestor

    run_dir = ckpt.parent.parent if ckpt.parent.name == "checkpoints" else ckpt
    path = Path(out) if out else run_dir / "zero_shot.jsonl"
    if path.is_dir():
        raise UserError(f"--out {path} is a directory: give a file, e.g. --out {path / 'zero_shot.jsonl'}")
    parent = next(p for p in (path.absolute(), *path.absolute().parents) if p.exists())
    if parent != path.absolute() and not parent.is_dir():
        raise UserError(f"--out {path}: {parent} is a file, not a directory. Fix: give a path in a directory")
    blocked = unwritable_ancestor(path)
    if blocked is not None:
        raise UserError(f"--out {path}: {blocked} is not writable. Fix: give a writable path")
    _check_records_file(path)
    return path


def _check_records_file(path: Path) -> None:
    """A UserError for an --out holding anything but earlier evaluation records (notes, a config): the
    append would cut its last line. It is left as it is."""
    from repro.eval.report import check_appendable
    from repro.tracking.run_dir import TrackingError

    try:
        check_appendable(path, f"Fix: choose another --out (a new file, or the zero_shot.jsonl of earlier "
                               f"evaluations); {path} was left as it is")
    except TrackingError as err:
        raise UserError(f"--out {err}") from None


def _check_tracking(args) -> None:
    """A UserError for a bad MLFLOW_TRACKING_URI, before any scoring (unless --no-mlflow)."""
    from repro.tracking.run_dir import TrackingError
    from repro.tracking.sync import check_store

    if args.no_mlflow:
        return
    try:
        check_store()
    except TrackingError as err:
        raise UserError(f"{err}, or pass --no-mlflow to skip tracking") from None


def load_gpt(ckpt: Path, pg, device=None):
    """The model and its training run id, through the trainer's checkpoint module (on `device`, by
    default this launch's); a UserError for a checkpoint that cannot load, cannot be split at this
    --tp (one not dividing the heads), or has too few ids for GPT-2 BPE."""
    from repro.models.config import ConfigError
    from repro.parallel.groups import discover_launch_env
    from repro.train.checkpoint import CheckpointError, checkpoint_run_id
    from repro.train.reshard import load_model_for_eval

    device = device or discover_launch_env().device()
    try:
        model = load_model_for_eval(ckpt, pg, device).eval()
        _check_gpt2_vocabulary(ckpt, model.cfg.vocab_size)
        return model, checkpoint_run_id(ckpt)
    except CheckpointError as err:
        raise UserError(str(err)) from err
    except ConfigError as err:
        raise UserError(f"{ckpt} cannot load at --tp {pg.tp_size}: {err}") from None  # names the fix


def _check_gpt2_vocabulary(ckpt: Path, vocab_size: int) -> None:
    """A UserError for a GPT with fewer ids than GPT-2 BPE (one trained on a WordPiece corpus): its
    embedding would reject the text's ids, or generation decode its ids as other words. Checked
    after the load, so a damaged checkpoint is named first; a padded vocabulary (50,304, 51,200)
    holds them all."""
    from repro.models.sizes import GPT2_VOCAB

    if vocab_size < GPT2_VOCAB:
        raise UserError(f"checkpoint {ckpt} has model.vocab_size={vocab_size}, but zero-shot evaluation and "
                        f"generation tokenize with GPT-2 BPE ({GPT2_VOCAB} ids). Fix: use a GPT-2-vocabulary model "
                        f"(model.vocab_size >= {GPT2_VOCAB}, trained on data prepared with --tokenizer gpt2)")


POSITIVE_OPTIONS = {"batch_size": "e.g. --batch-size 8", "max_lines": "or leave it out for the whole file",
                    "max_examples": "or leave it out for all 5,153 passages"}
# The options of `repro eval` (argparse dests): the common ones, then each task's own, which the other
# task refuses. None or False in the parsed arguments: not given (EvalOptions holds the defaults).
COMMON_OPTIONS = ("checkpoint", "data_dir", "tp", "batch_size", "out", "no_mlflow")
TASK_OPTIONS = {"wikitext": ("window", "stride", "file", "max_lines"),
                "lambada": ("max_examples", "non_strict", "megatron_split")}
OPTION_FIELDS = {"window": "window", "stride": "stride", "batch_size": "batch_size", "file": "wikitext_file",
                 "max_lines": "max_lines", "max_examples": "max_examples", "megatron_split": "megatron_split"}


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def _given(args, dests) -> list[str]:
    """The options among `dests` given on the command line (a value other than None or False; 0 counts)."""
    return [dest for dest in dests if getattr(args, dest) is not None and getattr(args, dest) is not False]


def _check_task_options(args) -> None:
    """A UserError for an option of the other task (`eval lambada --window 32`): it would be ignored."""
    other = next(task for task in TASK_OPTIONS if task != args.task)
    wrong = [_flag(dest) for dest in _given(args, TASK_OPTIONS[other])]
    if wrong:
        names = ", ".join(wrong)
        raise UserError(f"{names} {'applies' if len(wrong) == 1 else 'apply'} to `repro eval {other}` only, "
                        f"not {args.task}. Fix: drop {names} from the `repro eval {args.task}` command")


def task_arguments(args) -> list[str]:
    """The given options that apply to args.task (the common ones, then its own), as arguments of
    `repro eval TASK`: the other task's are left out."""
    words: list[str] = []
    for dest in _given(args, COMMON_OPTIONS + TASK_OPTIONS[args.task]):
        value = getattr(args, dest)
        words.append(_flag(dest) if value is True else f"{_flag(dest)}={value}")  # (= keeps a value like -x.jsonl)
    return words


def _check_positive(args) -> None:
    """A UserError for --batch-size, --max-lines or --max-examples below 1 (None: not given)."""
    for key, hint in POSITIVE_OPTIONS.items():
        value = getattr(args, key)
        if value is not None and value < 1:
            raise UserError(f"{_flag(key)} {value} must be at least 1. Fix: give a positive number, {hint}")


def _options(args) -> EvalOptions:
    """The settings of this evaluation: the given options over EvalOptions' defaults (the paper's)."""
    from repro.data.fetch import data_dir_from_env

    _check_task_options(args)
    _check_positive(args)
    given = {OPTION_FIELDS[dest]: getattr(args, dest) for dest in _given(args, OPTION_FIELDS)}
    opts = EvalOptions(Path(args.data_dir) if args.data_dir else data_dir_from_env(), strict=not args.non_strict,
                       **given)
    if args.task == "wikitext" and (opts.stride < 1 or opts.window < opts.stride):  # LAMBADA has no window
        raise UserError(f"--stride {opts.stride} must be between 1 and --window {opts.window}. Fix: give 1 <= "
                        "--stride <= --window (the paper's: --window 1024 --stride 32; stride = window: no overlap)")
    return opts


def _handle(args) -> int:
    from repro.data.tokenizers import build_tokenizer
    from repro.train.checkpoint import read_meta, training_provenance

    if args.print_args:  # before any check: a job script asks this of one list for both tasks
        print(shlex.join(task_arguments(args)))
        return 0
    opts, ckpt = _options(args), gpt_checkpoint(Path(args.checkpoint))
    _check_tracking(args)
    meta = read_meta(ckpt)
    pg = process_groups(args.tp if args.tp is not None else default_eval_tp(ckpt, meta))
    out = _out_path(args.out, ckpt)
    model, run_id = load_gpt(ckpt, pg)
    runner = run_wikitext if args.task == "wikitext" else run_lambada
    try:
        record = runner(model, pg, build_tokenizer("gpt2", opts.data_dir), opts)
    except ValueError as err:
        raise UserError(str(err)) from err
    record.training_run_id, record.time = run_id, time.time()
    record.params["checkpoint"] = str(Path(args.checkpoint).resolve())
    record.params["checkpoint_iteration"] = meta.get("iteration", "?")  # a mid-training one ranks lower
    if meta.get("imported_from"):  # `repro checkpoint import-*` weights: no training run (even inside a run's dir)
        record.params.update(training_provenance(ckpt))  # imported_from, imported_with
        record.training_run_id = None
    if pg.rank == 0:
        print(format_table(record))
        write_json(record, out)
        run_id = None if args.no_mlflow else _log(record, out)
        if run_id:
            print(f"mlflow run {run_id} (experiment zero-shot)")
    return 0


def _log(record: EvalRecord, out: Path) -> str | None:
    """The MLflow run of the record; when the store fails, a warning (tracking is best effort, as in
    training: the record is saved in `out`, and a Slurm job goes on to its next evaluation step)."""
    from repro.tracking.run_dir import TrackingError

    try:
        return log_to_mlflow(record)
    except TrackingError as err:
        print(f"warning: {err}. The results are saved in {out}: once the store is reachable (start the server, "
              f"or set MLFLOW_TRACKING_URI), `repro tracking sync {out}` uploads them; --no-mlflow skips "
              "tracking", file=sys.stderr)
        return None


def _default(name: str):
    """EvalOptions' default of `name` (the paper's setting), for --help."""
    return next(f.default for f in fields(EvalOptions) if f.name == name)


def register(subparsers) -> None:
    """Add `repro eval wikitext|lambada`. Each task's own options (TASK_OPTIONS) are in its group of
    --help and refused by the other task; their defaults are None (not given), EvalOptions' apply."""
    parser = subparsers.add_parser("eval", help="zero-shot WikiText-103 perplexity and LAMBADA accuracy")
    parser.add_argument("task", choices=("wikitext", "lambada"))
    parser.add_argument("--checkpoint", required=True, help="checkpoint directory of a training run")
    parser.add_argument("--data-dir", default=None, help="data directory (default: $REPRO_DATA_DIR or ./data)")
    parser.add_argument("--tp", type=int, default=None,
                        help="tensor-parallel size, the rest of the world is DP [the checkpoint's own TP when the "
                             "ranks are a multiple of it, else the largest that divides the ranks and the heads]")
    parser.add_argument("--batch-size", type=int, default=None,
                        help=f"sequences per forward pass [{_default('batch_size')}]")
    parser.add_argument("--out", default=None,
                        help="JSON-lines file, appended to (default: zero_shot.jsonl in the training run's directory)")
    parser.add_argument("--no-mlflow", action="store_true", help="do not log to MLflow")
    parser.add_argument("--print-args", action="store_true",
                        help="print the given options that apply to TASK (the other task's left out), shell-quoted, "
                             "and exit: for job scripts that hold one list for both tasks (slurm/zeroshot_eval.sh)")
    wikitext = parser.add_argument_group("wikitext only (refused by lambada)")
    wikitext.add_argument("--window", type=int, default=None,
                          help=f"positions per scored window [{_default('window')}, the paper's]")
    wikitext.add_argument("--stride", type=int, default=None,
                          help=f"positions the window moves by [{_default('stride')}, the paper's; "
                               "= window: no overlap]")
    wikitext.add_argument("--file", default=None, metavar="tokens|raw|PATH",
                          help=f"[{_default('wikitext_file')}] `tokens` = WikiText-2's word-level test file (the "
                               "paper's T_o, more <unk>), `raw` = the raw text, or the path of WikiText-103's own "
                               "wiki.test.tokens (the paper's file: T = 270,329 BPE tokens)")
    wikitext.add_argument("--max-lines", type=int, default=None,
                          help="only the file's first N lines (T_o and T counted on them; quick checks)")
    lambada = parser.add_argument_group("lambada only (refused by wikitext)")
    lambada.add_argument("--max-examples", type=int, default=None,
                         help="only the first N passages (quick checks; the paper scores all 5,153)")
    lambada.add_argument("--non-strict", action="store_true", help="score the last BPE token only")
    lambada.add_argument("--megatron-split", action="store_true",
                         help="last word = text.split()[-1] (Megatron code) instead of the jsonl's")
    parser.set_defaults(func=_handle)
