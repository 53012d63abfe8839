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


FAKE_REPRO = """#!/bin/bash
# a fake `repro`: logs its arguments; `repro data prepare` fails when FAKE_PREPARE=fail
echo "$*" >> "$FAKE_LOG"
if [[ "$1 $2" == "data prepare" && "${FAKE_PREPARE:-ok}" == fail ]]; then
  echo "prepare failed (simulated)" >&2; exit 1
fi
exit 0
"""


def _fake_job(tmp_path: Path, wikitext: bool, prepare: str) -> tuple[subprocess.CompletedProcess, str, list[str]]:
    """`slurm/scale_8b.sh --smoke --dry-run` as a job would run it, with fake SLURM_* variables and
    fake repro/scontrol/srun on PATH (no Slurm): exit status, job log, the fake repro's calls."""
    import os

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fakes = {"repro": FAKE_REPRO, "scontrol": "#!/bin/bash\necho node001\n",
             "srun": '#!/bin/bash\necho "srun $*" >> "$FAKE_LOG"\n'}
    for name, text in fakes.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    if wikitext:
        (tmp_path / "data" / "wikitext").mkdir(parents=True)
        (tmp_path / "data" / "wikitext" / "wikitext-2.valid.tokens").write_text(" = A = \n\n text\n")
    (tmp_path / "cluster.env").write_text(f"REPRO_RUNS_DIR={tmp_path}/runs\nREPRO_DATA_DIR={tmp_path}/data\n"
                                          "REPRO_ENV_ACTIVATE=none\n")
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "REPRO_ROOT": str(ROOT),
           "REPRO_CLUSTER_ENV": str(tmp_path / "cluster.env"), "SLURM_JOB_ID": "42", "SLURM_NTASKS": "2",
           "SLURM_JOB_NAME": "scale_8b", "SLURM_JOB_NODELIST": "node001", "FAKE_LOG": str(tmp_path / "calls"),
           "FAKE_PREPARE": prepare}
    out = subprocess.run(["bash", "slurm/scale_8b.sh", "--smoke", "--dry-run"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=60)
    log = tmp_path / "runs" / "scale_8b-42" / "logs" / "slurm-42.out"
    calls = (tmp_path / "calls").read_text().splitlines() if (tmp_path / "calls").exists() else []
    return out, log.read_text() if log.exists() else out.stdout + out.stderr, calls


@pytest.mark.parametrize("wikitext, prepare, needle", [
    (False, "ok", "smoke mode needs"), (True, "fail", "prepare failed (simulated)")])
def test_smoke_mode_stops_when_the_smoke_corpus_cannot_be_prepared(tmp_path, wikitext, prepare, needle):
    """launch.sh without a cluster: before, `data="$(smoke_corpus)"` dropped set -e, so the job went on
    to `repro slurm check` and the srun step on a corpus that was not there (exit 0)."""
    out, log, calls = _fake_job(tmp_path, wikitext, prepare)
    assert out.returncode == 2, log
    assert needle in log and f"no smoke corpus at {tmp_path}/runs/smoke-data/wiki" in log, log
    assert not any(c.startswith("slurm check") for c in calls) and "step:" not in log, log


def test_smoke_mode_prepares_the_corpus_once_then_checks_and_prints_the_step(tmp_path):
    out, log, calls = _fake_job(tmp_path, wikitext=True, prepare="ok")
    assert out.returncode == 0, log
    assert calls[0].startswith(f"data prepare --input {tmp_path}/data/wikitext/wikitext-2.valid.tokens")
    assert calls[1].startswith("slurm check --ntasks 2")
    assert f"data.train_prefix={tmp_path}/runs/smoke-data/wiki_train" in calls[1]
    assert "launch.sh: step: srun" in log and not any(c.startswith("srun") for c in calls)  # a dry run
