"""The paper's Fig. 7 ablation at CPU size: one small BERT, both layer-norm orders, through the shared trainer.

    repro data prepare --input wikitext-2.valid.tokens --tokenizer bert --layout wikitext \\
        --output-prefix data/wt2_bert --no-dedup --no-eval-filter --split 95,5,0
    python -m repro.models.bert_ablation --data-prefix data/wt2_bert_train --valid-prefix data/wt2_bert_valid

Each order is one in-process `repro.train.loop.train` run (one rank, CPU) of experiments/bert/tiny_cpu.yaml
with the overrides of `AblationOptions.overrides` (4 layers, h=128, 4 heads; batch, lr, iterations
from the command line; warm-up a tenth of the run, then linear decay to 0): the trainer's AdamW,
clipping and BERT samples. The trainer logs the per-step `loss`, `mlm_loss` and `sop_loss` to
RUN_DIR/metrics.jsonl and to MLflow experiment "bert" (tag paper_ref "Fig. 7 (CPU size)", which
`repro report` plots as results/fig7_layernorm_order.png). Both MLM curves also go to
results/bert_fig7_layernorm_order_cpu.{png,json}. At this size the original order is not expected to
diverge: the paper's instability appears beyond 336M (experiments/bert/fig7_336m_{pre,post}.yaml).
"""

from __future__ import annotations

import argparse
import io
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from repro.provenance import measurement_provenance, write_atomic

ROOT = Path(__file__).resolve().parents[2]
TINY_BERT = ROOT / "experiments" / "bert" / "tiny_cpu.yaml"
ORDERS = ("pre", "post")
CURVE_KEYS = ("step", "loss", "mlm_loss", "sop_loss")


@dataclass(frozen=True)
class AblationOptions:
    """One CPU-size Fig. 7 ablation: what it overrides in experiments/bert/tiny_cpu.yaml."""

    train_prefix: str
    vocab_dir: str
    """Holds vocab/bert-large-uncased-vocab.txt."""
    valid_prefix: str = ""
    """Held-out split (MLM/SOP loss at the end); empty: none."""
    run_root: str = "runs/bert_fig7_cpu"
    """Run directories RUN_ROOT/pre and RUN_ROOT/post (an existing one resumes from its checkpoint)."""
    iters: int = 300
    batch: int = 8
    lr: float = 5e-4
    seq_length: int = 128
    seed: int = 1234
    num_layers: int = 4
    hidden_size: int = 128
    num_attention_heads: int = 4
    dropout: float = 0.1
    tracking: bool = True
    """Log to MLflow (metrics.jsonl is written either way)."""

    def overrides(self, order: str) -> list[str]:
        """Dotted overrides of experiments/bert/tiny_cpu.yaml for one layer-norm order."""
        sets = {"name": f"fig7-{order}-cpu", "run_dir": f"{self.run_root}/{order}", "model.layernorm_order": order,
                "model.num_layers": self.num_layers, "model.hidden_size": self.hidden_size,
                "model.num_attention_heads": self.num_attention_heads, "model.seq_length": self.seq_length,
                "model.hidden_dropout": self.dropout, "model.attention_dropout": self.dropout,
                "optim.lr": self.lr, "optim.min_lr": 0.0, "optim.lr_warmup_iters": max(1, self.iters // 10),
                "train.micro_batch_size": self.batch, "train.global_batch_size": self.batch,
                "train.train_iters": self.iters, "train.seed": self.seed, "train.device": "cpu",
                "data.train_prefix": self.train_prefix, "data.valid_prefix": self.valid_prefix,
                "data.vocab_dir": self.vocab_dir, "tracking.enabled": self.tracking,
                "tracking.paper_ref": "Fig. 7 (CPU size)"}
        return [f"{k}={json.dumps(v)}" for k, v in sets.items()]  # JSON scalars are YAML: "" stays a string


def train_order(order: str, opts: AblationOptions) -> dict:
    """Train one layer-norm order through the trainer (this process, one rank): its final metrics, its
    run directory and MLflow run id, and the per-step `loss`, `mlm_loss`, `sop_loss` of metrics.jsonl."""
    from repro.parallel.groups import ProcessGroups
    from repro.tracking.run_dir import read_metrics
    from repro.train.config import load_config
    from repro.train.loop import train

    cfg = load_config(TINY_BERT, opts.overrides(order))
    final = train(cfg, ProcessGroups.single())
    if final.get("stopped_by_signal"):
        raise SystemExit(f"{order}: stopped by a signal at iteration {final['iteration']} (checkpointed); "
                         f"rerun with --run-dir {opts.run_root} to resume")
    curve = [{k: row[k] for k in CURVE_KEYS} for row in read_metrics(cfg.run_dir) if "mlm_loss" in row]
    return {"run_dir": cfg.run_dir, "mlflow_run_id": final.get("mlflow_run_id"), "final": final, "curve": curve}


def tail_mean(curve: list[dict], key: str = "mlm_loss", n: int = 20) -> float:
    """Mean of `key` over the last `n` steps (the noisy per-step loss of batch 8, smoothed)."""
    tail = curve[-n:]
    return sum(r[key] for r in tail) / len(tail)


def plot(curves: dict[str, list[dict]], path: Path, size: str = "4 layers, h=128") -> None:
    """Both MLM loss curves (smoothed over 10 steps), labelled as a CPU-size run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    names = {"pre": "rearranged (paper, LN on sublayer input)", "post": "original BERT (LN after residual)"}
    for order, curve in curves.items():
        y = torch.tensor([r["mlm_loss"] for r in curve])
        smooth = torch.nn.functional.avg_pool1d(y[None, None], 10, 1).flatten() if len(y) >= 10 else y
        ax.plot(range(len(y) - len(smooth) + 1, len(y) + 1), smooth.numpy(), label=names[order])
    ax.set(xlabel="iteration", ylabel="MLM training loss (10-step mean)",
           title=f"Fig. 7 ablation at CPU size ({size}), NOT the paper's 336M+ models")
    ax.title.set_fontsize(8)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=120)
    plt.close(fig)
    write_atomic(path, buf.getvalue())


def run_ablation(opts: AblationOptions, out: Path, argv: tuple[str, ...] = ()) -> dict[str, dict]:
    """Both orders, then OUT.png (the MLM curves) and OUT.json (options, run ids, curves, and where and
    how they were measured: device, versions, commit, `argv`)."""
    runs = {order: train_order(order, opts) for order in ORDERS}
    size = f"{opts.num_layers} layers, h={opts.hidden_size}, seq {opts.seq_length}, batch {opts.batch}"
    plot({o: r["curve"] for o, r in runs.items()}, out.with_suffix(".png"), size)
    record = {"made_by": "python -m repro.models.bert_ablation (the shared trainer, experiments/bert/tiny_cpu.yaml)",
              "options": asdict(opts), "overrides": {o: opts.overrides(o) for o in ORDERS},
              "runs": {o: {k: r[k] for k in ("run_dir", "mlflow_run_id")} for o, r in runs.items()},
              "final_mlm_loss_last20": {o: tail_mean(r["curve"]) for o, r in runs.items()},
              "valid": {o: {k: v for k, v in r["final"].items() if k.startswith("valid_")} for o, r in runs.items()},
              "curves": {o: r["curve"] for o, r in runs.items()},
              "provenance": measurement_provenance(torch.device("cpu"), list(argv),
                                                   prog="python -m repro.models.bert_ablation")}
    write_atomic(out.with_suffix(".json"), json.dumps(record, indent=1).encode())
    return runs


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data-prefix", required=True, help="indexed BERT dataset (repro data prepare --tokenizer bert)")
    p.add_argument("--valid-prefix", default="", help="held-out split of the same preparation (optional)")
    p.add_argument("--data-dir", help="holds vocab/bert-large-uncased-vocab.txt (default REPRO_DATA_DIR or ./data)")
    p.add_argument("--iters", type=int, default=300)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--seq-length", type=int, default=128)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--run-dir", help="parent of the two run directories (default runs/bert_fig7_cpu/<time>; "
                   "give an existing one to resume it)")
    p.add_argument("--no-tracking", action="store_true", help="metrics.jsonl only, no MLflow runs")
    p.add_argument("--out", default="results/bert_fig7_layernorm_order_cpu")
    args = p.parse_args(argv)
    from repro.data.fetch import data_dir_from_env

    opts = AblationOptions(args.data_prefix, str(args.data_dir or data_dir_from_env()), args.valid_prefix,
                           args.run_dir or f"runs/bert_fig7_cpu/{time.strftime('%Y%m%d-%H%M%S')}", args.iters,
                           args.batch, args.lr, args.seq_length, args.seed, tracking=not args.no_tracking)
    runs = run_ablation(opts, Path(args.out), tuple(sys.argv[1:] if argv is None else argv))
    for order, run in runs.items():
        print(f"{order}: final MLM loss (mean of last 20 steps) {tail_mean(run['curve']):.3f}; "
              f"run dir {run['run_dir']}, MLflow run {run['mlflow_run_id']}")
    print(f"wrote {Path(args.out).with_suffix('.png')} and {Path(args.out).with_suffix('.json')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
