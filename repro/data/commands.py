"""`repro data fetch` and `repro data prepare`: argparse wiring only; the work is in fetch/preprocess."""

from __future__ import annotations

import argparse
import itertools
from pathlib import Path

from repro.data.documents import LAYOUTS
from repro.data.fetch import DEFAULT_DATA_DIR
from repro.train.signals import exiting_on_stop_signals


def _fetch(args: argparse.Namespace) -> int:
    from repro.data.fetch import FetchOptions, data_dir_from_env, fetch, mirror_from_env

    data_dir = Path(args.data_dir) if args.data_dir else data_dir_from_env()
    mirror = Path(args.mirror) if args.mirror else mirror_from_env()
    done = fetch(FetchOptions(data_dir=data_dir, mirror=mirror, only=tuple(args.only or ())))
    for path, action in done.items():
        print(f"{action:>20}  {data_dir / path}")
    print(f"{len(done)} files in {data_dir}, sha256 verified")
    return 0


def _eval_files(names: str) -> tuple[str, ...]:
    """The eval-set files of --eval-sets' comma-separated names."""
    from repro.cli import UserError
    from repro.data.filters import EVAL_SETS

    chosen = [n.strip() for n in names.split(",") if n.strip()]
    unknown = [n for n in chosen if n not in EVAL_SETS]
    if unknown or not chosen:
        raise UserError(f"--eval-sets {names!r} names no eval set{f' ({unknown[0]!r} is none)' if unknown else ''}. "
                        f"Fix: a comma-separated list of {', '.join(EVAL_SETS)} (wikitext alone is the "
                        "paper's filter), or --no-eval-filter to keep overlaps")
    return tuple(EVAL_SETS[n] for n in dict.fromkeys(chosen))


def _prepare(args: argparse.Namespace) -> int:
    from repro.data.fetch import data_dir_from_env
    from repro.data.filters import FilterOptions
    from repro.cli import UserError
    from repro.data.preprocess import PrepareOptions, prepare

    if not 0 < args.dedup_threshold <= 1:
        raise UserError(f"--dedup-threshold {args.dedup_threshold} is not a Jaccard similarity in (0, 1]. "
                        "Fix: e.g. --dedup-threshold 0.7 (the default), or --no-dedup")
    if args.min_tokens < 0:
        raise UserError(f"--min-tokens {args.min_tokens} is negative. Fix: 0 keeps every document, 128 (the "
                        "default) drops those under 128 tokens")
    if args.eval_min_matches < 1:
        raise UserError(f"--eval-min-matches {args.eval_min_matches} would mark every document an eval overlap. "
                        "Fix: a count of at least 1 (default 10), or --no-eval-filter to keep overlaps")
    filters = FilterOptions(min_tokens=args.min_tokens, dedup=not args.no_dedup,
                            dedup_threshold=args.dedup_threshold,
                            eval_overlap=not args.no_eval_filter, min_matches=args.eval_min_matches,
                            eval_files=_eval_files(args.eval_sets))
    opts = PrepareOptions(
        input=tuple(Path(x) for x in args.input), output_prefix=args.output_prefix, tokenizer=args.tokenizer,
        data_dir=Path(args.data_dir) if args.data_dir else data_dir_from_env(),
        input_format=args.format, json_key=args.json_key,
        layout=args.layout, split=args.split, filters=filters, progress=not args.no_progress,
        overwrite=args.overwrite, skip_bad_records=args.skip_bad_records, split_order=args.split_order,
        split_seed=args.split_seed,
        **({"workers": args.workers} if args.workers is not None else {}))
    with exiting_on_stop_signals():  # Slurm's warning, time limit or scancel: clean up, exit
        report = prepare(opts)
    print(f"documents {report.documents}: kept {report.kept}, under {filters.min_tokens} tokens "
          f"{report.too_short}, eval overlap {report.eval_overlap}, near-duplicates "
          f"{report.near_duplicates}")
    print(f"tokens read {report.tokens_read:,} in {report.seconds:.1f} s = "
          f"{report.tokens_per_s:,.0f} tokens/s; written {report.tokens_written:,}")
    if report.skipped_records:
        print(f"skipped {report.skipped_records} JSON lines without text, e.g. {report.skipped_examples[0]} "
              f"(the first {len(report.skipped_examples)} are in the report)")
    if len(report.inputs) > 1:
        for path, count in itertools.islice(report.inputs.items(), 20):
            print(f"  {path}: kept {count['kept']:,} of {count['documents']:,} documents")
        if len(report.inputs) > 20:
            print(f"  ... and {len(report.inputs) - 20} more input files (each in {args.output_prefix}_prepare.json)")
    for prefix, docs in report.outputs.items():
        print(f"  {prefix}.bin/.idx  {docs} documents")
    return 0


def _add_prepare(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("prepare", help="tokenize, filter and split text into indexed datasets")
    p.add_argument("--input", required=True, nargs="+", metavar="PATH",
                   help="JSON lines with a 'text' key, or plain text (gzip too); several files or directories "
                        "(their .jsonl/.json/.txt/.text/.tokens/.raw files and .gz, recursively, sorted) are one "
                        "corpus, deduplicated across them")
    p.add_argument("--output-prefix", required=True, help="writes PREFIX_{train,valid,test}")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an existing dataset at PREFIX (swapped in only once complete)")
    p.add_argument("--tokenizer", choices=("gpt2", "bert"), default="gpt2")
    p.add_argument("--data-dir", help=f"vocab and eval sets (REPRO_DATA_DIR, {DEFAULT_DATA_DIR})")
    p.add_argument("--workers", type=int, default=None,
                   help="tokenizing processes (default: every CPU this process may use)")
    p.add_argument("--format", choices=("auto", "jsonl", "text"), default="auto",
                   help="auto: .json/.jsonl files are JSON lines; .txt/.text/.tokens/.raw files and every file "
                        "of --layout file are plain text; any other file by its first line")
    p.add_argument("--json-key", default="text")
    p.add_argument("--skip-bad-records", action="store_true",
                   help="skip JSON lines without text (malformed, no --json-key, not a string), counted "
                        "in the report, instead of stopping at the first")
    p.add_argument("--layout", choices=LAYOUTS, default="auto",
                   help="plain text: WikiText articles, blank-line paragraphs, each whole file (one page per "
                        "file, as extracted OpenWebText), or the text between <|endoftext|> markers "
                        "(TinyStories) as documents; auto: endoftext when one of the first 200 lines is the marker alone, "
                        "else wikitext when they hold a ' = Title = ' heading, else paragraph")
    p.add_argument("--split", default="949,50,1", help="train,valid,test weights over documents")
    p.add_argument("--split-order", choices=("file", "random"), default="file",
                   help="file: contiguous ranges in file order (Megatron's); random: a seeded random set "
                        "of documents per split (valid/test from every source of a concatenated file)")
    p.add_argument("--split-seed", type=int, default=1234)
    p.add_argument("--min-tokens", type=int, default=128)
    p.add_argument("--no-dedup", action="store_true", help="skip MinHash LSH near-dup removal")
    p.add_argument("--dedup-threshold", type=float, default=0.7)
    p.add_argument("--no-eval-filter", action="store_true", help="keep eval-set overlaps")
    p.add_argument("--eval-sets", default="wikitext,lambada",
                   help="eval test sets whose overlaps are dropped: wikitext (the paper's WikiText-103 test "
                        "articles) and lambada (this project's addition)")
    p.add_argument("--eval-min-matches", type=int, default=10,
                   help="shared 8-grams that make a document overlap an eval set")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=_prepare)


def _config_data_missing(config: str, train_prefix: str) -> str:
    """The error for a config whose training split is not there, with the command that writes it."""
    base = train_prefix[:-len("_train")] if train_prefix.endswith("_train") else train_prefix
    return (f"{config}: its data.train_prefix {train_prefix} has no {train_prefix}.idx. Fix: prepare the corpus "
            f"with `repro data prepare --input CORPUS --output-prefix {base}` (it writes {base}_train/_valid/_test), "
            "or set REPRO_DATA_DIR (the paper configs read their data from it) to where it was prepared")


def _inspect(args: argparse.Namespace) -> int:
    from repro.cli import UserError
    from repro.data import summary as S
    from repro.data.fetch import data_dir_from_env

    for option, value, least in (("--seq-length", args.seq_length, 1), ("--global-batch", args.global_batch, 1),
                                 ("--show", args.show, 0), ("--chars", args.chars, 1)):
        if value is not None and value < least:
            raise UserError(f"{option} {value} must be at least {least}. Fix: give {least} or more, or leave it out")
    seq_length, global_batch, train_iters, family = args.seq_length, args.global_batch, None, args.tokenizer
    prefix = args.prefix
    if args.config:
        from repro.train.config import RunConfigError, load_config

        try:
            cfg = load_config(args.config)
        except (RunConfigError, OSError) as err:
            raise UserError(str(err)) from None
        if not prefix and not cfg.data.train_prefix:
            raise UserError(f"{args.config} sets no data.train_prefix: there is no dataset to inspect. Fix: give the "
                            "dataset PREFIX (`repro data inspect PREFIX --config CONFIG`), or set data.train_prefix "
                            "in the config")
        if not prefix and not Path(f"{cfg.data.train_prefix}.idx").exists():
            raise UserError(_config_data_missing(args.config, cfg.data.train_prefix))
        prefix = prefix or cfg.data.train_prefix
        seq_length, global_batch = seq_length or cfg.model.seq_length, global_batch or cfg.train.global_batch_size
        train_iters, family = cfg.train.train_iters, "bert" if cfg.family == "bert" else "gpt2"
    if not prefix:
        raise UserError("give a dataset PREFIX, or --config CONFIG whose data.train_prefix names one")
    rows = [S.summarize(p) for p in S.split_prefixes(prefix)]
    print(S.format_summaries(rows))
    report = S.prepare_report(rows[0].prefix)
    family = family or (report or {}).get("options", {}).get("tokenizer") or "gpt2"
    if report:
        r = report["report"]
        given = report["options"].get("input")
        given = given if isinstance(given, list) else [given]
        source = ", ".join(map(str, given)) if len(given) <= 3 else f"{len(given)} inputs ({given[0]}, ...)"
        print(f"prepared from {source}: kept {r['kept']:,} of {r['documents']:,} documents "
              f"({r['too_short']:,} short, {r['eval_overlap']:,} eval overlap, {r['near_duplicates']:,} near-duplicates)")
    train = next((r for r in rows if r.prefix.endswith("_train")), rows[0])
    if seq_length and global_batch and family == "gpt2":
        print(S.format_epochs(train.tokens, seq_length, global_batch, train_iters))
    elif seq_length and global_batch:
        print("BERT: samples per epoch depend on how sentences pack into samples (built when training starts); not computed here")
    if args.show:
        from repro.data.tokenizers import build_tokenizer

        tokenizer = build_tokenizer(family, Path(args.data_dir) if args.data_dir else data_dir_from_env())
        for number, text in enumerate(S.preview(train.prefix, tokenizer, args.show, args.chars)):
            print(f"[{train.prefix} document {number}] {text}")
    return 0


def _add_inspect(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("inspect", help="counts, lengths, epochs and a decoded preview of a prepared dataset")
    p.add_argument("prefix", nargs="?", help="prepare's --output-prefix, or one PREFIX_train/_valid/_test")
    p.add_argument("--config", help="a training config: its data.train_prefix, seq length, batch and iterations")
    p.add_argument("--tokenizer", choices=("gpt2", "bert"), default=None,
                   help="to decode the preview (default: the one prepare used, from PREFIX_prepare.json)")
    p.add_argument("--data-dir", help=f"vocabularies (REPRO_DATA_DIR, {DEFAULT_DATA_DIR})")
    p.add_argument("--seq-length", type=int, default=None, help="GPT: samples per epoch at this length")
    p.add_argument("--global-batch", type=int, default=None, help="GPT: iterations per epoch at this batch")
    p.add_argument("--show", type=int, default=2, help="decoded documents to preview (0: none)")
    p.add_argument("--chars", type=int, default=200, help="characters of each previewed document")
    p.set_defaults(func=_inspect)


def _verify(args: argparse.Namespace) -> int:
    from repro.data.verify import verify

    for path, status in verify(args.prefix, progress=True):
        print(f"{status:>8}  {path}")
    print(f"{args.prefix}: every split file is what `repro data prepare` wrote (sha256)")
    return 0


def _add_verify(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("verify", help="check a prepared dataset's files against the sha256 prepare recorded "
                                      "(after copying it to a cluster, before a long run)")
    p.add_argument("prefix", help="prepare's --output-prefix, or one PREFIX_train/_valid/_test")
    p.set_defaults(func=_verify)


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add `repro data fetch`, `repro data prepare`, `repro data inspect` and `repro data verify`."""
    data = subparsers.add_parser("data", help="evaluation data, vocabularies, indexed datasets")
    sub = data.add_subparsers(dest="data_command", required=True, metavar="SUBCOMMAND")
    f = sub.add_parser("fetch", help="copy (REPRO_DATA_MIRROR) or download the eval sets and "
                                     "vocabularies, verified by sha256")
    f.add_argument("--data-dir", help=f"destination (REPRO_DATA_DIR, default {DEFAULT_DATA_DIR})")
    f.add_argument("--mirror", help="copy from this directory (REPRO_DATA_MIRROR)")
    f.add_argument("--only", nargs="*", help="relative paths to fetch (default: all)")
    f.set_defaults(func=_fetch)
    _add_prepare(sub)
    _add_inspect(sub)
    _add_verify(sub)
