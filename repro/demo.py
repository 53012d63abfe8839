"""`repro demo`: the main job end to end on an embedded default (what `make demo` runs).

1. fetch the evaluation data and vocabularies (sha256-verified; from REPRO_DATA_MIRROR if set);
2. prepare the WikiText-2 validation text as a GPT-2 BPE indexed dataset (train/valid split);
3. train a small GPT at TP=2 on 2 CPU processes (experiments/demo/gpt_demo.yaml), MLflow-tracked;
4. evaluate the checkpoint zero-shot on the real WikiText test text and the full LAMBADA set;
5. sample text from it (top-k 40), then compare the held-out loss with what a context-free (unigram) model reaches, and say how to open
   MLflow.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

from repro.provenance import file_in_the_way, unwritable_ancestor
from repro.tracking.store import default_tracking_uri, project_root

CONFIG = "experiments/demo/gpt_demo.yaml"


def _token_counts(prefix: str, vocab_size: int) -> np.ndarray:
    from repro.data.indexed_dataset import IndexedDataset

    return np.bincount(np.asarray(IndexedDataset(prefix).tokens, dtype=np.int64), minlength=vocab_size)


def unigram_baselines(train_prefix: str, valid_prefix: str, vocab_size: int = 50257) -> tuple[float, float]:
    """(entropy of the training text's token frequencies, held-out loss of an add-one-smoothed
    unigram model fitted on it), nats/token: what a model that ignores context can reach."""
    train = _token_counts(train_prefix, vocab_size).astype(np.float64)
    p = train[train > 0] / train.sum()
    entropy = float(-(p * np.log(p)).sum())
    smoothed = (train + 1.0) / (train.sum() + vocab_size)
    valid = _token_counts(valid_prefix, vocab_size)
    held_out = float(-(valid * np.log(smoothed)).sum() / valid.sum())
    return entropy, held_out


def detokenized_copy(src: Path, dst: Path) -> Path:
    """The word-level WikiText file through the evaluation's detokenizer (" @-@ " -> "-", ...), so
    the demo trains on the same kind of text it is evaluated on; written atomically."""
    from repro.data.documents import is_wikitext_title
    from repro.eval.detokenize import wikitext_detokenize

    if not dst.exists():  # article titles stay as they are: they delimit the documents
        lines = src.read_text(encoding="utf-8").splitlines(keepends=True)
        text = "".join(x if is_wikitext_title(x) else wikitext_detokenize(x) for x in lines)
        tmp = dst.with_name(dst.name + ".tmp")
        tmp.write_text(text, encoding="utf-8")
        tmp.replace(dst)
    return dst


def _step(title: str, *args: str) -> None:
    print(f"\n=== {title}: repro {' '.join(args)}", flush=True)
    out = subprocess.run([sys.executable, "-m", "repro.cli", *args], cwd=project_root())
    if out.returncode:  # its own error is printed above; its exit code is the demo's (2: bad input)
        print(f"demo step '{title}' failed with exit code {out.returncode}", file=sys.stderr, flush=True)
        raise SystemExit(out.returncode)


SMOKE_ITERS, SMOKE_PASSAGES, SMOKE_LINES = 2, 64, 40
DEMO_PROMPT = "The first season of the series"


def _run(args) -> int:
    # the user's relative paths are relative to where they ran this, not to the steps' working directory
    data_dir = Path(os.environ.get("REPRO_DATA_DIR", project_root() / "data")).resolve()
    prefix = data_dir / "wt2_gpt"
    run_dir = Path(args.run_dir).resolve()
    data = ["--data-dir", str(data_dir)]
    iters = args.iters if args.iters is not None else SMOKE_ITERS if args.smoke else 300
    from repro.cli import UserError

    if iters < 1:  # before any step: the data steps take minutes, then training would refuse
        raise UserError(f"--iters {iters} trains nothing to evaluate. Fix: at least 1 (default 300; --smoke: "
                        f"{SMOKE_ITERS})")
    blocked = file_in_the_way(run_dir) or unwritable_ancestor(run_dir)  # also before the data steps
    if blocked:
        raise UserError(f"--run-dir {run_dir}: {blocked} is not a directory this user can write into. Fix: "
                        "give another --run-dir, e.g. runs/gpt-demo")
    lambada_subset = ["--max-examples", str(SMOKE_PASSAGES)] if args.smoke else []
    wikitext_subset = ["--max-lines", str(SMOKE_LINES)] if args.smoke else []
    # where everything goes, up front: by default under the checkout, whatever the current directory
    print(f"data:   {data_dir}\nrun:    {run_dir}\nMLflow: {_steps_tracking_uri()}", flush=True)
    _step("1/5 fetch data", "data", "fetch", *data)
    if not Path(f"{prefix}_train.idx").exists():
        text = detokenized_copy(data_dir / "wikitext" / "wikitext-2.valid.tokens", data_dir / "wt2_valid_detok.txt")
        _step("2/5 prepare WikiText-2 valid (detokenized, as the evaluation text)", "data", "prepare",
              "--input", str(text), "--layout", "wikitext", "--output-prefix", str(prefix), "--split", "95,5,0", *data)
    overrides = [f"data.train_prefix={prefix}_train", f"data.valid_prefix={prefix}_valid",
                 f"run_dir={run_dir}", f"train.train_iters={iters}"]
    _step("3/5 train GPT at TP=2 on 2 processes", "train", CONFIG, "--nproc", "2",
          *sum((["--set", o] for o in overrides), []))
    passages = f"first {SMOKE_PASSAGES} of 5,153 passages" if args.smoke else "5,153 passages"
    _step(f"4/5 zero-shot LAMBADA ({passages})", "eval", "lambada", "--checkpoint", str(run_dir), *data,
          *lambada_subset)
    _step("4/5 zero-shot WikiText test (window = stride = 128: the demo model's length)", "eval", "wikitext",
          "--checkpoint", str(run_dir), "--window", "128", "--stride", "128", *data, *wikitext_subset)
    _step("5/5 sample text from the trained model", "generate", "--checkpoint", str(run_dir),
          "--prompt", DEMO_PROMPT, "--max-new-tokens", "40", "--top-k", "40", "--seed", "1", *data)
    _summary(run_dir, str(prefix))
    return 0


def _steps_tracking_uri() -> str:
    """The MLflow store the steps log to; a relative sqlite path is the checkout's (the steps run there)."""
    uri, sqlite = default_tracking_uri(), "sqlite:///"
    if uri.startswith(sqlite) and not Path(uri[len(sqlite):]).is_absolute():
        return sqlite + str(project_root() / uri[len(sqlite):])
    return uri


def _summary(run_dir: Path, prefix: str) -> None:
    final = json.loads((run_dir / "final_metrics.json").read_text())
    entropy, unigram_held_out = unigram_baselines(f"{prefix}_train", f"{prefix}_valid")
    loss = final["valid_loss"]
    print(f"\nheld-out loss {loss:.3f} nats/token (ppl {math.exp(loss):.0f}); a unigram model on the same "
          f"held-out text: {unigram_held_out:.3f} (ppl {math.exp(unigram_held_out):.0f}); unigram entropy of "
          f"the training text: {entropy:.3f} (ppl {math.exp(entropy):.0f})")
    uri = default_tracking_uri()
    print(f"runs are in MLflow: {uri}")
    print(f"open it with:  .venv/bin/mlflow ui --backend-store-uri {uri}   (then http://127.0.0.1:5000)")


def register(sub) -> None:
    root = project_root()
    p = sub.add_parser("demo", help="fetch, prepare, train GPT at TP=2 on 2 CPU processes, evaluate",
                       description=f"Data go to $REPRO_DATA_DIR, else {root / 'data'}; runs are tracked in "
                                   f"$MLFLOW_TRACKING_URI, else the store slurm/cluster.env (or $REPRO_CLUSTER_ENV) "
                                   f"names for the cluster's jobs, else {root / 'mlruns'} (under the checkout, "
                                   "whatever the current directory). The locations are printed first.")
    p.add_argument("--iters", type=int, default=None, help="training iterations (default 300; --smoke: 2)")
    p.add_argument("--run-dir", default=str(root / "runs" / "gpt-demo"),
                   help=f"the training run's directory (default: {root / 'runs' / 'gpt-demo'}, under the "
                        "checkout whatever the current directory)")
    p.add_argument("--smoke", action="store_true",
                   help=f"the whole pipeline in about a minute: {SMOKE_ITERS} iterations, the first "
                        f"{SMOKE_PASSAGES} LAMBADA passages and {SMOKE_LINES} WikiText lines")
    p.set_defaults(func=_run)
