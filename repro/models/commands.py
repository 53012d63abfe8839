"""`repro sizes`: the paper's named sizes with parameter counts from the model definition."""

from __future__ import annotations


def _sizes(args) -> int:
    from dataclasses import replace

    from rich.console import Console
    from rich.table import Table

    from repro.models.sizes import SIZES, count_parameters, format_count

    table = Table(title="Paper model sizes (parameters counted on the meta device)")
    for col in ("name", "source", "layers", "hidden", "heads", "vocab (padded)", "params", "paper"):
        table.add_column(col)
    for size in SIZES.values():
        if args.family and size.family != args.family:
            continue
        n = count_parameters(size)
        padded = size.model_config().padded_vocab_size()
        table.add_row(size.name, size.source, str(size.num_layers), str(size.hidden_size),
                      str(size.num_attention_heads), f"{size.vocab_size} ({padded})",
                      f"{n:,} ({format_count(n)})", size.paper_params)
    Console(width=140).print(table)
    if not args.family or args.family == "gpt":
        medium = replace(SIZES["gpt2-355m"], make_vocab_size_divisible_by=1)
        print(f"gpt2-355m: {format_count(count_parameters(medium))} without the vocabulary padding; the paper's "
              "355M is GPT-2 medium's usual name.")
    return 0


def register(sub) -> None:
    p = sub.add_parser("sizes", help="the paper's model sizes with parameter counts")
    p.add_argument("--family", choices=["gpt", "bert"], default=None)
    p.set_defaults(func=_sizes)
