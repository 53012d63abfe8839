"""Issue 7: every job script in slurm/ is valid bash, shellcheck-clean, and names a config that exists
and validates at the script's task count; the tables of `repro slurm sweep` cover them all. No Slurm
needed (shellcheck is: `make slurm-deps`)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import require
from repro.launch.scripts import TABLES, job_scripts, read_script
from repro.train.config import derive, load_config

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = job_scripts()
SHELL = sorted((ROOT / "slurm").glob("*.sh")) + sorted((ROOT / "scripts").glob("*.sh"))


def test_every_paper_experiment_has_a_script():
    names = {s.path.stem for s in SCRIPTS}
    assert names == {n for table in TABLES.values() for n in table}
    assert len(SCRIPTS) == 21  # 8 scaling, 3 GPT-2, 3 BERT, RACE, zero-shot, 5 Appendix D (2 heads, 3 strong)


def test_scripts_are_valid_bash_and_shellcheck_clean():
    for path in SHELL:
        out = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
        assert out.returncode == 0, f"{path.name}: {out.stderr}"
    require(shutil.which("shellcheck") is not None, "shellcheck (install: make slurm-deps)")
    out = subprocess.run(["shellcheck", "-x", *[str(p.relative_to(ROOT)) for p in SHELL]], cwd=ROOT,
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stdout


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda s: s.path.name)
def test_script_names_a_config_that_validates_at_its_task_count(script):
    assert script.config, f"{script.path.name} names no experiments/*.yaml"
    assert (ROOT / script.config).exists(), f"{script.path.name}: {script.config} does not exist"
    cfg = load_config(ROOT / script.config)
    derived = derive(cfg, script.ntasks)
    assert derived.dp * cfg.parallel.tp == script.ntasks
    for key in ("job-name", "time", "gres", "signal"):
        no_checkpoint = script.path.stem in ("zeroshot_eval", "race_finetune")  # nothing to save on USR1
        assert key in script.options or (key == "signal" and no_checkpoint), key
    if "signal" in script.options:
        assert script.options["signal"].startswith("B:USR1@")


def test_gpu_counts_are_the_papers():
    gpus = {s.path.stem: s.ntasks for s in SCRIPTS}
    assert [gpus[n] for n in TABLES["table1-tp"]] == [1, 2, 4, 8]
    assert [gpus[n] for n in TABLES["table1-tpdp"]] == [64, 128, 256, 512]
    assert [gpus[n] for n in TABLES["table2"]] == [64, 128, 512]
    assert [gpus[n] for n in TABLES["table4"]] == [128, 256, 512]


def _repro(*args, env=None):
    return subprocess.run([sys.executable, "-m", "repro.cli", *args], capture_output=True, text=True,
                          cwd=ROOT, env=env)


def test_check_refuses_a_family_that_does_not_match_the_sizes():
    """BERT sizes trained as family=gpt would silently train a GPT: stopped before srun."""
    out = _repro("slurm", "check", "experiments/bert/bert_336m.yaml", "--ntasks", "128", "--set", "family=gpt")
    assert out.returncode == 2 and "add `family: bert`" in out.stderr, out.stderr


def test_check_names_a_bad_layout(tmp_path):
    out = _repro("slurm", "check", "experiments/scaling/scale_8b.yaml", "--ntasks", "6")
    assert out.returncode == 2 and "tp=8" in out.stderr and "6" in out.stderr, out.stderr


def test_sweep_dry_run_submits_a_table_with_the_cluster_partition(tmp_path):
    import os

    env_file = tmp_path / "cluster.env"
    env_file.write_text("REPRO_PARTITION=gpu\nREPRO_ACCOUNT=proj42\nREPRO_RUNS_DIR=/shared/runs\n"
                        "REPRO_DATA_DIR=/shared/data\n")
    out = _repro("slurm", "sweep", "table1-tp", "--dry-run", env={**os.environ, "REPRO_CLUSTER_ENV": str(env_file)})
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert [line.split()[-1].rsplit("/", 1)[-1] for line in lines] == [f"{n}.sh" for n in TABLES["table1-tp"]]
    assert all(" -p gpu -A proj42 " in line for line in lines)
    bad = _repro("slurm", "sweep", "table9", "--dry-run")
    assert bad.returncode == 2 and "table1-tp" in bad.stderr


def test_read_script_counts_tasks(tmp_path):
    path = tmp_path / "x.sh"
    path.write_text("#!/bin/bash\n#SBATCH --nodes=4\n#SBATCH --ntasks-per-node=8\nlaunch_train experiments/a.yaml\n")
    script = read_script(path)
    assert (script.ntasks, script.config) == (32, "experiments/a.yaml")
