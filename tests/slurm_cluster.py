"""A real single-node Slurm cluster in a temporary directory, for tests (munge, slurmctld, slurmd).

    with SlurmCluster(tmp_path) as cluster:
        job = cluster.sbatch(["-n2", "--wrap", "srun hostname"])
        cluster.wait_job(job)                   # -> {"JobState": "COMPLETED", "ExitCode": "0:0", ...}

Everything (key, sockets, state, spool, logs, free ports) lives under the directory, so several
clusters can run on one machine. Every daemon is started with REPRO_SLURM_FIXTURE=<dir> in its
environment; jobs get SLURM_CONF=<dir>/slurm.conf from `env()`. `leftovers()` finds any process that
carries either, which is how `stop()` proves nothing was left behind. Needs root and the Debian
packages slurmctld slurmd slurm-client munge (`make slurm-deps`).
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest

from conftest import require
from ports import listen_ports

ROOT = Path(__file__).resolve().parents[1]
BINARIES = ("munged", "mungekey", "slurmctld", "slurmd", "sbatch", "srun", "scontrol", "squeue", "scancel")


def require_slurm() -> None:
    """Skip locally / fail in CI when the Slurm and munge binaries or root are missing."""
    missing = [b for b in BINARIES if not shutil.which(b) and not Path(f"/usr/sbin/{b}").exists()]
    require(not missing, f"Slurm binaries {missing} (install: make slurm-deps)")
    require(os.geteuid() == 0, "root (the test cluster runs slurmd as SlurmUser=root)")


def _node_name() -> str:
    """`hostname -s` when it resolves (it becomes MASTER_ADDR), else localhost."""
    name = socket.gethostname().split(".")[0]
    try:
        socket.gethostbyname(name)
        return name
    except OSError:
        return "localhost"


def _sbin(name: str) -> str:
    return shutil.which(name) or f"/usr/sbin/{name}"


class SlurmCluster:
    """Start with `start()` (or `with`), stop with `stop()`; `env()` is the environment for clients."""

    controller_addr = "127.0.0.1"

    def __init__(self, root: Path) -> None:
        self.root, self.node = Path(root), _node_name()
        self.nodes = [self.node]
        self.conf = self.root / "slurm.conf"
        self.munge_dir = Path(tempfile.mkdtemp(prefix="repro-munge-"))  # munged wants a path all may enter
        self.munge_dir.chmod(0o755)
        self.munge_socket = self.munge_dir / "munge.socket"
        self.pid_files = {d: self.root / "run" / f"{d}.pid" for d in ("munged", "slurmctld", "slurmd")}

    def env(self, **extra: str) -> dict[str, str]:
        """The environment for sbatch/srun/scontrol (and so for the jobs: sbatch exports it)."""
        return {**os.environ, "SLURM_CONF": str(self.conf), **extra}

    def _daemon_env(self) -> dict[str, str]:
        return {**self.env(), "REPRO_SLURM_FIXTURE": str(self.root)}

    def _write_config(self) -> None:
        for sub in ("munge", "run", "log", "state", "spool"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        (self.root / "plugstack.conf").write_text("")
        mem = max(1024, psutil.virtual_memory().total // 2**20 - 1024)
        r = self.root
        self.conf.write_text("\n".join([
            "ClusterName=repro-test", f"SlurmctldHost={_node_name()}({self.controller_addr})", "SlurmUser=root",
            *(f"{daemon}Port={port}" for daemon, port in zip(("Slurmctld", "Slurmd"), listen_ports(2))),
            # job ids (launch.sh's rendezvous port is 15000 + job id) differ between clusters running at once
            f"FirstJobId={random.SystemRandom().randint(1, 14000)}",
            "AuthType=auth/munge", "CredType=cred/munge",
            f"AuthInfo=socket={self.munge_socket},cred_expire=10",
            f"StateSaveLocation={r}/state", *self._slurmd_paths(),
            f"SlurmctldPidFile={self.pid_files['slurmctld']}", f"SlurmctldLogFile={r}/log/slurmctld.log",
            f"PlugStackConfig={r}/plugstack.conf", "MailProg=/bin/true",
            "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", "MpiDefault=none",
            "SelectType=select/cons_tres", "SelectTypeParameters=CR_CPU",
            "AccountingStorageType=accounting_storage/none", "JobAcctGatherType=jobacct_gather/none",
            "SlurmdParameters=config_overrides", "ReturnToService=2", "MinJobAge=5",
            "SchedulerParameters=batch_sched_delay=0,bf_interval=1,sched_interval=1",  # a requeued job
            # waits out its BeginTime, then the main loop (default every 60 s) starts it
            *self._node_lines(mem),
            f"PartitionName=debug Nodes={','.join(self.nodes)} Default=YES MaxTime=INFINITE State=UP", ""]))

    def _slurmd_paths(self) -> list[str]:
        r = self.root
        return [f"SlurmdSpoolDir={r}/spool/%n", f"SlurmdPidFile={self.pid_files['slurmd']}",
                f"SlurmdLogFile={r}/log/slurmd.log"]

    def _node_lines(self, mem: int) -> list[str]:
        return [f"NodeName={self.node} NodeAddr=127.0.0.1 CPUs={os.cpu_count()} RealMemory={mem}"]

    def _start_slurmds(self, env: dict[str, str]) -> None:
        self._run([_sbin("slurmd"), "-f", str(self.conf), "-N", self.node], env)

    def _slurmd_pid_files(self) -> list[Path]:
        return [self.pid_files["slurmd"]]

    def start(self, timeout: float = 30) -> "SlurmCluster":
        """munged, slurmctld, slurmd; returns once the node is idle."""
        self._write_config()
        key, env, r = self.root / "munge" / "munge.key", self._daemon_env(), self.root
        subprocess.run([_sbin("mungekey"), "--create", f"--keyfile={key}"], check=True, capture_output=True)
        os.chmod(key, 0o600)
        self._run([_sbin("munged"), f"--key-file={key}", f"--socket={self.munge_socket}",
                   f"--pid-file={self.pid_files['munged']}", f"--log-file={r}/log/munged.log",
                   f"--seed-file={r}/munge/munge.seed"], env)
        self._run([_sbin("slurmctld"), "-f", str(self.conf)], env)
        self._start_slurmds(env)
        self._wait(lambda: self.node_state() == "idle", timeout, f"the node(s) {self.nodes} to become idle")
        return self

    def _run(self, cmd: list[str], env: dict[str, str]) -> None:
        out = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if out.returncode:
            self.stop()
            raise RuntimeError(f"{cmd[0]} failed to start: {out.stderr or out.stdout}; logs in {self.root}/log")

    def node_state(self) -> str:
        """The nodes' state when they all share one (e.g. "idle"), else their states, sorted."""
        out = subprocess.run(["sinfo", "-h", "-N", "-n", ",".join(self.nodes), "-o", "%T"], env=self.env(),
                             capture_output=True, text=True)
        states = out.stdout.split()
        return states[0] if len(states) == len(self.nodes) and len(set(states)) == 1 else " ".join(sorted(states))

    @staticmethod
    def _wait(cond, timeout: float, what: str, poll: float = 0.2) -> None:
        deadline = time.monotonic() + timeout
        while not cond():
            if time.monotonic() > deadline:
                raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")
            time.sleep(poll)

    def client(self, *cmd: str, check: bool = True) -> str:
        """Run a Slurm client command against this cluster; its stdout."""
        out = subprocess.run(list(cmd), env=self.env(), capture_output=True, text=True)
        if check and out.returncode:
            raise RuntimeError(f"{' '.join(cmd)} -> {out.returncode}: {out.stderr}")
        return out.stdout

    def sbatch(self, args: list[str], env: dict[str, str] | None = None, cwd: Path | None = None) -> str:
        """Submit; returns the job id."""
        out = subprocess.run(["sbatch", "--parsable", *args], env=env or self.env(), cwd=cwd,
                             capture_output=True, text=True)
        if out.returncode:
            raise RuntimeError(f"sbatch {' '.join(args)} failed: {out.stderr}")
        return out.stdout.strip().split(";")[0]

    def job(self, job_id: str) -> dict[str, str]:
        """`scontrol show job -o ID` as a dict (empty once the job is purged)."""
        text = self.client("scontrol", "show", "job", "-o", job_id, check=False)
        return dict(f.split("=", 1) for f in text.split() if "=" in f)

    def wait_job(self, job_id: str, timeout: float = 120, states=("COMPLETED", "FAILED", "CANCELLED",
                 "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE")) -> dict[str, str]:
        """Poll every 0.2 s until the job reaches one of `states`; its last record."""
        last: dict[str, str] = {}

        def done() -> bool:
            nonlocal last
            last = self.job(job_id) or last
            return last.get("JobState") in states
        self._wait(done, timeout, f"job {job_id} to reach {states} (last: {last.get('JobState')})")
        return last

    def leftovers(self) -> list[psutil.Process]:
        """Processes of this cluster: daemons, slurmstepd and job tasks (by their environment)."""
        marks = (("REPRO_SLURM_FIXTURE", str(self.root)), ("SLURM_CONF", str(self.conf)))
        found = []
        for proc in psutil.process_iter():
            try:
                env = proc.environ()
            except (psutil.Error, OSError):
                continue
            if proc.pid != os.getpid() and any(env.get(k) == v for k, v in marks):
                found.append(proc)
        return found

    def stop(self, timeout: float = 30) -> None:
        """Cancel every job and wait for the queue to drain, then TERM the daemons by pid file."""
        if self.pid_files["slurmctld"].exists():
            self.client("scancel", "--full", "--partition=debug", check=False)
            try:
                self._wait(lambda: not self.client("squeue", "-h", check=False).strip(), timeout, "an empty queue")
            except TimeoutError:
                pass  # the daemons go anyway; leftovers() reports what survived
        for pid_file in [*self._slurmd_pid_files(), self.pid_files["slurmctld"], self.pid_files["munged"]]:
            self._terminate(pid_file, timeout)
        shutil.rmtree(self.munge_dir, ignore_errors=True)

    @staticmethod
    def _terminate(pid_file: Path, timeout: float) -> None:
        try:
            pid = int(pid_file.read_text().split()[0])
            os.kill(pid, signal.SIGTERM)
        except (OSError, ValueError, IndexError):
            return
        try:
            psutil.Process(pid).wait(timeout)
        except psutil.NoSuchProcess:
            pass
        except psutil.TimeoutExpired:
            os.kill(pid, signal.SIGKILL)

    def __enter__(self) -> "SlurmCluster":
        return self.start()

    def __exit__(self, *_exc) -> None:
        self.stop()


def activation() -> dict[str, str]:
    """REPRO_ENV_ACTIVATE for the venv running the tests when it is not launch.sh's default, REPO/.venv
    (`make test VENV=...`, e.g. a venv with your cluster's torch); empty otherwise, so the default is tested."""
    if Path(sys.prefix).resolve() == (ROOT / ".venv").resolve():
        return {}
    return {"REPRO_ENV_ACTIVATE": str(Path(sys.prefix) / "bin" / "activate")}


def job_site(cluster: SlurmCluster, data_dir: Path, root: Path, jobs_uri: str = "", uri: str = "") -> dict:
    """Cluster settings the way a user gives them (variables): {"env", "runs", "uri", "out"}. The jobs
    track to `jobs_uri` and the tests read `uri` (a server's names for each); by default both are a
    fresh sqlite store, made once here."""
    import mlflow

    if not jobs_uri:
        jobs_uri = uri = f"sqlite:///{root / 'mlflow.db'}"
        mlflow.MlflowClient(uri).search_experiments()  # creates the store before any rank starts
    env = cluster.env(REPRO_RUNS_DIR=str(root / "runs"), REPRO_DATA_DIR=str(data_dir),
                      MLFLOW_TRACKING_URI=jobs_uri, REPRO_CLUSTER_ENV=str(root / "cluster.env"), **activation())
    (root / "cluster.env").write_text("# the test passes everything as variables\n")
    return {"env": env, "runs": root / "runs", "uri": uri, "out": root}


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory):
    """One cluster for the session; teardown fails if any of its processes survive."""
    require_slurm()
    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm")).start()
    yield cluster
    cluster.stop()
    left = cluster.leftovers()
    assert not left, f"processes left after stopping the Slurm cluster: {[(p.pid, p.name()) for p in left]}"
