"""Fixtures of the trainer tests: a small real corpus (WikiText-2 valid) prepared once per session."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from data_fixtures import data_dir, data_mirror  # noqa: F401  (pytest fixtures)


@pytest.fixture(scope="session")
def corpus(tmp_path_factory, data_dir: Path) -> dict[str, str]:  # noqa: F811
    """Train/valid prefixes of the WikiText-2 validation text, GPT-2 BPE, filters off."""
    from repro.data.filters import FilterOptions
    from repro.data.preprocess import PrepareOptions, prepare

    out = tmp_path_factory.mktemp("corpus")
    prefix = str(out / "wiki")
    prepare(PrepareOptions(input=data_dir / "wikitext" / "wikitext-2.valid.tokens", output_prefix=prefix,
                           data_dir=data_dir, workers=1, split="90,10,0", progress=False,
                           filters=FilterOptions(min_tokens=0, dedup=False, eval_overlap=False)))
    return {"train": f"{prefix}_train", "valid": f"{prefix}_valid", "data_dir": str(data_dir)}


def tiny_overrides(corpus: dict, run_dir: Path, **extra) -> list[str]:
    """Dotted overrides for experiments/tiny/gpt_tiny.yaml pointing at the corpus and run_dir."""
    base = {"data.train_prefix": corpus["train"], "data.valid_prefix": corpus["valid"],
            "data.cache_dir": str(run_dir / "cache"), "run_dir": str(run_dir), "tracking.enabled": "false"}
    base.update({k: str(v) for k, v in extra.items()})
    return [f"{k}={v}" for k, v in base.items()]


def tiny_engine(corpus: dict, run_dir: Path, **extra):
    """(engine, batches) of the tiny GPT on one process; batches() gives the next 2 micro batches."""
    from repro.data.gpt_dataset import GPTDataset, gpt_loader
    from repro.parallel.groups import ProcessGroups
    from repro.train.config import derive, load_config
    from repro.train.engine import build_engine

    tiny = str(Path(__file__).resolve().parents[1] / "experiments/tiny/gpt_tiny.yaml")
    cfg = load_config(tiny, tiny_overrides(corpus, run_dir, **extra))
    eng = build_engine(cfg, derive(cfg, 1), ProcessGroups.single())
    data = GPTDataset(cfg.data.train_prefix, cfg.model.seq_length, cache_dir=run_dir)
    loader = iter(gpt_loader(data, cfg.train.micro_batch_size))
    return eng, lambda: [next(loader) for _ in range(2)]


def run_losses(run_dir: Path) -> list[tuple[int, float]]:
    """(step, loss) of every step a run dir's metrics.jsonl holds."""
    rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"]) for r in rows if "loss" in r]


def local_reference(config: Path, nproc: int, out: Path) -> list[tuple[int, float]]:
    """A run's own resolved config.yaml trained by `repro train --nproc` on this host (no Slurm, no
    tracking): the losses a multi-host run of it must give."""
    cmd = [sys.executable, "-m", "repro.cli", "train", str(config), "--nproc", str(nproc),
           "--set", f"run_dir={out}", "--set", "tracking.enabled=false"]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1],
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return run_losses(out)
