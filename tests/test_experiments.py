"""Every experiment config loads (typed: no unknown keys, right types) and validates at the GPU
count the paper ran it on (Tables 1, 2 and 4); the tiny CPU configs at their own size."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from repro.train.config import derive, load_config

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted(p for p in (ROOT / "experiments").rglob("*.yaml") if p.name != "base.yaml")
PAPER_GPUS = {"gpt2_355m": 64, "gpt2_2.5b": 128, "gpt2_8.3b": 512,
              "bert_336m": 128, "bert_1.3b": 256, "bert_3.9b": 512,
              "fig7_336m_pre": 128, "fig7_336m_post": 128,  # Fig. 7: both layer-norm orders at 336M
              "fig7_1.3b_pre": 256, "fig7_1.3b_post": 256}  # and beyond it, where the paper sees instability


def _world_size(path: Path, tp: int) -> int:
    if path.stem in PAPER_GPUS:
        return PAPER_GPUS[path.stem]
    match = re.search(r"_dp(\d+)$", path.stem)
    return int(match.group(1)) if match else tp


def test_every_paper_experiment_has_a_config():
    names = {p.stem for p in CONFIGS}
    wanted = {f"scale_{b}" for b in ("1b", "2b", "4b", "8b")} | set(PAPER_GPUS)
    wanted |= {"scale_1b_dp64", "scale_2b_dp128", "scale_4b_dp256", "scale_8b_dp512"}
    wanted |= {"heads_8b_16", "heads_8b_24", "strong_1b_tp2", "strong_1b_tp4", "strong_1b_tp8"}  # Appendix D
    assert wanted <= names, wanted - names


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: str(p.relative_to(ROOT / "experiments")))
def test_config_loads_and_validates(path):
    cfg = load_config(path)
    derived = derive(cfg, _world_size(path, cfg.parallel.tp))
    assert derived.grad_accum_steps >= 1
    if cfg.family == "gpt" and cfg.model.seq_length == 1024:
        assert derived.padded_vocab_size == 51200  # the paper's padded GPT-2 vocabulary


@pytest.mark.parametrize("path", [p for p in CONFIGS if "model_size" in p.read_text()],
                         ids=lambda p: str(p.relative_to(ROOT / "experiments")))
def test_a_named_size_gives_the_papers_shape(path):
    from repro.models.sizes import get_size

    cfg = load_config(path)
    size = get_size(cfg.model_size)
    assert (cfg.model.num_layers, cfg.model.hidden_size, cfg.model.num_attention_heads) == \
        (size.num_layers, size.hidden_size, size.num_attention_heads)


def test_an_included_files_architecture_gives_way_to_the_size_named_by_the_includer(tmp_path):
    """A model.num_layers in a shared base.yaml used to reshape every size that included it; the
    including file's own model keys and --set still win over its size."""
    (tmp_path / "base.yaml").write_text("model:\n  num_layers: 2\n  hidden_dropout: 0.2\n")
    (tmp_path / "run.yaml").write_text("include: [base.yaml]\nmodel_size: gpt2-355m\n")
    cfg = load_config(tmp_path / "run.yaml")
    assert (cfg.model.num_layers, cfg.model.hidden_size, cfg.model.hidden_dropout) == (24, 1024, 0.2)
    assert load_config(tmp_path / "run.yaml", ["model.num_layers=3"]).model.num_layers == 3
    assert load_config(tmp_path / "run.yaml", ["model_size=gpt2-2.5b"]).model.num_layers == 54
    (tmp_path / "own.yaml").write_text("include: [base.yaml]\nmodel_size: gpt2-355m\nmodel:\n  num_layers: 4\n")
    assert load_config(tmp_path / "own.yaml").model.num_layers == 4


def test_a_size_named_by_set_outranks_the_files_own_architecture():
    """`--set model_size=gpt2-355m` on a config with its own shape (the tiny GPT): the named size's
    shape, not the file's (before, MLflow's model_size named gpt2-355m while the tiny model trained);
    a --set model.* given with it still wins."""
    tiny = ROOT / "experiments/tiny/gpt_tiny.yaml"
    cfg = load_config(tiny, ["model_size=gpt2-355m"])
    assert (cfg.model_size, cfg.model.num_layers, cfg.model.hidden_size, cfg.model.num_attention_heads) == \
        ("gpt2-355m", 24, 1024, 16)
    assert load_config(tiny, ["model_size=gpt2-355m", "model.num_layers=3"]).model.num_layers == 3
    assert load_config(tiny).model.num_layers == 2


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: str(p.relative_to(ROOT / "experiments")))
def test_a_long_run_keeps_a_bounded_number_of_checkpoints(path):
    """A paper run saving every 1,000 of 300k iterations would keep 300 checkpoints (~30 TB at 8.3B with
    Adam state): a config that writes more than 10 keeps only the newest few (train.keep_checkpoints)."""
    train = load_config(path).train
    saves = train.train_iters // train.save_interval if train.save_interval else 0
    assert saves <= 10 or 0 < train.keep_checkpoints <= 5, (saves, train.keep_checkpoints)
