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
if [[ "$1 $2" == "slurm check" && "${FAKE_CHECK:-ok}" == wait ]]; then  # until the test touches $FAKE_LOG.go
  touch "$FAKE_LOG.checking"
  while [[ ! -f "$FAKE_LOG.go" ]]; do sleep 0.05; done
fi
if [[ "$1 $2" == "data prepare" && "${FAKE_PREPARE:-ok}" == fail ]]; then
  echo "prepare failed (simulated)" >&2; exit 1
fi
exit 0
"""
FAKE_SCONTROL = """#!/bin/bash
# a fake scontrol: hostnames (fail when FAKE_HOSTNAMES=fail), a job record (Requeue=$FAKE_REQUEUE),
# requeue (fails when FAKE_REQUEUE_FAILS=1)
echo "scontrol $*" >> "$FAKE_LOG"
case "$1 $2" in
  "show hostnames")
    [[ "${FAKE_HOSTNAMES:-ok}" == ok ]] || { echo "scontrol: error: unable to resolve node list" >&2; exit 1; }
    echo node001; echo node002 ;;
  "show job") echo "JobId=$3 JobName=scale_8b Restarts=0 Requeue=${FAKE_REQUEUE:-1} Command=${FAKE_COMMAND:-/x.sh} WorkDir=/w StdIn=/dev/null" ;;
  "requeue $SLURM_JOB_ID")
    [[ "${FAKE_REQUEUE_FAILS:-0}" == 0 ]] || { echo "scontrol: error: Requested operation is presently disabled" >&2; exit 1; } ;;
esac
"""
FAKE_GETENT = """#!/bin/bash
# a fake getent: the fake nodes (node001, node002) resolve, as a cluster's do
echo "10.0.0.1        STREAM $2"
"""
FAKE_SRUN = """#!/bin/bash
# a fake srun: logs its arguments and SRUN_CPUS_PER_TASK; with FAKE_STEP=stop it stops as the trainer
# does for a signal (marker, exit 0); with FAKE_STEP=wait it waits for a signal and logs which came
echo "srun $* cpus=${SRUN_CPUS_PER_TASK:-}" >> "$FAKE_LOG"
case "${FAKE_STEP:-ok}" in
  stop) echo 7 > "$REPRO_RUN_DIR/stopped_by_signal" ;;
  wait)
    trap 'echo "step got USR1" >> "$FAKE_LOG"; echo 5 > "$REPRO_RUN_DIR/stopped_by_signal"; exit 0' USR1
    trap 'echo "step got TERM" >> "$FAKE_LOG"; exit 137' TERM
    touch "$FAKE_LOG.started"
    while true; do sleep 0.05; done ;;
esac
"""


def _job_env(tmp_path: Path, wikitext: bool = True, cluster_env: str | None = None, **extra: str) -> dict:
    """The environment of a job without Slurm: fake SLURM_* variables, fake repro/scontrol/srun on
    PATH, cluster.env (by default: REPRO_RUNS_DIR=tmp/runs, REPRO_DATA_DIR=tmp/data), extra variables."""
    import os

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, text in {"repro": FAKE_REPRO, "scontrol": FAKE_SCONTROL, "srun": FAKE_SRUN, "getent": FAKE_GETENT}.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    if wikitext:
        (tmp_path / "data" / "wikitext").mkdir(parents=True, exist_ok=True)
        (tmp_path / "data" / "wikitext" / "wikitext-2.valid.tokens").write_text(" = A = \n\n text\n")
    if cluster_env is None:
        cluster_env = f"REPRO_RUNS_DIR={tmp_path}/runs\nREPRO_DATA_DIR={tmp_path}/data\n"
    (tmp_path / "cluster.env").write_text(cluster_env + "REPRO_ENV_ACTIVATE=none\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "REPRO_"))}
    return {**env, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "REPRO_ROOT": str(ROOT),
            "REPRO_CLUSTER_ENV": str(tmp_path / "cluster.env"), "SLURM_JOB_ID": "42", "SLURM_NTASKS": "2",
            "SLURM_JOB_NAME": "scale_8b", "SLURM_JOB_NODELIST": "node[001-002]",
            "FAKE_LOG": str(tmp_path / "calls"), "FAKE_COMMAND": str(ROOT / "slurm" / "scale_8b.sh"), **extra}


def _run_job(tmp_path: Path, env: dict, *args: str, cwd: Path = ROOT, run_dir: Path | None = None,
             script: str = "scale_8b.sh"):
    """`bash slurm/SCRIPT ARGS` as a job would run it: exit status, job log (else the output), calls."""
    out = subprocess.run(["bash", str(ROOT / "slurm" / script), *args], cwd=cwd, env=env,
                         capture_output=True, text=True, timeout=60)
    run_dir = run_dir or tmp_path / "runs" / f"scale_8b-{env['SLURM_JOB_ID']}"
    log = run_dir / "logs" / f"slurm-{env['SLURM_JOB_ID']}.out"
    calls = (tmp_path / "calls").read_text().splitlines() if (tmp_path / "calls").exists() else []
    return out, (log.read_text() if log.exists() else "") + out.stdout + out.stderr, calls


def _fake_job(tmp_path: Path, wikitext: bool, prepare: str) -> tuple[subprocess.CompletedProcess, str, list[str]]:
    """`slurm/scale_8b.sh --smoke --dry-run` as a job would run it, with fake SLURM_* variables and
    fake repro/scontrol/srun on PATH (no Slurm): exit status, job log, the fake repro's calls."""
    env = _job_env(tmp_path, wikitext, FAKE_PREPARE=prepare)
    out, log, calls = _run_job(tmp_path, env, "--smoke", "--dry-run")
    return out, log, [c for c in calls if not c.startswith("scontrol ")]


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
    assert " --tokenizer gpt2 " in calls[0] and "experiments/tiny/gpt_tiny.yaml" in calls[1]
    assert calls[1].startswith("slurm check --ntasks 2")
    assert f"data.train_prefix={tmp_path}/runs/smoke-data/wiki_train" in calls[1]
    assert "launch.sh: step: srun" in log and not any(c.startswith("srun") for c in calls)  # a dry run


# --- launch.sh and task.sh behaviour without Slurm (fake SLURM_* variables and commands) ---

GPU_SCRIPTS = [s for s in SCRIPTS if s.options.get("gres", "").startswith("gpu:")]


@pytest.mark.parametrize("script", GPU_SCRIPTS, ids=lambda s: s.path.name)
def test_gpu_scripts_take_whole_nodes(script):
    """R1: without --exclusive and --mem=0 a site that binds tasks gives each GPU rank one CPU (shared
    with its data-loader workers) and DefMemPerCPU memory. The 1-4 GPU throughput runs too (Table 1
    configs 1-3, Table 8's 2 and 4 GPUs): their speed-ups are ratios against whole-node runs."""
    assert "exclusive" in script.options and script.options.get("mem") == "0", script.options


def test_prepare_data_asks_for_a_warning_signal_before_its_time_limit():
    """C1: the time limit's own TERM makes srun SIGKILL prepare (temporary files left behind)."""
    options = read_script(ROOT / "slurm" / "prepare_data.sh").options
    assert options.get("signal", "").startswith("B:USR1@"), options


@pytest.mark.parametrize("spec, node, ntasks, expected", [
    ("8(x64)", 63, 512, "8"), ("2,1", 0, 3, "2"), ("2,1", 1, 3, "1"), ("2(x3),1", 2, 7, "2"),
    ("2(x3),1", 3, 7, "1"), (None, 0, 4, "4")])
def test_task_sh_local_world_size_is_this_nodes_task_count(spec, node, ntasks, expected):
    """R8: LOCAL_WORLD_SIZE from the step's per-node layout (it was SLURM_NTASKS without --ntasks-per-node)."""
    env = {"PATH": "/usr/bin:/bin", "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NTASKS": str(ntasks),
           "SLURM_NODEID": str(node), **({"SLURM_STEP_TASKS_PER_NODE": spec} if spec else {})}
    out = subprocess.run(["bash", str(ROOT / "slurm" / "task.sh"), "printenv", "LOCAL_WORLD_SIZE"], env=env,
                         capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == expected, out.stderr


def _job_waiting_at(tmp_path: Path, marker: str, **extra: str) -> subprocess.Popen:
    """`slurm/scale_8b.sh --smoke` started in the background, once the fake touched tmp_path/marker."""
    import time

    job = subprocess.Popen(["bash", str(ROOT / "slurm" / "scale_8b.sh"), "--smoke"], cwd=ROOT,
                           env=_job_env(tmp_path, **extra), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 60
    while not (tmp_path / marker).exists():
        assert job.poll() is None and time.monotonic() < deadline, job.communicate()[0]
        time.sleep(0.05)
    return job


def test_forwards_a_term_to_the_step_as_usr1_and_requeues(tmp_path):
    """C1: srun answers TERM by SIGKILLing its tasks ("forcing job termination"), so a TERM to the batch
    shell goes to the step as USR1, on which the trainer checkpoints (here a fake srun that stops on
    USR1 like the trainer and dies on TERM like srun's tasks)."""
    import os
    import signal

    job = _job_waiting_at(tmp_path, "calls.started", FAKE_STEP="wait")
    os.kill(job.pid, signal.SIGTERM)
    job.wait(timeout=30)
    log = (tmp_path / "runs" / "scale_8b-42" / "logs" / "slurm-42.out").read_text()
    calls = (tmp_path / "calls").read_text().splitlines()
    assert "step got USR1" in calls and "step got TERM" not in calls, log
    assert "received SIGTERM" in log and "forwarding SIGUSR1 to the step" in log, log
    assert job.returncode == 0 and "scontrol requeue 42" in calls, log


@pytest.mark.parametrize("sig", ["SIGUSR1", "SIGTERM"])
def test_a_usr1_before_the_step_requeues_without_starting_it_and_a_term_ends_the_job(tmp_path, sig):
    """A preemption's USR1 while the job is still in its setup (here: during the config check): before,
    its default action ended the job with no requeue. A TERM then (a plain scancel sends one to the
    batch shell too) ends the job, no requeue: requeueing would undo the cancel."""
    import os
    import signal
    import time

    job = _job_waiting_at(tmp_path, "calls.checking", FAKE_CHECK="wait", FAKE_STEP="ok")
    os.kill(job.pid, getattr(signal, sig))
    time.sleep(0.2)
    (tmp_path / "calls.go").touch()
    job.wait(timeout=30)
    log = (tmp_path / "runs" / "scale_8b-42" / "logs" / "slurm-42.out").read_text()
    calls = (tmp_path / "calls").read_text().splitlines()
    assert not any(c.startswith("srun ") for c in calls), (calls, log)
    if sig == "SIGUSR1":
        assert job.returncode == 0 and "scontrol requeue 42" in calls and "before the step started" in log, log
    else:
        assert job.returncode == -signal.SIGTERM and "scontrol requeue 42" not in calls, (job.returncode, log)


def test_the_environment_wins_over_cluster_env(tmp_path):
    """C2/C3: a REPRO_* value given at submit time (REPRO_RUNS_DIR, REPRO_RUN_NAME) is not replaced by
    the file."""
    env = _job_env(tmp_path, cluster_env=f"REPRO_RUNS_DIR={tmp_path}/file-runs\nREPRO_DATA_DIR={tmp_path}/data\n",
                   REPRO_RUNS_DIR=str(tmp_path / "runs"), REPRO_RUN_NAME="mine", REPRO_MASTER_PORT="23456")
    out, log, calls = _run_job(tmp_path, env, "--smoke", "--dry-run", run_dir=tmp_path / "runs" / "mine")
    assert out.returncode == 0, log
    assert f"run dir {tmp_path}/runs/mine" in log and not (tmp_path / "file-runs").exists(), log
    assert "rank-0 rendezvous node001:23456" in log, log


def test_cluster_env_lines_other_than_repro_ones_apply_as_written(tmp_path):
    """A site's PATH=/site/bin:$PATH or NCCL_* line composes with (or replaces) the environment's: only
    REPRO_* values given at submit time win over the file. An empty per-job line is refused too."""
    (tmp_path / "cluster.env").write_text("PATH=/site/bin:$PATH\nNCCL_SOCKET_IFNAME=ib\nREPRO_DATA_DIR=/file/data\n")
    script = ('eval "$(sed -n \'/^source_cluster_env()/,/^}/p\' slurm/launch.sh)"; die() { echo "die: $*"; exit 2; }; '
              'source_cluster_env "$1"; echo "$PATH|$NCCL_SOCKET_IFNAME|$REPRO_DATA_DIR"')
    env = {"PATH": "/usr/bin:/bin", "NCCL_SOCKET_IFNAME": "eth0", "REPRO_DATA_DIR": "/mine"}
    out = subprocess.run(["bash", "-c", script, "_", str(tmp_path / "cluster.env")], cwd=ROOT, env=env,
                         capture_output=True, text=True)
    assert out.stdout.strip() == "/site/bin:/usr/bin:/bin|ib|/mine", out
    (tmp_path / "cluster.env").write_text("REPRO_RUN_NAME=\n")
    out = subprocess.run(["bash", "-c", script, "_", str(tmp_path / "cluster.env")], cwd=ROOT, env=env,
                         capture_output=True, text=True)
    assert out.returncode == 2 and "die: REPRO_RUN_NAME is set in" in out.stdout, out


def test_cluster_env_may_extend_a_library_path_the_job_does_not_have(tmp_path, monkeypatch):
    """`LD_LIBRARY_PATH=/opt/nccl/lib:$LD_LIBRARY_PATH` (slurm/README's example of a site line) with
    the variable unset at submit time: launch.sh sourced it under `set -u` and the job failed at once;
    `repro slurm` checks read it the same way. launch.sh's own `set -u` is back afterwards."""
    from repro.launch.scripts import cluster_settings

    (tmp_path / "cluster.env").write_text("LD_LIBRARY_PATH=/opt/nccl/lib:$LD_LIBRARY_PATH\n")
    script = ('set -euo pipefail; eval "$(sed -n \'/^source_cluster_env()/,/^}/p\' slurm/launch.sh)"; '
              'source_cluster_env "$1"; echo "$LD_LIBRARY_PATH|$-"')
    out = subprocess.run(["bash", "-c", script, "_", str(tmp_path / "cluster.env")], cwd=ROOT,
                         env={"PATH": "/usr/bin:/bin"}, capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.startswith("/opt/nccl/lib:|"), out
    assert "u" in out.stdout.strip().split("|")[1], out  # nounset on again
    monkeypatch.delenv("LD_LIBRARY_PATH", raising=False)
    assert cluster_settings(tmp_path / "cluster.env")["LD_LIBRARY_PATH"] == "/opt/nccl/lib:"


@pytest.mark.parametrize("line", ["REPRO_RUN_NAME=shared", "REPRO_MASTER_PORT=23456", "REPRO_MASTER_ADDR=10.0.0.7"])
def test_a_per_job_variable_in_cluster_env_is_refused(tmp_path, line):
    """C2/C3: the shared file is read by every job: one run dir, one port or one rank-0 address for all."""
    env = _job_env(tmp_path, cluster_env=f"REPRO_RUNS_DIR={tmp_path}/runs\nREPRO_DATA_DIR={tmp_path}/data\n{line}\n")
    out, log, _ = _run_job(tmp_path, env, "--smoke", "--dry-run")
    name = line.split("=")[0]
    assert out.returncode == 2 and f"{name} is set in {tmp_path}/cluster.env" in out.stderr, log
    assert f"give it at submit time, e.g. {line} sbatch" in out.stderr and not (tmp_path / "runs").exists()


def test_cluster_settings_let_the_environment_win_and_refuse_per_job_values(tmp_path, monkeypatch):
    """`repro slurm submit` sees the settings launch.sh sees (C2/C3)."""
    from repro.launch.scripts import ClusterEnvError, cluster_settings

    env_file = tmp_path / "cluster.env"
    env_file.write_text("REPRO_RUNS_DIR=/file/runs\nREPRO_PARTITION=gpu\n")
    monkeypatch.setenv("REPRO_RUNS_DIR", "/mine")
    settings = cluster_settings(env_file)
    assert (settings["REPRO_RUNS_DIR"], settings["REPRO_PARTITION"]) == ("/mine", "gpu")
    env_file.write_text("REPRO_RUN_NAME=shared\n")
    with pytest.raises(ClusterEnvError, match="sets REPRO_RUN_NAME.*REPRO_RUN_NAME=shared repro slurm submit"):
        cluster_settings(env_file)
    monkeypatch.setenv("REPRO_RUN_NAME", "mine")
    assert cluster_settings(env_file)["REPRO_RUN_NAME"] == "mine"
    monkeypatch.delenv("REPRO_RUN_NAME")
    env_file.write_text("REPRO_RUN_NAME=\n")  # empty: launch.sh refuses it as well
    with pytest.raises(ClusterEnvError, match="sets REPRO_RUN_NAME"):
        cluster_settings(env_file)
    env_file.write_text("PATH=/site/bin:$PATH\n")  # not REPRO_*: the file's line applies
    assert cluster_settings(env_file)["PATH"].startswith("/site/bin:")


def test_a_script_outside_a_job_says_how_to_submit_it_and_how_to_dry_run(tmp_path):
    """`bash slurm/scale_8b.sh --dry-run` on a login node: exit 2 naming sbatch and the dry runs that
    work (it used to say to set SLURM_JOB_ID in cluster.env)."""
    env = {k: v for k, v in _job_env(tmp_path).items() if not k.startswith("SLURM_")}
    out = subprocess.run(["bash", "slurm/scale_8b.sh", "--dry-run"], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 2 and "not inside a Slurm job (no SLURM_JOB_ID)" in out.stderr, out.stderr
    assert "`sbatch slurm/scale_8b.sh --dry-run`" in out.stderr and "cluster.env" not in out.stderr
    assert "`repro slurm submit --dry-run slurm/scale_8b.sh`" in out.stderr
    assert not (tmp_path / "runs").exists()


def test_the_example_cluster_env_sources_without_user(monkeypatch):
    """A batch environment without $USER (some container runtimes): the example still sources under
    launch.sh's `set -u` and names the user's own directories."""
    import getpass

    from repro.launch.scripts import cluster_settings

    monkeypatch.delenv("USER", raising=False)
    monkeypatch.delenv("REPRO_RUNS_DIR", raising=False)
    settings = cluster_settings(ROOT / "slurm" / "cluster.env.example")
    assert settings["REPRO_RUNS_DIR"] == f"/shared/{getpass.getuser()}/megatron-repro/runs"


@pytest.mark.parametrize("checkpoint", [False, True])
def test_a_restart_without_a_checkpoint_warns_naming_the_run_dir(tmp_path, checkpoint):
    """C3: a requeued piece that finds no checkpoint (cluster.env moved REPRO_RUNS_DIR) says so loudly."""
    if checkpoint:
        (tmp_path / "runs" / "scale_8b-42" / "checkpoints").mkdir(parents=True)
        (tmp_path / "runs" / "scale_8b-42" / "checkpoints" / "latest").write_text("iter_0000005")
    out, log, _ = _run_job(tmp_path, _job_env(tmp_path, SLURM_RESTART_COUNT="1"), "--smoke", "--dry-run")
    assert out.returncode == 0, log
    warned = f"its run dir {tmp_path}/runs/scale_8b-42 holds no checkpoint" in log and "cluster.env" in log
    assert warned != checkpoint, log


def test_a_failed_requeue_says_how_to_continue_and_exits_3(tmp_path):
    """R5: a job that is not requeueable is told so at the start; when `scontrol requeue` fails after
    the checkpoint, the log gives the command that continues the run, and the exit status is 3."""
    env = _job_env(tmp_path, FAKE_STEP="stop", FAKE_REQUEUE="0", FAKE_REQUEUE_FAILS="1")
    out, log, calls = _run_job(tmp_path, env, "--smoke")
    assert "WARNING: job 42 is not requeueable" in log, log
    assert out.returncode == 3 and "scontrol requeue 42" in calls, log
    assert (f"launch.sh:     REPRO_CLUSTER_ENV={tmp_path}/cluster.env REPRO_ROOT={ROOT} REPRO_RUNS_DIR={tmp_path}/runs "
            f"REPRO_RUN_NAME=scale_8b-42 sbatch {ROOT}/slurm/scale_8b.sh --smoke") in log.splitlines(), log


def test_the_continue_command_keeps_a_script_path_with_spaces_and_the_submit_time_settings(tmp_path):
    """scontrol prints `Command=SCRIPT ARGS... WorkDir=`: the script path is all of it but the job's
    arguments (it was cut at the first space); REPRO_* variables given at submit time are repeated,
    quoted, and a non-numeric stop marker is named as it is."""
    script = tmp_path / "my repo" / "slurm" / "scale_8b.sh"
    script.parent.mkdir(parents=True)
    script.write_text("#!/bin/bash\n")
    env = _job_env(tmp_path, FAKE_STEP="stop", FAKE_REQUEUE_FAILS="1", FAKE_COMMAND=f"{script} --smoke --set x=1",
                   REPRO_EXTRA_NOTE="a b")
    out, log, _ = _run_job(tmp_path, env, "--smoke", "--set", "x=1")
    assert out.returncode == 3, log
    assert (f"launch.sh:     REPRO_CLUSTER_ENV={tmp_path}/cluster.env REPRO_EXTRA_NOTE=a\\ b REPRO_ROOT={ROOT} "
            f"REPRO_RUNS_DIR={tmp_path}/runs REPRO_RUN_NAME=scale_8b-42 sbatch {tmp_path}/my\\ repo/slurm/scale_8b.sh "
            "--smoke --set x=1") in log.splitlines(), log
    assert "not requeueable" not in log and "stopped for the signal at iteration 7 (checkpointed)" in log, log


def test_race_finetune_warns_and_continues_like_a_training_job(tmp_path):
    """RACE requeues itself on USR1 (resume by seed), so it gets the training jobs' safety net: the
    not-requeueable warning, and a continue command with its arguments and REPRO_BERT_CHECKPOINT."""
    checkpoint = tmp_path / "bert run"
    checkpoint.mkdir()
    env = _job_env(tmp_path, FAKE_STEP="stop", FAKE_REQUEUE="0", FAKE_REQUEUE_FAILS="1", SLURM_JOB_NAME="race_finetune",
                   FAKE_COMMAND=f"{ROOT}/slurm/race_finetune.sh --smoke --epochs 1", REPRO_BERT_CHECKPOINT=str(checkpoint))
    out, log, calls = _run_job(tmp_path, env, "--smoke", "--epochs", "1", script="race_finetune.sh",
                               run_dir=tmp_path / "runs" / "race_finetune-42")
    assert out.returncode == 3 and "WARNING: job 42 is not requeueable" in log, log
    assert any(c.startswith("srun ") and "repro finetune race" in c and "--epochs 1 cpus=" in c for c in calls), calls
    continue_line = next(line for line in log.splitlines() if line.startswith("launch.sh:     "))
    assert continue_line.startswith(f"launch.sh:     REPRO_BERT_CHECKPOINT={tmp_path}/bert\\ run "), continue_line
    assert continue_line.endswith(f"REPRO_RUN_NAME=race_finetune-42 sbatch {ROOT}/slurm/race_finetune.sh --smoke --epochs 1")


def test_a_step_that_trains_nothing_checks_the_network_settings_first(tmp_path):
    """selftest.sh (launch_step): `repro slurm check-network` runs on the batch host before srun."""
    env = _job_env(tmp_path, FAKE_STEP="ok", SLURM_JOB_NAME="selftest")
    out, log, calls = _run_job(tmp_path, env, script="selftest.sh", run_dir=tmp_path / "runs" / "selftest-42")
    steps = [c.split()[0] if c.startswith("srun ") else c for c in calls if not c.startswith("scontrol ")]
    assert out.returncode == 0 and steps == ["slurm check-network", "srun"], (steps, log)


def test_cpus_per_gpu_leaves_srun_its_own_setting(tmp_path):
    """sbatch --cpus-per-gpu puts SLURM_CPUS_PER_GPU in the job; srun reads it and refuses it beside
    SRUN_CPUS_PER_TASK ("mutually exclusive"), so launch.sh sets no CPUs per task then."""
    env = _job_env(tmp_path, FAKE_STEP="ok", SLURM_CPUS_PER_GPU="4", SLURM_CPUS_ON_NODE="16", SLURM_TASKS_PER_NODE="2")
    out, log, calls = _run_job(tmp_path, env, "--smoke")
    srun = [c for c in calls if c.startswith("srun ")]
    assert out.returncode == 0 and srun[0].endswith("cpus=") and "CPUs per GPU: 4" in log, (log, srun)


def test_a_failing_scontrol_hostnames_stops_the_job_naming_it(tmp_path):
    """R7: it surfaced as `hosts[0]: unbound variable`."""
    out, log, _ = _run_job(tmp_path, _job_env(tmp_path, FAKE_HOSTNAMES="fail"), "--smoke", "--dry-run")
    assert out.returncode == 2 and "`scontrol show hostnames node[001-002]` failed" in log, log
    assert "unbound variable" not in log and "step:" not in log, log


def _free_pair() -> int:
    """A port p in 15001..29998 with p and p + 1 free on this host."""
    import random
    import socket

    for _ in range(200):
        port = random.randint(15001, 29998)
        try:
            for p in (port, port + 1):
                with socket.socket() as s:
                    s.bind(("", p))
            return port
        except OSError:
            continue
    raise RuntimeError("no two free ports in 15001..29998")


@pytest.mark.parametrize("probe", ["ss", "python3", "/dev/tcp"])
def test_the_rank0_port_skips_one_in_use(tmp_path, probe):
    """R2: the port derived from the job id is probed on the batch host (rank 0's): `ss`, else a
    python3 bind, else bash's /dev/tcp (a PATH without ss, python3 here)."""
    import os
    import socket

    port = _free_pair()
    env = _job_env(tmp_path, SLURM_JOB_ID=str(port - 15000))
    if probe != "ss":  # a PATH like /usr/bin without ss (and python3)
        usr_bin = tmp_path / "usr-bin"
        usr_bin.mkdir()
        for entry in os.scandir("/usr/bin"):
            if entry.name != "ss" and not (probe == "/dev/tcp" and entry.name.startswith("python")):
                (usr_bin / entry.name).symlink_to(entry.path)
        env["PATH"] = f"{tmp_path / 'bin'}:{usr_bin}:/usr/sbin"
    with socket.socket() as listener:
        listener.bind(("", port))
        listener.listen()
        out, log, _ = _run_job(tmp_path, env, "--smoke", "--dry-run")
    assert out.returncode == 0, log
    assert f"port {port} is in use" in log and f"rank-0 rendezvous node001:{port + 1}" in log, log


@pytest.mark.parametrize("cpus, tasks_per_node, given, expected", [
    ("16", "2", None, "CPUs per task: 8 (16 on the node, 2 tasks)"), ("96", "8(x2)", None, "CPUs per task: 12 "),
    ("16", "2", "3", None)])
def test_srun_tasks_get_the_nodes_cpus_divided_among_them(tmp_path, cpus, tasks_per_node, given, expected):
    """R1: without --cpus-per-task a task got one CPU for the rank and its data-loader workers."""
    extra = {"SLURM_CPUS_ON_NODE": cpus, "SLURM_TASKS_PER_NODE": tasks_per_node}
    if given:
        extra["SLURM_CPUS_PER_TASK"] = given
    out, log, calls = _run_job(tmp_path, _job_env(tmp_path, FAKE_STEP="ok", **extra), "--smoke")
    assert out.returncode == 0, log
    srun = [c for c in calls if c.startswith("srun ")]
    if expected:
        assert expected in log and srun[0].endswith(f"cpus={expected.split()[3]}"), (log, srun)
    else:
        assert "CPUs per task" not in log and srun[0].endswith(f"cpus={given}"), (log, srun)


def test_a_lock_held_too_long_stops_the_job_naming_it(tmp_path):
    """R6: `flock` without a timeout kept every other job of the user waiting, allocation held."""
    import fcntl

    (tmp_path / "runs").mkdir()
    import os

    lock = tmp_path / "runs" / f".check.{os.getuid()}.lock"
    with open(lock, "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        out, log, calls = _run_job(tmp_path, _job_env(tmp_path, REPRO_LOCK_WAIT_S="1"), "--smoke", "--dry-run")
    assert out.returncode == 2 and f"waited 1 s for the lock {lock} (the config check)" in log, log
    assert not any(c.startswith("slurm check") for c in calls) and "step:" not in log, log


def test_a_relative_runs_dir_is_taken_from_the_repository_root(tmp_path):
    """R9: the batch shell (in the submit dir) and the tasks (in REPRO_ROOT) resolved it differently."""
    import os

    submit = tmp_path / "elsewhere" / "deeper"
    submit.mkdir(parents=True)
    relative = os.path.relpath(tmp_path / "runs", ROOT)
    env = _job_env(tmp_path, cluster_env=f"REPRO_RUNS_DIR={relative}\nREPRO_DATA_DIR={tmp_path}/data\n")
    out, log, calls = _run_job(tmp_path, env, "--smoke", "--dry-run", cwd=submit)
    assert out.returncode == 0, log
    assert f"run dir {tmp_path}/runs/scale_8b-42," in log, log
    check = [c for c in calls if c.startswith("slurm check")]
    assert f"run_dir={tmp_path}/runs/scale_8b-42" in check[0], check


def test_slurm_status_asks_sacct_only_for_fields_it_has(tmp_path):
    """`repro slurm status JOB` on a cluster with accounting: the real sacct (reading an empty
    job-completion file, no daemons) accepts the command; it refused the old `Restarts` field, so
    the status of any job failed wherever sacct works."""
    import os

    from repro.launch.commands import sacct_status_command

    require(shutil.which("sacct") is not None, "sacct (install: make slurm-deps)")
    (tmp_path / "jobcomp.txt").write_text("")
    (tmp_path / "slurm.conf").write_text(
        f"ClusterName=status-test\nSlurmctldHost=localhost(127.0.0.1)\nJobCompType=jobcomp/filetxt\n"
        f"JobCompLoc={tmp_path}/jobcomp.txt\nNodeName=n1 CPUs=1\nPartitionName=debug Nodes=n1\n")
    env = {**os.environ, "SLURM_CONF": str(tmp_path / "slurm.conf")}

    def sacct(cmd: list[str]) -> subprocess.CompletedProcess:
        return subprocess.run([cmd[0], "-c", "--file", str(tmp_path / "jobcomp.txt"), *cmd[1:]], env=env,
                              capture_output=True, text=True, timeout=30)

    out = sacct(sacct_status_command(["1234", "1235"]))
    assert out.returncode == 0 and out.stdout.split()[:4] == ["JobID", "JobName", "State", "ExitCode"], out
    old = sacct(["sacct", "-X", "-j", "1234", "--format=JobID,Restarts"])
    assert old.returncode != 0 and 'Invalid field requested: "Restarts"' in old.stderr, old
