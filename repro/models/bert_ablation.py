"""The paper's Fig. 7 ablation at CPU size: the same small BERT trained with both layer-norm orders.

    repro data prepare --input wikitext-2.valid.tokens --tokenizer bert --layout wikitext \\
        --output-prefix data/wt2_bert --no-dedup --no-eval-filter --split 95,5,0
    python -m repro.models.bert_ablation --data-prefix data/wt2_bert_train --iters 300

A standalone loop (AdamW, warm-up then linear decay, clipping 1.0, the data pipeline's BERT samples)
because the shared trainer builds GPT only so far. Each order is an MLflow run in experiment "bert"
(plus metrics.jsonl); both loss curves go to results/bert_fig7_layernorm_order_cpu.{png,json}. At
this size the original order is not expected to diverge: the paper's instability appears beyond 336M.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from pathlib import Path

import torch

from repro.models.bert import BERT, BertConfig
from repro.parallel.grads import clip_grad_norm
from repro.parallel.random import RNGTracker, seed_default_generators

CPU_BERT = BertConfig(num_layers=4, hidden_size=128, num_attention_heads=4, seq_length=128,
                      hidden_dropout=0.1, attention_dropout=0.1)


def _schedule(opt, warmup: int, iters: int):
    lam = lambda i: min((i + 1) / warmup, max(0.0, (iters - i) / max(1, iters - warmup)))  # noqa: E731
    return torch.optim.lr_scheduler.LambdaLR(opt, lam)


def train_order(order: str, loader, cfg: BertConfig, iters: int, lr: float, seed: int, log) -> list[dict]:
    """Train one layer-norm order for `iters` steps; the per-step MLM/SOP losses."""
    seed_default_generators(seed, torch.device("cpu"))
    model = BERT(replace(cfg, layernorm_order=order), rng=RNGTracker(seed, 0), seed=seed).train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    sched, curve, batches = _schedule(opt, max(1, iters // 10), iters), [], iter(loader)
    for step in range(1, iters + 1):
        losses = model.losses(next(batches))
        opt.zero_grad(set_to_none=True)
        losses["total"].backward()
        clip_grad_norm(model.parameters(), 1.0)
        opt.step()
        sched.step()
        row = {"step": step, **{f"loss/{k}": v.item() for k, v in losses.items()}}
        curve.append(row)
        log(row, step)
    return curve


def plot(curves: dict[str, list[dict]], path: Path) -> None:
    """Both MLM loss curves (smoothed over 10 steps), labelled as a CPU-size run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    names = {"pre": "rearranged (paper, LN on sublayer input)", "post": "original BERT (LN after residual)"}
    for order, curve in curves.items():
        y = torch.tensor([r["loss/mlm"] for r in curve])
        smooth = torch.nn.functional.avg_pool1d(y[None, None], 10, 1).flatten() if len(y) >= 10 else y
        ax.plot(range(len(y) - len(smooth) + 1, len(y) + 1), smooth.numpy(), label=names[order])
    ax.set(xlabel="iteration", ylabel="MLM loss (10-step mean)",
           title="Fig. 7 ablation at CPU size (4 layers, h=128), NOT the paper's 336M+ models")
    ax.title.set_fontsize(8)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def _mlflow_logger(order: str, params: dict, run_dir: Path):
    import mlflow

    from repro.tracking.store import default_artifact_location, default_tracking_uri

    mlflow.set_tracking_uri(default_tracking_uri())
    if mlflow.get_experiment_by_name("bert") is None:
        mlflow.create_experiment("bert", artifact_location=default_artifact_location("bert"))
    mlflow.set_experiment("bert")
    run = mlflow.start_run(run_name=f"fig7-{order}-cpu", tags={"paper_ref": "Fig. 7 (CPU size)"})
    mlflow.log_params({**params, "layernorm_order": order})
    run_dir.mkdir(parents=True, exist_ok=True)
    jsonl = open(run_dir / f"metrics_{order}.jsonl", "w", encoding="utf-8")

    def log(row: dict, step: int) -> None:
        jsonl.write(json.dumps({"time": time.time(), **row}) + "\n")
        if step % 10 == 0:
            jsonl.flush()
            mlflow.log_metrics({k: v for k, v in row.items() if k != "step"}, step=step)

    def close() -> None:
        jsonl.close()
        mlflow.end_run()

    return run, log, close


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data-prefix", required=True, help="indexed BERT dataset (repro data prepare --tokenizer bert)")
    p.add_argument("--data-dir", help="holds vocab/bert-large-uncased-vocab.txt (REPRO_DATA_DIR)")
    p.add_argument("--iters", type=int, default=300)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--seq-length", type=int, default=CPU_BERT.seq_length)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--out", default="results/bert_fig7_layernorm_order_cpu")
    args = p.parse_args(argv)
    from repro.data.bert_dataset import BertDataset, BertOptions, bert_loader
    from repro.data.fetch import data_dir_from_env
    from repro.data.tokenizers import build_tokenizer

    tok = build_tokenizer("bert", Path(args.data_dir) if args.data_dir else data_dir_from_env())
    cfg = replace(CPU_BERT, vocab_size=tok.vocab_size, seq_length=args.seq_length)
    params = {"num_layers": cfg.num_layers, "hidden_size": cfg.hidden_size, "seq_length": cfg.seq_length,
              "batch": args.batch, "iters": args.iters, "lr": args.lr, "data": args.data_prefix}
    curves = {}
    for order in ("pre", "post"):
        data = BertDataset(args.data_prefix, tok, BertOptions(max_seq_length=cfg.seq_length, seed=args.seed))
        _, log, close = _mlflow_logger(order, params, Path("runs/bert_fig7_cpu"))
        curves[order] = train_order(order, bert_loader(data, args.batch), cfg, args.iters, args.lr, args.seed, log)
        close()
        tail = curves[order][-20:]
        print(f"{order}: final MLM loss (mean of last {len(tail)}) {sum(r['loss/mlm'] for r in tail) / len(tail):.3f}")
    out = Path(args.out)
    plot(curves, out.with_suffix(".png"))
    out.with_suffix(".json").write_text(json.dumps({"params": params, "curves": curves}))
    print(f"wrote {out.with_suffix('.png')} and {out.with_suffix('.json')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
