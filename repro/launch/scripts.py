"""The job scripts of slurm/: which paper table each belongs to, and what its #SBATCH lines ask for."""

from __future__ import annotations

import os
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

from repro.tracking.store import project_root

TABLES: dict[str, tuple[str, ...]] = {
    "table1-tp": ("scale_1b", "scale_2b", "scale_4b", "scale_8b"),
    "table1-tpdp": ("scale_1b_dp64", "scale_2b_dp128", "scale_4b_dp256", "scale_8b_dp512"),
    "table2": ("gpt2_355m", "gpt2_2.5b", "gpt2_8.3b"),
    "table3": ("zeroshot_eval",),
    "table4": ("bert_336m", "bert_1.3b", "bert_3.9b"),
    "table5": ("race_finetune",),
    "table7": ("heads_8b_16", "heads_8b_24"),  # Appendix D: 16 / 24 heads (32: table1's scale_8b)
    "table8": ("strong_1b_tp2", "strong_1b_tp4", "strong_1b_tp8"),  # Appendix D: strong scaling (1 GPU: scale_1b)
}
TABLES["table1"] = TABLES["table1-tp"] + TABLES["table1-tpdp"]
FROM_TABLE1 = {"table7": ("scale_8b", "its 32-head row"), "table8": ("scale_1b", "its 1-GPU baseline")}
"""Rows of Appendix D that a table1 sweep already runs (sweeping them again would repeat the job)."""
NEEDS = {"zeroshot_eval": "REPRO_EVAL_CHECKPOINT", "race_finetune": "REPRO_BERT_CHECKPOINT"}
"""Job scripts that stop at once without this variable (the checkpoint each evaluates)."""

_SBATCH = re.compile(r"^#SBATCH\s+--([\w-]+)(?:[= ](\S+))?", re.M)
_CONFIG = re.compile(r"experiments/[\w./-]+\.yaml")


@dataclass(frozen=True)
class JobScript:
    """One slurm/*.sh: its #SBATCH options and the experiment config it names."""

    path: Path
    options: dict[str, str]
    config: str | None

    @property
    def ntasks(self) -> int:
        """Tasks (= GPUs) the script asks for: --ntasks (one node), else nodes x ntasks-per-node."""
        if "ntasks" in self.options:
            return int(self.options["ntasks"])
        return int(self.options.get("nodes", 1)) * int(self.options.get("ntasks-per-node", 1))


def slurm_dir() -> Path:
    return project_root() / "slurm"


def read_script(path: Path) -> JobScript:
    """Parse a job script's #SBATCH lines and the first experiments/*.yaml it names."""
    text = path.read_text()
    options = {name: value or "" for name, value in _SBATCH.findall(text)}
    match = _CONFIG.search(text)
    return JobScript(path, options, match.group(0) if match else None)


NOT_EXPERIMENTS = ("launch.sh", "task.sh", "prepare_data.sh", "selftest.sh", "comm_bench.sh")
"""Helpers, the corpus every experiment reads, and the checks of a cluster before them."""


def job_scripts() -> list[JobScript]:
    """Every experiment's job script (of a paper table, naming its experiments/*.yaml)."""
    return [read_script(p) for p in sorted(slurm_dir().glob("*.sh")) if p.name not in NOT_EXPERIMENTS]


def table_scripts(table: str) -> list[Path]:
    """The scripts that reproduce one paper table; a clear error lists the tables."""
    if table not in TABLES:
        raise KeyError(f"unknown table {table!r}: choose one of {', '.join(sorted(TABLES))}")
    return [slurm_dir() / f"{name}.sh" for name in TABLES[table]]


class ClusterEnvError(ValueError):
    """A cluster.env that launch.sh would refuse; the message names the file and the fix."""


PER_JOB = {"REPRO_RUN_NAME": "run dir", "REPRO_MASTER_PORT": "rendezvous port", "REPRO_MASTER_ADDR": "rank-0 address"}


def cluster_settings(env_file: Path | None = None) -> dict[str, str]:
    """The environment as launch.sh sees it: os.environ plus slurm/cluster.env, sourced by bash with
    `set -e` (not -u: `LD_LIBRARY_PATH=/x:$LD_LIBRARY_PATH` with it unset is a site's usual line);
    for REPRO_* variables the environment wins (one given at submit time keeps its value), other lines apply as written (`PATH=/site/bin:$PATH`, NCCL_*). A file named
    by REPRO_CLUSTER_ENV (or env_file) must exist; the default slurm/cluster.env may be absent
    (everything then comes from the environment). A per-job variable (PER_JOB) set by the file is a
    ClusterEnvError, as in launch.sh: every job would share it."""
    named = env_file or os.environ.get("REPRO_CLUSTER_ENV")
    path = Path(named) if named else slurm_dir() / "cluster.env"
    if not path.exists():
        if named:
            raise ClusterEnvError(f"REPRO_CLUSTER_ENV={path} does not exist. Fix: "
                                  f"`cp slurm/cluster.env.example {path}` and edit it, or unset REPRO_CLUSTER_ENV")
        return dict(os.environ)
    out = subprocess.run(["bash", "-c", 'set -e; set -a; source "$1"; set +a; env -0', "_", str(path)],
                         capture_output=True, text=True)
    if out.returncode:
        raise ClusterEnvError(f"{path} failed when sourced by bash (exit {out.returncode}): "
                              f"{out.stderr.strip() or 'no message'}. Fix: correct that line; "
                              "slurm/cluster.env.example shows the format")
    sourced = dict(item.split("=", 1) for item in out.stdout.split("\0") if "=" in item)
    for name, what in PER_JOB.items():
        if name in sourced and name not in os.environ:  # (even empty: launch.sh refuses it too)
            raise ClusterEnvError(f"{path} sets {name}, and every job (and every requeued piece) reads that "
                                  f"file: all of them would share one {what}. Fix: remove the line and give it "
                                  f"to one job at submit time, e.g. `{name}={sourced[name]} repro slurm submit "
                                  "slurm/SCRIPT.sh`")
    named_file = {"REPRO_CLUSTER_ENV": str(path.resolve())} if named else {}  # sbatch runs in the repo root
    return {**sourced, **{k: v for k, v in os.environ.items() if k.startswith("REPRO_")}, **named_file}


REQUIRED = {"REPRO_RUNS_DIR": "the shared directory for run directories",
            "REPRO_DATA_DIR": "the shared data directory filled by `repro data fetch`"}


def check_required(settings: dict[str, str]) -> None:
    """A ClusterEnvError naming what launch.sh needs (`need ...`) and the settings lack."""
    missing = [f"{k} ({what})" for k, what in REQUIRED.items() if not settings.get(k)]
    if missing:
        raise ClusterEnvError(f"{'; '.join(missing)} not set: every job would fail in launch.sh. Fix: "
                              "`cp slurm/cluster.env.example slurm/cluster.env` and set them there "
                              "(or export them before submitting)")
