"""What `repro slurm check | submit | sweep` check before anything is queued or launched: the training
config at the job's task count (with its --set overrides), its data, tracking store and socket interfaces,
the planned memory, and that a submitted file is a job script."""

from __future__ import annotations

import os
import shlex
from pathlib import Path

from repro.launch.scripts import JobScript, read_script, slurm_dir


def user_error(msg: str):
    from repro.cli import UserError

    return UserError(msg)


def size_family(cfg) -> str:
    """The family the model's sizes belong to (a BERT size has token types)."""
    from repro.models.sizes import get_size

    if cfg.model_size:
        return get_size(cfg.model_size).family
    return "bert" if cfg.model.num_tokentypes else "gpt"


def init_tracking(cfg) -> str:
    """Create a fresh sqlite MLflow store once, here, before the ranks start (two at once fail); ask a
    tracking server once, warning (not failing: training does not need it) when it does not answer."""
    from repro.tracking.store import default_tracking_uri, probe_tracking_server, tracking_client

    uri = default_tracking_uri()
    if cfg.tracking.enabled:
        check_tracking_uri(uri)
    if cfg.tracking.enabled and uri.startswith("sqlite:///") and not Path(uri[len("sqlite:///"):]).exists():
        tracking_client(uri).search_experiments()  # (under the store's lock: another job may create it too)
    if cfg.tracking.enabled and (problem := probe_tracking_server(uri)):
        print(f"WARNING: {problem}", flush=True)
    return uri


def check_tracking_uri(uri: str) -> None:
    """A UserError for a tracking URI the job could not log into: an unknown scheme, a sqlite file that is
    not an MLflow store, or a new one whose folder cannot be made (repro.tracking.sync.check_store)."""
    from repro.tracking.run_dir import TrackingError
    from repro.tracking.sync import check_store

    try:
        check_store(uri)
    except TrackingError as err:
        raise user_error(f"MLFLOW_TRACKING_URI: {err}") from None


def validated(config: str, overrides: list[str], ntasks: int | None):
    """(cfg, derived) of a training config with --set overrides at `ntasks` ranks (None: its own TP
    degree, one DP rank), or a UserError."""
    from repro.train.config import RunConfigError, derive, load_config
    from repro.parallel.groups import LayoutError

    try:
        cfg = load_config(config, overrides)
        ntasks = cfg.parallel.tp if ntasks is None else ntasks  # (0 is refused by derive, not replaced)
        derived = derive(cfg, ntasks)
    except (RunConfigError, LayoutError, ValueError) as err:
        raise user_error(f"{config} at {ntasks} tasks: {err}") from None
    if size_family(cfg) != cfg.family:
        raise user_error(f"{config} has {size_family(cfg).upper()} sizes ({cfg.model_size or 'model:'}) but "
                          f"family={cfg.family}: add `family: {size_family(cfg)}` to the config "
                          f"(or pass --set family={size_family(cfg)})")
    return cfg, derived


def check_data(cfg, config: str) -> None:
    """The splits the trainer opens are there (PREFIX.idx and .bin, as IndexedDataset asks): without
    them `repro train` stops only once the allocation has started and every rank has loaded."""
    from repro.data.prepare_checks import base_prefix

    if not cfg.data.train_prefix:
        raise user_error(f"{config}: data.train_prefix is empty: the job has no corpus to train on. Fix: "
                          "prepare one (`repro data prepare`, or slurm/prepare_data.sh) and pass "
                          "--set data.train_prefix=PREFIX_train")
    for key in ("train_prefix", "valid_prefix"):  # an empty valid_prefix: training without evaluation
        prefix = getattr(cfg.data, key)
        missing = [f"{prefix}{ext}" for ext in (".idx", ".bin") if prefix and not Path(f"{prefix}{ext}").is_file()]
        if missing:
            base = base_prefix(prefix)
            raise user_error(
                f"{config}: data.{key} {prefix} has no {' and no '.join(missing)} (REPRO_DATA_DIR="
                f"{os.environ.get('REPRO_DATA_DIR', '(unset)')}): the job would stop there after its allocation "
                f"started. Fix: prepare the corpus with `repro data prepare --input CORPUS --output-prefix {base}` "
                f"(it writes {base}_train/_valid/_test; slurm/prepare_data.sh on the cluster), or set REPRO_DATA_DIR "
                "(the paper configs read their data from it) to where it was prepared")


def check_interfaces(cfg) -> None:
    """The run's backend (gloo on CPU, else NCCL) must find the interface its *_SOCKET_IFNAME names."""
    from repro.parallel.groups import backend_for

    require_interfaces(backend_for(cfg.train.device))


def require_interfaces(backend: str) -> str:
    """This host's name, or a UserError when `backend`'s *_SOCKET_IFNAME names no interface of it."""
    import socket

    from repro.launch.interfaces import interface_problem, local_interfaces

    host = socket.gethostname()
    if problem := interface_problem(dict(os.environ), local_interfaces(), backend, host):
        raise user_error(problem)
    return host


def memory_line(cfg, derived) -> str:
    """`repro plan`'s peak per rank against this node's GPU memory, warning when it would not fit."""
    import torch

    from repro.perf.plan import HEADROOM_GIB, memory_plan

    if cfg.train.device == "cpu":
        return f"planned peak memory per rank: {memory_plan(cfg, derived, 'cpu').peak / 2**30:.2f} GiB (CPU)"
    peak = memory_plan(cfg, derived, "cuda").peak / 2**30  # a GPU run's plan even where none is visible
    if not torch.cuda.is_available():
        return (f"planned peak memory per GPU: {peak:.2f} GiB (no GPU visible here, a login node say: "
                "`repro plan CONFIG --cluster dgx2h|h200` checks the fit)")
    total = torch.cuda.get_device_properties(0).total_memory / 2**30
    line = f"planned peak memory per GPU: {peak:.2f} GiB of {total:.1f} GiB ({torch.cuda.get_device_name(0)})"
    if peak > total - HEADROOM_GIB:
        line += (f"\nwarning: that leaves less than {HEADROOM_GIB:g} GiB for the CUDA context, NCCL and "
                 "fragmentation: the job will likely run out of memory. `repro plan CONFIG` lists what to change")
    return line


def check_job_script(script: Path) -> None:
    """A UserError unless `script` is a file sbatch takes: a batch script, its first line `#!`."""
    if not script.exists():
        raise user_error(f"{script} does not exist: see `ls slurm/`")
    if not script.is_file():
        raise user_error(f"{script} is a directory, not a job script. Fix: give a script, e.g. slurm/scale_8b.sh "
                          "(`ls slurm/` lists them)")
    with open(script, "rb") as handle:
        if handle.read(2) != b"#!":
            raise user_error(f"{script} is not a job script (its first line is not `#!`, so sbatch would refuse "
                              "it). Fix: give one of slurm/*.sh, e.g. slurm/scale_8b.sh")


def script_overrides(extra: list[str]) -> list[str]:
    """The KEY=VALUE of each `--set KEY=VALUE` (or `--set=KEY=VALUE`) among a job script's arguments."""
    sets, words = [], iter(extra)
    for word in words:
        if word == "--set":
            sets.append(next(words, ""))
        elif word.startswith("--set="):
            sets.append(word[len("--set="):])
    return sets


_TASK_OPTIONS = {"-n": "ntasks", "--ntasks": "ntasks", "-N": "nodes", "--nodes": "nodes",
                 "--ntasks-per-node": "ntasks-per-node"}


def job_with(job: JobScript, options: list[str]) -> JobScript:
    """The job script with the task counts of sbatch `options` (-n 2, -N1, --ntasks=4) over its own."""
    given, words = dict(job.options), iter(options)
    for word in words:
        name, eq, value = word.partition("=")
        if name in _TASK_OPTIONS:
            given[_TASK_OPTIONS[name]] = value if eq else next(words, "")
        elif word[:2] in ("-n", "-N") and word[2:].isdigit():
            given[_TASK_OPTIONS[word[:2]]] = word[2:]
    return JobScript(job.path, given, job.config)


def check_script_args(script: Path, extra: list[str], options: list[str] = ()) -> None:
    """A UserError for `--set` overrides that launch.sh's `repro slurm check` would refuse once the job
    started: the training config of `script` (its `launch_train` line) loaded with them at the job's task
    count; under --smoke, the tiny config launch.sh trains instead, at the overrides' own TP degree (its
    smoke TP follows the allocation, which sbatch options given elsewhere may change). Scripts that
    train nothing are not checked."""
    overrides = script_overrides(extra)
    if not overrides or "launch_train" not in script.read_text():
        return
    job = read_script(script)
    if job.config is None:
        return
    try:
        ntasks = job_with(job, list(options)).ntasks
    except ValueError:  # a node range (-N 2-4): the task count is Slurm's to choose
        return
    config = job.config
    if "--smoke" in extra:  # launch.sh's smoke_args: a tiny model of the config's family on CPU
        config = "experiments/bert/tiny_cpu.yaml" if "/bert/" in job.config else "experiments/tiny/gpt_tiny.yaml"
        ntasks, overrides = None, ["train.device=cpu", *overrides]
    from repro.cli import UserError

    try:
        validated(str(slurm_dir().parent / config), overrides, ntasks)
    except UserError as err:
        raise user_error(f"{script.name} -- {shlex.join(extra)}: the job would stop in launch.sh's config check: "
                          f"{err}. Nothing was submitted. Fix: correct the --set after `--` (`repro slurm check "
                          f"{config} --ntasks N --set KEY=VALUE` tries one)") from None
