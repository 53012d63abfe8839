"""The trainer's precision recipes against fp32: loss curves of one tiny GPT run per recipe.

    python -m repro.perf.precision_study --out results/precision      # after `make demo` (its data)

Every recipe trains the same model on the same batches from the same initialisation, with
gradient accumulation over 8 micro batches so that the accumulation dtype matters:

- fp32;
- bf16 autocast over fp32 weights (`precision.params: fp32`);
- a bf16 model with fp32 master weights and fp32 main grads (`params: half`, `main_grads: fp32`);
- the same with gradients accumulated and reduced in bf16 (`main_grads: param`).

Writes losses.csv (step, recipe, loss), table.md (final loss and the largest and mean per-step
distance from fp32) and curves.png, atomically, with provenance.
"""

from __future__ import annotations

import argparse
import datetime
import io
import sys
import tempfile
from pathlib import Path

import pandas as pd
from tqdm import tqdm

from repro.parallel.spawn import run_ranks
from repro.provenance import OutDirError, git_sha, make_out_dir, write_atomic
from repro.tracking.run_dir import read_metrics
from repro.train.commands import train_rank

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "experiments/tiny/gpt_tiny.yaml"
RECIPES = {
    "fp32": {"precision.precision": "fp32"},
    "bf16 autocast, fp32 weights": {"precision.precision": "bf16", "precision.params": "fp32"},
    "bf16 model, fp32 main grads": {"precision.precision": "bf16", "precision.params": "half",
                                    "precision.main_grads": "fp32"},
    "bf16 model, bf16 grads": {"precision.precision": "bf16", "precision.params": "half",
                               "precision.main_grads": "param"},
}


def recipe_losses(prefix: str, runs: Path, iters: int) -> pd.DataFrame:
    """One single-process training run per recipe (run directories under `runs`); their per-step
    losses, long format."""
    frames = []
    for i, (name, over) in enumerate(tqdm(RECIPES.items(), desc="recipes", unit="run")):
        run_dir = runs / f"recipe{i}"
        settings = {"data.train_prefix": f"{prefix}_train", "data.valid_prefix": f"{prefix}_valid",
                    "data.cache_dir": str(runs / "cache"), "run_dir": str(run_dir), "tracking.enabled": "false",
                    "train.train_iters": iters, "train.micro_batch_size": 1, "train.global_batch_size": 8,
                    "train.save_interval": iters, "optim.lr_decay_iters": iters, **over}
        run_ranks(train_rank, 1, str(CONFIG), [f"{k}={v}" for k, v in settings.items()], timeout=3600)
        rows = [(r["step"], name, r["loss"]) for r in read_metrics(run_dir) if "loss" in r]
        frames.append(pd.DataFrame(rows, columns=["step", "recipe", "loss"]))
    return pd.concat(frames, ignore_index=True)


def distance_table(losses: pd.DataFrame) -> pd.DataFrame:
    """Per recipe: final loss, and the largest and mean |loss - fp32 loss| over the steps (nats)."""
    wide = losses.pivot(index="step", columns="recipe", values="loss")[list(RECIPES)]
    gap = wide.sub(wide["fp32"], axis=0).abs()
    return pd.DataFrame({"final loss": wide.iloc[-1], "largest distance from fp32": gap.max(),
                         "mean distance from fp32": gap.mean()})


def markdown_table(table: pd.DataFrame) -> str:
    lines = ["| recipe | " + " | ".join(table.columns) + " |", "|---" * (len(table.columns) + 1) + "|"]
    lines += [f"| {name} | " + " | ".join(f"{v:.4g}" for v in row) + " |" for name, row in table.iterrows()]
    return "\n".join(lines) + "\n"


def plot_png(losses: pd.DataFrame) -> bytes:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, gap_ax) = plt.subplots(1, 2, figsize=(11, 4))
    wide = losses.pivot(index="step", columns="recipe", values="loss")[list(RECIPES)]
    for color, name in zip(("black", "tab:blue", "tab:green", "tab:red"), RECIPES):
        ax.plot(wide.index, wide[name], label=name, lw=1, color=color)
        if name != "fp32":
            gap_ax.plot(wide.index, (wide[name] - wide["fp32"]).abs(), label=name, lw=1, color=color)
    ax.set(xlabel="iteration", ylabel="training loss (nats)", title="tiny GPT, 8 micro batches per step")
    gap_ax.set(xlabel="iteration", ylabel="|loss - fp32 loss| (nats)", yscale="log", title="distance from fp32")
    ax.legend(fontsize=8)
    gap_ax.legend(fontsize=8)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=120)
    plt.close(fig)
    return buf.getvalue()


def write_results(losses: pd.DataFrame, out: Path, argv: list[str], iters: int) -> None:
    table = distance_table(losses)
    when = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    header = (f"# Precision recipes against fp32 (CPU)\n\n{when}; git {git_sha()}; "
              f"`python -m repro.perf.precision_study {' '.join(argv)}`; {CONFIG.relative_to(ROOT)}, "
              f"{iters} iterations, global batch 8 as 8 micro batches of 1, one process.\n\n")
    write_atomic(out / "table.md", header + markdown_table(table))
    write_atomic(out / "losses.csv", losses.to_csv(index=False))
    write_atomic(out / "curves.png", plot_png(losses))


def _warmup_iters() -> int:
    from omegaconf import OmegaConf

    return int(OmegaConf.load(CONFIG).optim.lr_warmup_iters)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--data-prefix", default=str(ROOT / "data/wt2_gpt"),
                        help="prepared corpus prefix with _train/_valid (default: the one `make demo` writes)")
    parser.add_argument("--iters", type=int, default=150)
    parser.add_argument("--runs-dir", type=Path, default=ROOT / "runs/precision_study",
                        help="where each invocation's four training runs (metrics, checkpoints) go, in a "
                             "new study-* folder")
    args = parser.parse_args(argv)
    if not Path(f"{args.data_prefix}_train.idx").exists():
        print(f"error: no prepared corpus at {args.data_prefix}_train.idx: run `make demo` (it prepares "
              f"data/wt2_gpt) or pass --data-prefix of a `repro data prepare` output", file=sys.stderr)
        return 2
    shortest = _warmup_iters() + 1  # the cosine decay must start after the warm-up
    if args.iters < shortest:
        print(f"error: --iters {args.iters}: {CONFIG.name} warms up for {shortest - 1} iterations, so train at "
              f"least {shortest}. Fix: e.g. --iters 150", file=sys.stderr)
        return 2
    try:
        make_out_dir(args.out, "results/precision")
    except OutDirError as err:
        parser.error(str(err))
    args.runs_dir.mkdir(parents=True, exist_ok=True)
    runs = Path(tempfile.mkdtemp(prefix="study-", dir=args.runs_dir))  # never an earlier study's finished runs
    losses = recipe_losses(args.data_prefix, runs, args.iters)
    write_results(losses, args.out, argv, args.iters)
    print((args.out / "table.md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
