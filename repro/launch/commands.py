"""`repro slurm check | submit | sweep | status`: the Python side of slurm/launch.sh.

    repro slurm sweep table1-tp              # submit scale_1b..scale_8b with the cluster settings
    repro slurm submit slurm/scale_8b.sh -- --set train.train_iters=100   # script arguments after --
    repro slurm submit zeroshot_eval.sh --after 1234 --sbatch=--time=2:00:00    # sbatch's own options
    repro slurm status 1234 1235             # squeue / scontrol (sacct where accounting exists)
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path

from repro.launch.checks import (check_data, check_interfaces, check_job_script, check_script_args, init_tracking,
                                 memory_line, require_interfaces, user_error, validated)
from repro.launch.scripts import (FROM_TABLE1, NEEDS, PER_JOB, TABLES, ClusterEnvError, check_required, cluster_settings,
                                  slurm_dir, table_scripts)


def _check(args) -> int:
    """Validate a training config at the allocation's task count before anything launches."""
    cfg, derived = validated(args.config, args.set, args.ntasks)
    if args.require_data:
        check_data(cfg, args.config)
    check_interfaces(cfg)
    uri = init_tracking(cfg)
    print(f"config ok: {cfg.name} tp={cfg.parallel.tp} dp={derived.dp} grad_accum={derived.grad_accum_steps} "
          f"on {args.ntasks} tasks; tracking {uri if cfg.tracking.enabled else 'off'}")
    print(memory_line(cfg, derived))
    return 0


def _check_network(args) -> int:
    """The socket-interface check of `check` alone, for the steps that train nothing (selftest,
    comm-bench, evaluation, RACE): the backend this node's ranks will use unless one is given."""
    from repro.parallel.groups import default_backend

    backend = args.backend or default_backend()
    print(f"socket interfaces ok for {backend} on {require_interfaces(backend)}")
    return 0


NEEDED_FAMILY = {"gpt": "zero-shot evaluation", "bert": "RACE fine-tuning"}


def _check_checkpoint(args) -> int:
    """The checkpoint an evaluation job reads is of the family its step needs (meta.json's, as `repro
    eval` and `repro finetune race` read it): they refuse another only once the allocation has started.
    A directory with no checkpoint yet passes (a job queued behind its training job's, a sweep's dry run);
    a file must be one save_bert wrote (read as `repro finetune race` reads it: memory-mapped, its config
    and tensor shapes checked)."""
    from repro.train.checkpoint import CheckpointError, read_meta, resolve

    path = Path(args.checkpoint)
    if path.is_file() and path.name != "latest" and args.family == "bert":
        return _check_bert_file(path)
    if path.is_file() and path.name != "latest":
        raise user_error(f"{path} is a file, not a checkpoint: {NEEDED_FAMILY[args.family]} reads a GPT training "
                          "run directory. Fix: give the run directory (or its checkpoints/iter_XXXXXXX folder)")
    try:
        family = read_meta(resolve(path)).get("family", "gpt")
    except CheckpointError as err:
        if any((c / name).exists() for c in (path, path / "checkpoints") for name in ("latest", "meta.json")):
            raise user_error(str(err)) from None  # a broken pointer or meta.json: the step would stop on it
        print(f"no checkpoint at {path} yet: the step looks again when it starts")
        return 0
    if family != args.family:
        fix = (f"BERT is evaluated by RACE: `REPRO_BERT_CHECKPOINT={path} sbatch slurm/race_finetune.sh`"
               if family == "bert" else "give a BERT training run directory (experiments/bert/*.yaml) or a "
               "save_bert file")
        raise user_error(f"{path} is a {family.upper()} checkpoint; {NEEDED_FAMILY[args.family]} needs a "
                          f"{args.family.upper()}. Fix: {fix}")
    print(f"checkpoint ok: {path} is a {family.upper()} checkpoint")
    return 0


def _check_bert_file(path: Path) -> int:
    """A UserError unless `path` is a readable save_bert file whose weights fit its own config."""
    from repro.models.bert_checkpoint import read_bert
    from repro.train.checkpoint import CheckpointError

    try:
        cfg, _ = read_bert(path)
    except CheckpointError as err:
        raise user_error(str(err)) from None
    print(f"checkpoint ok: {path} is a save_bert BERT ({cfg.num_layers} layers, hidden {cfg.hidden_size})")
    return 0


def sbatch_command(script: Path, extra: list[str], settings: dict[str, str], options: list[str] = ()) -> list[str]:
    """sbatch with the cluster's partition and account (REPRO_PARTITION, REPRO_ACCOUNT), then the
    caller's own sbatch `options` (which sbatch lets override those)."""
    cmd = ["sbatch", "--parsable"]
    if settings.get("REPRO_PARTITION"):
        cmd += ["-p", settings["REPRO_PARTITION"]]
    if settings.get("REPRO_ACCOUNT"):
        cmd += ["-A", settings["REPRO_ACCOUNT"]]
    return cmd + [*options, str(script), *extra]


def sbatch_options(after: list[str], sbatch: list[str]) -> list[str]:
    """The sbatch options of `--after JOB` (start once every such job COMPLETED: afterok) and `--sbatch
    OPTIONS` (each shell-split: `--sbatch='--qos=high -t 4:00:00'`), or a UserError naming the fix."""
    bad = [job for job in after if not re.fullmatch(r"\d+(_\d+)?", job)]
    if bad:
        raise user_error(f"--after {bad[0]}: give a Slurm job id such as 1234 (or 1234_5 for an array task), "
                          "as `repro slurm submit` printed it")
    options = [f"--dependency=afterok:{':'.join(after)}"] if after else []
    for given in sbatch:
        try:
            words = shlex.split(given)
        except ValueError as err:
            raise user_error(f"--sbatch {given!r}: {err}. Fix: quote each option once, e.g. "
                              "--sbatch=--time=4:00:00") from None
        if not words or not words[0].startswith("-"):
            raise user_error(f"--sbatch {given!r}: sbatch options start with '-'. Fix: --sbatch=--time=4:00:00 "
                              "(with '=': argparse would take a separate `--time` as its own option); the job "
                              "script's arguments go after `--`")
        options += words
    return options


def _settings() -> dict[str, str]:
    """The cluster settings, complete enough for launch.sh, or a UserError naming the fix."""
    try:
        settings = cluster_settings()
        check_required(settings)
    except ClusterEnvError as err:
        raise user_error(str(err)) from None
    return settings


def submit(script: Path, extra: list[str], dry_run: bool = False, options: list[str] = ()) -> str:
    """Submit one job script from the repository root with sbatch `options`; returns the job id ('' on a
    dry run)."""
    check_job_script(script)
    settings = _settings()
    needed = NEEDS.get(script.stem)
    if needed and not settings.get(needed):
        raise user_error(f"{script.name} evaluates the checkpoint {needed} names, and it is not set: the job would "
                          f"stop as soon as it starts. Fix: `{needed}=RUNS/<run dir> repro slurm submit slurm/{script.name}` "
                          "(one job per checkpoint)")
    cmd = sbatch_command(script, extra, settings, options)
    print(shlex.join(cmd))  # pasteable: an account or a checkout path with a space stays one word
    if dry_run:
        return ""
    if not shutil.which(cmd[0], path=settings.get("PATH", os.defpath)):  # where subprocess looks
        raise user_error(f"`{cmd[0]}` is not on PATH: submit from a node of the Slurm cluster (a login node), or "
                          "load its Slurm module first; `--dry-run` prints the command without it")
    # from the repository root, wherever the script lies: the job's SLURM_SUBMIT_DIR finds slurm/launch.sh
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=slurm_dir().parent, env=settings)
    if out.returncode:
        raise user_error(f"sbatch {script.name} failed: {out.stderr.strip()}")
    return out.stdout.strip().split(";")[0]


def _script_path(name: str) -> Path:
    """The job script a submit names: a path, or a bare name of one in slurm/ (`zeroshot_eval.sh`)."""
    path = Path(name)
    if not path.exists() and path.parent == Path(".") and (slurm_dir() / path).exists():
        return slurm_dir() / path
    return path.resolve()


def _submit(args) -> int:
    options = sbatch_options(args.after, args.sbatch)
    script = _script_path(args.script)
    check_job_script(script)
    check_script_args(script, args.args, options)
    job = submit(script, args.args, args.dry_run, options)
    if job:
        print(f"submitted job {job}")
    return 0


def _sweep(args) -> int:
    from repro.cli import UserError

    try:
        scripts = table_scripts(args.table)
    except KeyError as err:
        raise user_error(str(err.args[0])) from None
    shared = [name for name in PER_JOB if os.environ.get(name)]
    if shared and len(scripts) > 1:
        raise user_error(f"{', '.join(shared)} is set, and each of the {len(scripts)} jobs of {args.table} would "
                          f"take it (one {' and one '.join(PER_JOB[n] for n in shared)} for all). Fix: unset it for "
                          "the sweep, or submit the scripts one by one with `repro slurm submit`")
    options = sbatch_options(args.after, args.sbatch)
    for script in scripts:  # every job's overrides before the first is queued
        check_script_args(script, args.args, options)
    submitted: list[tuple[str, Path]] = []
    for number, script in enumerate(scripts):
        try:
            job = submit(script, args.args, args.dry_run, options)
        except (UserError, OSError, subprocess.SubprocessError) as err:
            if not submitted:
                raise
            raise user_error(_partial_sweep(err, submitted, scripts[number:], args.args, options)) from None
        if job:  # at once: a later failure must not hide a job that is already queued
            print(f"submitted job {job} ({script.name})", flush=True)
            submitted.append((job, script))
    if not args.dry_run:
        jobs = " ".join(job for job, _ in submitted)
        print(f"{args.table}: jobs {jobs}; follow with `repro slurm status {jobs}`")
    if args.table in FROM_TABLE1:
        script, row = FROM_TABLE1[args.table]
        print(f"{args.table}: {row} is table1's {script} run; if table1 has not run it: "
              f"`repro slurm submit slurm/{script}.sh`")
    return 0


def _partial_sweep(err: Exception, submitted: list[tuple[str, Path]], rest: list[Path], extra: list[str],
                   options: list[str] = ()) -> str:
    """The error of a sweep stopped part way: what is queued, and what is left to submit."""
    done = ", ".join(f"job {job} ({script.name})" for job, script in submitted)
    head = f" --sbatch={shlex.quote(shlex.join(options))}" if options else ""  # split again when pasted
    tail = f" -- {shlex.join(extra)}" if extra else ""
    todo = "; ".join(f"repro slurm submit {shlex.quote(str(script))}{head}{tail}" for script in rest)
    return (f"{err}\nAlready submitted (queued or running; do not submit them again): {done}.\n"
            f"Not submitted: {', '.join(s.name for s in rest)}. Fix: remove the cause above, then submit "
            f"only those: {todo}")


class _ScriptArgsParser(argparse.ArgumentParser):
    """Everything after the first `--` goes to `args` (the job script's arguments), wherever this
    command's own options stand: `submit SCRIPT --dry-run -- --smoke` as `submit --dry-run SCRIPT
    -- --smoke`. (argparse alone fills `args` at SCRIPT and then rejects what follows `--`.)"""

    def parse_known_args(self, args=None, namespace=None):
        args = list(args) if args is not None else None
        if not args or "--" not in args or not any(a.dest == "args" for a in self._actions):
            return super().parse_known_args(args, namespace)
        cut = args.index("--")
        namespace, extras = super().parse_known_args(args[:cut], namespace)
        namespace.args = [*namespace.args, *args[cut + 1:]]
        return namespace, extras


def _has_accounting() -> bool:
    return bool(shutil.which("sacct")) and subprocess.run(["sacct", "-n", "-X", "-S", "now"],
                                                          capture_output=True).returncode == 0


def _slurm(cmd: list[str]) -> subprocess.CompletedProcess:
    """Run a Slurm client command, or a UserError when it is not on PATH."""
    if not shutil.which(cmd[0]):
        raise user_error(f"`{cmd[0]}` is not on PATH: run `repro slurm status` on a node of the Slurm cluster "
                          "(a login node), or load its Slurm module first")
    return subprocess.run(cmd, capture_output=True, text=True)


_FIELD = re.compile(r"([A-Za-z][\w/:]*)=(.*?)(?= [A-Za-z][\w/:]*=|$)")


def scontrol_fields(line: str) -> dict[str, str]:
    """`scontrol show ... -o`'s one line of `Key=value` fields as a dict; a value may hold spaces (a
    JobName, a WorkDir) and `=` (TRES=cpu=1,mem=1G), so a field ends where the next ` Key=` begins."""
    return dict(_FIELD.findall(line))


def job_record(job_id: str) -> dict[str, str]:
    """`scontrol show job -o ID` as a dict: empty when the controller no longer knows the job, a
    UserError with Slurm's own message when it cannot answer (no controller, a malformed id)."""
    out = _slurm(["scontrol", "show", "job", "-o", job_id])
    if out.returncode == 0:
        return scontrol_fields(out.stdout.strip())
    if "Invalid job id specified" in out.stderr:  # finished and purged (MinJobAge)
        return {}
    raise user_error(f"scontrol could not report job {job_id}: {out.stderr.strip() or out.stdout.strip()}")


def sacct_status_command(jobs: list[str]) -> list[str]:
    """sacct's view of jobs: one line per piece of a requeued job (-D: its restarts), allocations
    only (-X). sacct has no restart count field; `scontrol show job` does (Restarts=)."""
    fmt = "JobID,JobName%20,State,ExitCode,Start,Elapsed,NNodes"
    return ["sacct", "-X", "-D", "-j", ",".join(jobs), f"--format={fmt}"]


def _status(args) -> int:
    if not args.jobs:
        out = _slurm(["squeue", "--me", "-o", "%.10i %.20j %.10T %.12M %.6D %R"])
        if out.returncode:
            raise user_error(f"squeue failed: {out.stderr.strip()}")
        print(out.stdout, end="")
        return 0
    if _has_accounting():
        return subprocess.run(sacct_status_command(args.jobs)).returncode
    records = {job: job_record(job) for job in args.jobs}  # all asked before printing: an error prints no table
    print(f"{'job':>10} {'name':>20} {'state':>12} {'exit':>6} {'restarts':>8} {'runtime':>10}")
    for job, r in records.items():
        print(f"{job:>10} {r.get('JobName', '?'):>20} {r.get('JobState', 'unknown'):>12} "
              f"{r.get('ExitCode', '?'):>6} {r.get('Restarts', '?'):>8} {r.get('RunTime', '?'):>10}")
    return 0


def _add_sbatch_arguments(parser, jobs: str) -> None:
    parser.add_argument("--after", action="append", default=[], metavar="JOB",
                        help=f"start {jobs} only once job JOB has COMPLETED (sbatch --dependency=afterok:JOB); "
                             "repeat for several: e.g. an evaluation after its training job")
    parser.add_argument("--sbatch", action="append", default=[], metavar="OPTIONS",
                        help=f"sbatch options for {jobs}, with '=': --sbatch=--time=4:00:00 "
                             "--sbatch='--qos=high --mail-type=END' (they override REPRO_PARTITION/ACCOUNT)")


def register(sub) -> None:
    p = sub.add_parser("slurm", help="Slurm: check a config before launch, submit, sweep a paper table, status")
    ssub = p.add_subparsers(dest="slurm_command", required=True, metavar="SUBCOMMAND",
                            parser_class=_ScriptArgsParser)
    c = ssub.add_parser("check", help="validate a training config at N tasks; create a fresh MLflow store")
    c.add_argument("config")
    c.add_argument("--ntasks", type=int, required=True)
    c.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    c.add_argument("--require-data", action="store_true",
                   help="also refuse a data.train_prefix/valid_prefix that is not prepared (launch.sh passes it; "
                        "without it a config checks before its corpus exists)")
    c.set_defaults(func=_check)
    s = ssub.add_parser("submit", help="sbatch one slurm/*.sh with REPRO_PARTITION / REPRO_ACCOUNT")
    s.add_argument("script", help="a job script: slurm/scale_8b.sh, or a name in slurm/ such as scale_8b.sh")
    s.add_argument("args", nargs="*", help="passed to the script, after `--` (argparse takes options "
                   "before it as its own): e.g. `-- --smoke --set train.train_iters=100`")
    s.add_argument("--dry-run", action="store_true", help="print the sbatch command only")
    _add_sbatch_arguments(s, "the job")
    s.set_defaults(func=_submit, unknown_hint="; the script's own arguments go after `--`: "
                   "repro slurm submit SCRIPT -- --smoke --set KEY=VALUE; sbatch's in --sbatch=OPTION")
    w = ssub.add_parser("sweep", help=f"submit every run of a paper table: {', '.join(sorted(TABLES))}")
    w.add_argument("table", help=f"one of {', '.join(sorted(TABLES))}")
    w.add_argument("args", nargs="*", help="passed to every script, after `--` (e.g. `-- --set K=V`)")
    w.add_argument("--dry-run", action="store_true", help="print the sbatch commands only")
    _add_sbatch_arguments(w, "every job")
    w.set_defaults(func=_sweep, unknown_hint="; the scripts' own arguments go after `--`: "
                   "repro slurm sweep TABLE -- --set KEY=VALUE; sbatch's in --sbatch=OPTION")
    n = ssub.add_parser("check-network", help="NCCL_/GLOO_SOCKET_IFNAME against this node's interfaces")
    n.add_argument("--backend", choices=("nccl", "gloo"), default=None,
                   help="[nccl where a GPU is visible, else gloo]")
    n.set_defaults(func=_check_network)
    k = ssub.add_parser("check-checkpoint", help="the checkpoint of an evaluation job is of the family it needs")
    k.add_argument("checkpoint")
    k.add_argument("--family", choices=sorted(NEEDED_FAMILY), required=True)
    k.set_defaults(func=_check_checkpoint)
    t = ssub.add_parser("status", help="your queue, or the state of the given jobs")
    t.add_argument("jobs", nargs="*")
    t.set_defaults(func=_status)
