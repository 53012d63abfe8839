"""`repro slurm submit | sweep` against a fake `sbatch` on PATH (no Slurm): options may stand between
the script and `--`, and a sweep whose later sbatch fails names the jobs it already queued."""

from __future__ import annotations

import os
import shlex
import shutil
from pathlib import Path

import pytest

from repro.cli import main
from repro.launch.scripts import TABLES

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = str(ROOT / "slurm" / "scale_8b.sh")
FAKE_SBATCH = """#!/bin/bash
# a fake sbatch: logs its arguments, refuses any script named in $SBATCH_REFUSE, else a new job id
echo "$*" >> "$SBATCH_LOG"
echo "cluster env: $REPRO_CLUSTER_ENV" >> "$SBATCH_LOG.env"
echo "$PWD" >> "$SBATCH_LOG.cwd"
case "$*" in *"$SBATCH_REFUSE"*)
  echo "sbatch: error: Batch job submission failed: Job violates accounting/QOS policy" >&2; exit 1;; esac
echo "$((7000 + $(wc -l < "$SBATCH_LOG")));cluster"
"""


@pytest.fixture
def sbatch(tmp_path, monkeypatch) -> Path:
    """A fake sbatch first on PATH and complete cluster settings; returns the log of its calls."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "sbatch").write_text(FAKE_SBATCH)
    (bin_dir / "sbatch").chmod(0o755)
    (tmp_path / "cluster.env").write_text("REPRO_RUNS_DIR=/shared/runs\nREPRO_DATA_DIR=/shared/data\n")
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("REPRO_CLUSTER_ENV", str(tmp_path / "cluster.env"))
    monkeypatch.setenv("SBATCH_LOG", str(tmp_path / "sbatch.log"))
    monkeypatch.setenv("SBATCH_REFUSE", "no script is refused")
    return tmp_path / "sbatch.log"


def _calls(log: Path) -> list[str]:
    return log.read_text().splitlines() if log.exists() else []


@pytest.mark.parametrize("argv", [
    ["slurm", "submit", SCRIPT, "--dry-run", "--", "--smoke", "--set", "train.train_iters=100"],
    ["slurm", "submit", "--dry-run", SCRIPT, "--", "--smoke", "--set", "train.train_iters=100"],
])
def test_submit_dry_run_before_or_after_the_script(sbatch, capsys, argv):
    """Before: the first order was 'unrecognized arguments: -- --smoke' with a hint to do just that."""
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert out.strip().endswith("slurm/scale_8b.sh --smoke --set train.train_iters=100"), out
    assert _calls(sbatch) == []  # a dry run: nothing submitted


@pytest.mark.parametrize("argv", [
    ["slurm", "sweep", "table1-tp", "--dry-run", "--", "--set", "train.train_iters=100"],
    ["slurm", "sweep", "--dry-run", "table1-tp", "--", "--set", "train.train_iters=100"],
])
def test_sweep_dry_run_before_or_after_the_table(sbatch, capsys, argv):
    assert main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[-3].rsplit("/", 1)[-1] for line in lines] == [f"{n}.sh" for n in TABLES["table1-tp"]]
    assert all(line.endswith(" --set train.train_iters=100") for line in lines) and _calls(sbatch) == []


def test_only_the_first_separator_is_ours_and_no_separator_still_names_it(sbatch, capsys):
    assert main(["slurm", "submit", SCRIPT, "--dry-run", "--", "--set", "train.train_iters=1", "--", "x"]) == 0
    assert capsys.readouterr().out.strip().endswith("scale_8b.sh --set train.train_iters=1 -- x")
    with pytest.raises(SystemExit) as exit_:
        main(["slurm", "submit", SCRIPT, "--smoke"])
    assert exit_.value.code == 2 and "go after `--`" in capsys.readouterr().err


def test_submit_puts_the_script_arguments_on_sbatch(sbatch, capsys):
    assert main(["slurm", "submit", str(ROOT / "slurm/scale_1b.sh"), "--", "--smoke"]) == 0
    assert "submitted job 7001" in capsys.readouterr().out
    assert _calls(sbatch) == [f"--parsable {ROOT}/slurm/scale_1b.sh --smoke"]


def test_sbatch_options_and_dependencies_go_before_the_script(sbatch, capsys):
    """`--after` and `--sbatch` reach sbatch ahead of the script (after it they would be the script's own
    arguments); before, `repro slurm submit` had no way to chain an evaluation after its training job."""
    assert main(["slurm", "submit", str(ROOT / "slurm/scale_1b.sh"), "--after", "41", "--after", "42_3",
                 "--sbatch=--qos=high -t '4:00:00'", "--sbatch=--mail-type=END", "--", "--smoke"]) == 0
    assert _calls(sbatch) == [f"--parsable --dependency=afterok:41:42_3 --qos=high -t 4:00:00 --mail-type=END "
                              f"{ROOT}/slurm/scale_1b.sh --smoke"]


@pytest.mark.parametrize("given, named", [
    (["--after", "last"], "--after last: give a Slurm job id such as 1234"),
    (["--sbatch=qos=high"], "sbatch options start with '-'. Fix: --sbatch=--time=4:00:00"),
    (["--sbatch=--job-name='a b"], "No closing quotation. Fix: quote each option once"),
])
def test_a_malformed_sbatch_option_is_refused_before_sbatch(sbatch, capsys, given, named):
    assert main(["slurm", "submit", SCRIPT, *given]) == 2
    assert named in capsys.readouterr().err
    with pytest.raises(SystemExit, match="2"):  # an sbatch option given as submit's own
        main(["slurm", "submit", SCRIPT, "--qos=high"])
    assert "sbatch's in --sbatch=OPTION" in capsys.readouterr().err
    assert _calls(sbatch) == []


def test_a_stopped_sweep_names_the_rest_with_its_sbatch_options(sbatch, capsys, monkeypatch):
    """The fix commands carry the sweep's sbatch options so that, pasted, they submit with the same ones:
    an option with its own value (`-t 4:00:00`) and a value with a space stay whole (reprinted a word per
    --sbatch, they were split again: `--sbatch=4:00:00` refused, `b` taken by sbatch for the script)."""
    monkeypatch.setenv("SBATCH_REFUSE", "gpt2_2.5b")
    assert main(["slurm", "sweep", "table2", "--after", "9", "--sbatch=--qos=high -t 4:00:00",
                 "--sbatch=--comment='a b'", "--", "--set", "train.train_iters=1"]) == 2
    fix = capsys.readouterr().err.split("submit only those: ")[1].split("; ")[-1].strip()
    assert fix.startswith(f"repro slurm submit {ROOT}/slurm/gpt2_8.3b.sh --sbatch=") and fix.endswith(" -- --set train.train_iters=1")
    options = ["--dependency=afterok:9", "--qos=high", "-t", "4:00:00", "--comment=a b"]
    assert _calls(sbatch)[0] == f"--parsable {' '.join(options)} {ROOT}/slurm/gpt2_355m.sh --set train.train_iters=1"
    assert main(["slurm", *shlex.split(fix)[2:]]) == 0  # pasted: the same options reach sbatch
    printed = capsys.readouterr().out.splitlines()[0]  # the sbatch command, one shell word per argument
    assert shlex.split(printed) == ["sbatch", "--parsable", *options, f"{ROOT}/slurm/gpt2_8.3b.sh", "--set", "train.train_iters=1"]


def test_a_script_outside_slurm_is_submitted_from_the_repository_root(sbatch, capsys, tmp_path):
    """A job script copied elsewhere to edit (its `source ${SLURM_SUBMIT_DIR}/slurm/launch.sh` needs the
    repository root as the submit directory). Before, sbatch ran in the script's grandparent directory."""
    mine = tmp_path / "my jobs" / "big" / "scale_1b_mine.sh"
    mine.parent.mkdir(parents=True)
    shutil.copy(ROOT / "slurm/scale_1b.sh", mine)
    assert main(["slurm", "submit", str(mine)]) == 0
    assert _calls(sbatch) == [f"--parsable {mine}"]
    assert Path(f"{sbatch}.cwd").read_text().splitlines() == [str(ROOT)]


def test_sweep_prints_each_job_at_once_and_a_failure_names_the_queued_and_the_rest(sbatch, capsys, monkeypatch):
    """table2 with gpt2_2.5b refused (QOS): gpt2_355m's job 7001 is named in the output as soon as it
    is queued and again in the error (before: never printed, so a rerun queued a second 64-GPU job),
    and the error names the scripts not submitted with the commands that submit only them."""
    monkeypatch.setenv("SBATCH_REFUSE", "gpt2_2.5b")
    assert main(["slurm", "sweep", "table2", "--", "--set", "train.train_iters=100"]) == 2
    out, err = capsys.readouterr()
    assert "submitted job 7001 (gpt2_355m.sh)" in out
    assert "sbatch gpt2_2.5b.sh failed: sbatch: error: Batch job submission failed" in err
    assert "Already submitted (queued or running; do not submit them again): job 7001 (gpt2_355m.sh)" in err
    assert "Not submitted: gpt2_2.5b.sh, gpt2_8.3b.sh" in err
    assert f"repro slurm submit {ROOT}/slurm/gpt2_8.3b.sh -- --set train.train_iters=100" in err
    assert len(_calls(sbatch)) == 2  # stopped at the refusal: gpt2_8.3b not tried


def test_a_sweep_that_submits_everything_lists_every_job(sbatch, capsys):
    assert main(["slurm", "sweep", "table2"]) == 0
    out = capsys.readouterr().out
    assert [line for line in out.splitlines() if line.startswith("submitted")] == [
        "submitted job 7001 (gpt2_355m.sh)", "submitted job 7002 (gpt2_2.5b.sh)", "submitted job 7003 (gpt2_8.3b.sh)"]
    assert "table2: jobs 7001 7002 7003; follow with `repro slurm status 7001 7002 7003`" in out


def test_a_sweep_refuses_a_per_job_variable_that_every_job_would_share(sbatch, capsys, monkeypatch):
    monkeypatch.setenv("REPRO_RUN_NAME", "mine")
    assert main(["slurm", "sweep", "table2"]) == 2
    err = capsys.readouterr().err
    assert "REPRO_RUN_NAME is set, and each of the 3 jobs of table2 would take it (one run dir for all)" in err
    assert _calls(sbatch) == []
    assert main(["slurm", "submit", SCRIPT]) == 0  # one job may have it


def test_check_prints_the_planned_memory(capsys):
    """`repro slurm check` (which every job runs before srun) states the plan's peak memory per rank."""
    from repro.perf.plan import memory_plan
    from repro.train.config import derive, load_config

    config = str(ROOT / "experiments" / "tiny" / "gpt_tiny.yaml")
    assert main(["slurm", "check", config, "--ntasks", "2", "--set", "tracking.enabled=false"]) == 0
    cfg = load_config(config, ["tracking.enabled=false"])
    expected = memory_plan(cfg, derive(cfg, 2), "cpu").peak / 2**30
    assert f"planned peak memory per rank: {expected:.2f} GiB (CPU)" in capsys.readouterr().out


def test_check_plans_a_gpu_run_for_the_gpu_even_where_none_is_visible(capsys):
    """On a login node (no GPU) a GPU config's check used to state the CPU plan (
    19.91 GiB for gpt2_8.3b at 512 tasks against the GPU plan's 19.54)."""
    import torch

    from repro.perf.plan import memory_plan
    from repro.train.config import derive, load_config

    config = str(ROOT / "experiments" / "gpt2" / "gpt2_8.3b.yaml")
    assert main(["slurm", "check", config, "--ntasks", "512", "--set", "tracking.enabled=false"]) == 0
    cfg = load_config(config, ["tracking.enabled=false"])
    gpu, cpu = (memory_plan(cfg, derive(cfg, 512), d).peak / 2**30 for d in ("cuda", "cpu"))
    out = capsys.readouterr().out
    assert f"planned peak memory per GPU: {gpu:.2f} GiB" in out and f"{cpu:.2f}" not in out
    assert torch.cuda.is_available() or "no GPU visible here" in out


def test_appendix_d_sweeps_leave_table1s_jobs_to_table1(sbatch, capsys):
    """table7 and table8 used to submit scale_8b / scale_1b again after a table1 sweep had run them."""
    assert main(["slurm", "sweep", "table7"]) == 0
    assert [c.split()[-1].rsplit("/", 1)[-1] for c in _calls(sbatch)] == ["heads_8b_16.sh", "heads_8b_24.sh"]
    assert "its 32-head row is table1's scale_8b run; if table1 has not run it: " \
           "`repro slurm submit slurm/scale_8b.sh`" in capsys.readouterr().out


def test_submit_without_sbatch_names_the_fix(sbatch, capsys, monkeypatch):
    """Off the cluster (no sbatch on PATH) a submit is a named error, not a FileNotFoundError traceback;
    its dry run still works."""
    no_slurm = sbatch.parent / "no_slurm"  # what sourcing cluster.env runs, and no Slurm client
    no_slurm.mkdir()
    for tool in ("bash", "env"):
        (no_slurm / tool).symlink_to(shutil.which(tool))
    monkeypatch.setenv("PATH", str(no_slurm))
    assert main(["slurm", "submit", str(ROOT / "slurm/scale_1b.sh")]) == 2
    err = capsys.readouterr().err
    assert "`sbatch` is not on PATH" in err and "--dry-run" in err and "Traceback" not in err
    assert main(["slurm", "submit", str(ROOT / "slurm/scale_1b.sh"), "--dry-run"]) == 0 and _calls(sbatch) == []


@pytest.mark.parametrize("script, variable", [("race_finetune.sh", "REPRO_BERT_CHECKPOINT"),
                                              ("zeroshot_eval.sh", "REPRO_EVAL_CHECKPOINT")])
def test_an_evaluation_job_without_its_checkpoint_is_not_queued(sbatch, capsys, monkeypatch, script, variable):
    monkeypatch.delenv(variable, raising=False)
    assert main(["slurm", "submit", str(ROOT / "slurm" / script)]) == 2
    assert f"{variable}=RUNS/<run dir> repro slurm submit slurm/{script}" in capsys.readouterr().err and _calls(sbatch) == []
    monkeypatch.setenv(variable, "/shared/runs/x-1")
    assert main(["slurm", "submit", str(ROOT / "slurm" / script)]) == 0 and len(_calls(sbatch)) == 1


def test_a_relative_cluster_env_reaches_the_job_as_an_absolute_path(sbatch, capsys, monkeypatch, tmp_path):
    """sbatch runs in the repository root, where the job reads REPRO_CLUSTER_ENV again: a name relative
    to the user's directory (used here for the partition) would not be found there."""
    work = tmp_path / "work"
    work.mkdir()
    (work / "mine.env").write_text("REPRO_RUNS_DIR=/shared/runs\nREPRO_DATA_DIR=/shared/data\nREPRO_PARTITION=gpu\n")
    monkeypatch.chdir(work)
    monkeypatch.setenv("REPRO_CLUSTER_ENV", "mine.env")
    assert main(["slurm", "submit", SCRIPT]) == 0
    assert " -p gpu " in _calls(sbatch)[0]
    assert (tmp_path / "sbatch.log.env").read_text() == f"cluster env: {work}/mine.env\n"


def test_a_dry_run_prints_a_command_that_pastes_as_one_word_per_argument(sbatch, capsys, monkeypatch):
    """An account with a space: `-A my proj` printed would submit with account `my` and a script
    `proj`; the real submission passes a list and was right, the printout now quotes like it."""
    import shlex

    monkeypatch.setenv("REPRO_ACCOUNT", "my proj")
    assert main(["slurm", "submit", SCRIPT, "--dry-run", "--", "--set", "name=a b"]) == 0
    words = shlex.split(capsys.readouterr().out.strip())
    assert words[words.index("-A") + 1] == "my proj" and words[-2:] == ["--set", "name=a b"], words


def test_scontrol_fields_keep_values_with_spaces_and_equals_signs():
    """`repro slurm status` read `scontrol show job -o` by splitting at spaces: a job named `scale 1b`
    (sbatch -J, SBATCH_JOB_NAME) showed as `scale`, and a WorkDir with a space was cut short."""
    from repro.launch.commands import scontrol_fields

    line = ("JobId=12 JobName=scale 1b UserId=me(1000) JobState=COMPLETED Restarts=0 ExitCode=0:0 "
            "RunTime=00:00:05 TRES=cpu=1,mem=1G,node=1 Socks/Node=* NtasksPerN:B:S:C=0:0:*:* "
            "Command=/home/me/my jobs/x.sh --smoke WorkDir=/home/me/repro Power=")
    fields = scontrol_fields(line)
    assert (fields["JobName"], fields["Command"], fields["TRES"]) == (
        "scale 1b", "/home/me/my jobs/x.sh --smoke", "cpu=1,mem=1G,node=1")
    assert (fields["Socks/Node"], fields["NtasksPerN:B:S:C"], fields["Power"]) == ("*", "0:0:*:*", "")
    assert list(fields)[:3] == ["JobId", "JobName", "UserId"] and len(fields) == 13


def test_the_fix_for_an_unset_checkpoint_is_a_command_that_works(sbatch, capsys, monkeypatch, tmp_path):
    """table3's hint named `repro slurm submit zeroshot_eval.sh`, which then failed: 'does not exist'.
    The hint names slurm/zeroshot_eval.sh, and a bare name of a script in slurm/ is found there."""
    monkeypatch.delenv("REPRO_EVAL_CHECKPOINT", raising=False)
    assert main(["slurm", "sweep", "table3", "--dry-run"]) == 2
    fix = capsys.readouterr().err.split("Fix: `", 1)[1].split("`", 1)[0]
    assert fix == "REPRO_EVAL_CHECKPOINT=RUNS/<run dir> repro slurm submit slurm/zeroshot_eval.sh"
    monkeypatch.setenv("REPRO_EVAL_CHECKPOINT", str(tmp_path))
    monkeypatch.chdir(tmp_path)  # not the checkout: the bare name is slurm/'s
    for name in ("slurm/zeroshot_eval.sh", "zeroshot_eval.sh"):
        arg = str(ROOT / name) if name.startswith("slurm/") else name
        assert main(["slurm", "submit", "--dry-run", arg]) == 0
        assert capsys.readouterr().out.strip().endswith(f"{ROOT}/slurm/zeroshot_eval.sh")
    assert main(["slurm", "submit", "--dry-run", "nonesuch.sh"]) == 2
    assert "does not exist: see `ls slurm/`" in capsys.readouterr().err
