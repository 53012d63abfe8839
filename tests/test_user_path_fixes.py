"""A new user's paths (review findings 1-8): the Slurm pre-launch checks refuse an unprepared corpus and
an evaluation checkpoint of the other family before srun; the demo and tiny configs read the data dir
`repro demo` prepares into; `repro demo` says where it writes; evaluation and RACE fine-tuning show
progress; a run_dir or data dir under a file is a user error; environment.yml has pyproject's extras;
write_local_tasks takes strings."""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from conftest import require
from data_fixtures import mirror_path
from repro.cli import main
from repro.data.indexed_dataset import IndexedDatasetWriter

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "experiments" / "tiny" / "gpt_tiny.yaml")
FAKE_SCONTROL = """#!/bin/bash
case "$1 $2" in
  "show hostnames") echo localhost ;;  # a name that resolves, as a node's does
  "show job") echo "JobId=$3 JobName=x Requeue=1 Command=/x.sh WorkDir=/w" ;;
esac
"""


def _job(tmp_path: Path, script: str, *args: str, **extra: str) -> tuple[int, str]:
    """`bash slurm/SCRIPT ARGS` as a job runs it, with the real `repro` and a fake scontrol (no Slurm):
    the exit status and everything it printed, the job log included."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "scontrol").write_text(FAKE_SCONTROL)
    (bin_dir / "scontrol").chmod(0o755)
    (tmp_path / "cluster.env").write_text(f"REPRO_RUNS_DIR={tmp_path}/runs\nREPRO_DATA_DIR={tmp_path}/data\n"
                                          "REPRO_ENV_ACTIVATE=none\n")
    (tmp_path / "data").mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "REPRO_", "NCCL_SOCKET", "GLOO_SOCKET", "MLFLOW_"))}
    env.update(PATH=f"{bin_dir}{os.pathsep}{Path(sys.executable).parent}{os.pathsep}{env['PATH']}",
               REPRO_ROOT=str(ROOT), REPRO_CLUSTER_ENV=str(tmp_path / "cluster.env"), SLURM_JOB_ID="42",
               SLURM_NTASKS="8", SLURM_JOB_NAME=Path(script).stem, SLURM_JOB_NODELIST="localhost",
               MLFLOW_TRACKING_URI=f"sqlite:///{tmp_path / 'mlflow.db'}", OMP_NUM_THREADS="1", **extra)
    out = subprocess.run(["bash", str(ROOT / "slurm" / script), *args], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=120)
    logs = "".join(p.read_text() for p in sorted((tmp_path / "runs").glob("*/logs/*.out")))
    return out.returncode, logs + out.stdout + out.stderr


def _checkpoint(run_dir: Path, family: str) -> Path:
    """A run dir whose checkpoints/latest names a checkpoint of `family` (meta.json is all the checks read)."""
    ckpt = run_dir / "checkpoints" / "iter_0000001"
    ckpt.mkdir(parents=True)
    (ckpt / "meta.json").write_text(json.dumps({"tp": 1, "family": family, "iteration": 1}))
    (run_dir / "checkpoints" / "latest").write_text("iter_0000001")
    return run_dir


def _dataset(prefix: Path) -> None:
    prefix.parent.mkdir(parents=True, exist_ok=True)
    with IndexedDatasetWriter(prefix, dtype=np.uint16) as writer:
        writer.add_document([np.arange(200, dtype=np.uint16)])


# 1. The Slurm pre-launch checks


def test_a_training_job_without_its_corpus_stops_before_srun(tmp_path):
    """`slurm/scale_8b.sh --dry-run` with no gpt2_corpus_* in REPRO_DATA_DIR: exit 2 naming the prefix
    and `repro data prepare`, no step (before: "config ok" and the srun step, which then failed)."""
    code, log = _job(tmp_path, "scale_8b.sh", "--dry-run")
    assert code == 2 and f"{tmp_path}/data/gpt2_corpus_train.idx" in log, log
    assert "repro data prepare" in log and "Fix:" in log and "step:" not in log, log


def test_check_require_data_passes_a_prepared_corpus_and_names_a_missing_split(tmp_path, capsys):
    for split in ("train", "valid"):
        _dataset(tmp_path / f"wiki_{split}")
    sets = ["--set", f"data.train_prefix={tmp_path}/wiki_train", "--set", "tracking.enabled=false"]
    assert main(["slurm", "check", TINY, "--ntasks", "1", *sets, "--require-data"]) == 0
    sets += ["--set", f"data.valid_prefix={tmp_path}/nothing_valid"]
    assert main(["slurm", "check", TINY, "--ntasks", "1", *sets]) == 0  # a config checked before its data
    assert main(["slurm", "check", TINY, "--ntasks", "1", *sets, "--require-data"]) == 2
    err = capsys.readouterr().err
    assert f"data.valid_prefix {tmp_path}/nothing_valid has no" in err and f"--output-prefix {tmp_path}/nothing`" in err


@pytest.mark.parametrize("script, variable, family, other", [
    ("zeroshot_eval.sh", "REPRO_EVAL_CHECKPOINT", "gpt", "bert"),
    ("race_finetune.sh", "REPRO_BERT_CHECKPOINT", "bert", "gpt")])
def test_an_evaluation_job_refuses_a_checkpoint_of_the_other_family_before_srun(tmp_path, script, variable,
                                                                                family, other):
    wrong, right = _checkpoint(tmp_path / "wrong", other), _checkpoint(tmp_path / "right", family)
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    code, log = _job(tmp_path / "a", script, "--dry-run", **{variable: str(wrong), "REPRO_RACE_DIR": str(tmp_path)})
    assert code == 2 and f"{wrong} is a {other.upper()} checkpoint" in log and "step:" not in log, log
    code, log = _job(tmp_path / "b", script, "--dry-run", **{variable: str(right), "REPRO_RACE_DIR": str(tmp_path)})
    assert code == 0 and f"checkpoint ok: {right} is a {family.upper()} checkpoint" in log and "step:" in log, log


# 2. The demo and tiny configs read the data dir `repro demo` prepares into


def test_demo_and_tiny_configs_read_repro_data_dir(monkeypatch):
    from repro.train.config import load_config

    monkeypatch.setenv("REPRO_DATA_DIR", "/shared/data")
    for config, name in (("demo/gpt_demo.yaml", "wt2_gpt"), ("bert/tiny_cpu.yaml", "wt2_bert")):
        data = load_config(ROOT / "experiments" / config).data
        assert (data.train_prefix, data.valid_prefix) == (f"/shared/data/{name}_train", f"/shared/data/{name}_valid")
    header = (ROOT / "experiments" / "tiny" / "gpt_tiny.yaml").read_text().split("\nname:")[0]
    assert "data.train_prefix=\"${REPRO_DATA_DIR:-data}/wt2_gpt_train\"" in header


# 3. `repro demo` says where it writes


def test_demo_prints_its_absolute_locations_first_and_help_names_the_checkout(tmp_path, monkeypatch, capsys):
    import repro.demo as demo
    from repro.tracking.store import project_root

    events = []
    monkeypatch.setattr(demo, "_step", lambda title, *args: events.append(("step", capsys.readouterr().out)))
    monkeypatch.setattr(demo, "_summary", lambda run_dir, prefix: None)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("REPRO_DATA_DIR", "d")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "sqlite:///m.db")  # relative: the steps run in the checkout
    monkeypatch.setenv("COLUMNS", "300")  # --help on one line
    for split in ("train", "valid"):  # prepared already: no prepare step
        _dataset(tmp_path / "d" / f"wt2_gpt_{split}")
    demo._run(argparse.Namespace(run_dir="rel", iters=None, smoke=True))
    first = events[0][1]
    assert f"data:   {tmp_path / 'd'}\n" in first and f"run:    {tmp_path / 'rel'}\n" in first, first
    assert f"MLflow: sqlite:///{project_root() / 'm.db'}\n" in first, first
    with pytest.raises(SystemExit):
        main(["demo", "--help"])
    assert f"(default: {project_root() / 'runs' / 'gpt-demo'}, under the" in capsys.readouterr().out


# 4. Progress of the evaluations and of RACE fine-tuning


def test_wikitext_and_lambada_show_a_progress_bar_and_compute_the_same_numbers(capsys):
    from repro.eval.lambada import Example, evaluate_lambada
    from repro.eval.wikitext import WikitextData, evaluate_perplexity
    from repro.parallel.groups import ProcessGroups
    from test_eval_metrics import _rotating_model, _telescoping_model

    pg = ProcessGroups.single()
    data = WikitextData([1] * 9, 6)
    shown = evaluate_perplexity(_telescoping_model(4), pg, data, window=4, stride=2, batch_size=2)
    assert re.search(r"wikitext: 100%.* 3/3 ", capsys.readouterr().err)  # windows at 0, 2 and 4
    quiet = evaluate_perplexity(_telescoping_model(4), pg, data, window=4, stride=2, batch_size=2, progress=False)
    assert capsys.readouterr().err == "" and shown == quiet
    examples = [Example([0], [1, 2]), Example([3, 3, 3], [0]), Example([2, 2, 2], [3])]
    shown = evaluate_lambada(_rotating_model(), pg, examples, batch_size=2)
    assert re.search(r"lambada: 100%.* 3/3 ", capsys.readouterr().err)
    assert evaluate_lambada(_rotating_model(), pg, examples, batch_size=2, progress=False) == shown


def test_race_fine_tuning_prints_a_loss_line_every_log_interval_on_rank_0(capsys):
    from repro.eval.race import RaceTensors
    from repro.eval.race_finetune import FinetuneOptions, MultipleChoiceBert, finetune
    from repro.models.bert import BertConfig

    cfg = BertConfig(vocab_size=64, num_layers=1, hidden_size=16, num_attention_heads=2, seq_length=8,
                     hidden_dropout=0.0, attention_dropout=0.0)
    gen = torch.Generator().manual_seed(0)
    train = RaceTensors(torch.randint(0, 64, (5, 4, 8), generator=gen), torch.zeros(5, 4, 8, dtype=torch.long),
                        torch.ones(5, 4, 8, dtype=torch.long), torch.tensor([0, 1, 2, 3, 0]), ["middle"] * 5)
    opts = FinetuneOptions(epochs=2, batch_size=2, lr=1e-3, seed=7, log_every=2)
    losses = finetune(MultipleChoiceBert(cfg, seed=7), train, opts)
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith(" seed 7 |")]
    steps = [int(re.search(r"step +(\d+)/6 ", ln).group(1)) for ln in lines]
    assert steps == [2, 4, 6], lines  # every log interval (and the seed's last step)
    assert all(f"loss {losses[s - 1]:.4f} " in ln for s, ln in zip(steps, lines)), lines
    assert "epoch 1/2" in lines[0] and "epoch 2/2" in lines[-1]


# 5, 6. A run_dir or a data dir under a file


@pytest.mark.parametrize("below", ["", "sub"])
def test_a_run_dir_that_is_or_is_under_a_file_is_refused_before_launch(tmp_path, capsys, below):
    from repro.train.config import RunConfigError, derive, load_config

    afile = tmp_path / "afile"
    afile.write_text("x")
    run_dir = afile / below if below else afile
    with pytest.raises(RunConfigError, match=f"{afile} is not a directory"):
        derive(load_config(TINY, [f"run_dir={run_dir}"]), 1)
    assert main(["train", TINY, "--nproc", "2", "--set", f"run_dir={run_dir}", "--set", "parallel.tp=2"]) == 2
    err = capsys.readouterr().err
    assert f"run_dir={run_dir}: {afile} is not a directory" in err and "Fix:" in err, err


def test_data_fetch_into_a_file_is_a_user_error(tmp_path, monkeypatch, capsys):
    afile = tmp_path / "afile"
    afile.write_text("x")
    monkeypatch.setenv("REPRO_DATA_MIRROR", str(tmp_path))  # never the network
    for data_dir in (afile, afile / "sub"):
        assert main(["data", "fetch", "--data-dir", str(data_dir)]) == 2
        err = capsys.readouterr().err
        assert f"{afile} is not a directory" in err and "Fix: give a directory path" in err, err


# 7, 8. environment.yml's extras; write_local_tasks with strings


def test_environment_yml_has_pyprojects_extras_and_the_packaging_test_compares_them():
    from test_packaging import _normalise

    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    pip_block = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict))
    assert "mlflow[auth]>=3.0" in pip_block
    assert _normalise("mlflow[auth]>=3.0") == "mlflow[auth]" != _normalise("mlflow>=3.0")


def test_write_local_tasks_takes_strings(tmp_path):
    from repro.eval.local_tasks import LAMBADA, WIKITEXT_RAW, write_local_tasks

    mirror = mirror_path()
    require(mirror is not None and (mirror / LAMBADA).is_file(), "the data mirror (REPRO_DATA_MIRROR)")
    for rel in (LAMBADA, WIKITEXT_RAW):
        (tmp_path / "data" / rel).parent.mkdir(parents=True, exist_ok=True)
        os.symlink(mirror / rel, tmp_path / "data" / rel)
    out = write_local_tasks(str(tmp_path / "data"), str(tmp_path / "tasks"))
    assert out == tmp_path / "tasks" and (out / "lambada_openai_local.yaml").is_file()
