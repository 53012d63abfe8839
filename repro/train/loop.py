"""The training loop: data -> steps -> logging -> checkpoints, resumable and preemption-safe.

    torchrun --nproc-per-node 2 -m repro.cli train experiments/tiny/gpt_tiny.yaml --set parallel.tp=2
    srun -n 8 repro train experiments/scaling/scale_8b.yaml        # one task per GPU under Slurm
"""

from __future__ import annotations

import json
import os
import signal
import time
from contextlib import contextmanager, suppress
from pathlib import Path

import torch
import torch.distributed as dist

from repro.data.errors import DataError
from repro.parallel.groups import ProcessGroups
from repro.parallel.placement import Placement, gather_placement
from repro.perf.flops import throughput
from repro.perf.peaks import peak_tflops
from repro import run_lock
from repro.provenance import FULL_DISK, git_sha, write_atomic
from repro.tracking.logger import RunLogger
from repro.tracking.run_dir import (STOP_MARKER, read_metrics, recorded_run_id, set_aside_rows_after,
                                    set_aside_run_id, set_aside_run_ids)
from repro.train import checkpoint as ck
from repro.train.config import (RunConfig, RunConfigError, derive, flat_params, saved_schedule, schedule_differences,
                                to_yaml)
from repro.train.engine import Engine, build_engine
from repro.train.engine_state import (TrainState, check_same_train_data, load, optimizer_state_bytes, resume_meta,
                                      save, train_data_size)
from repro.train.objectives import build_dataset, data_loader
from repro.train.optim import lr_at
from repro.train.signals import STOP_SIGNALS, PendingStop
from repro.train.step import evaluate, refuse_divergence, train_step

FLOP_FORMULA = "Narayanan et al. 2021: 72 B s l h^2 (1 + s/6h + V/12lh), no recompute counted"
BERT_HEADS_FLOPS = " + BERT's heads, 3 (2Bsh^2 + 2Bh^2 + 4Bh), never recomputed"
RUN_LOCK = ".lock"
"""The run dir's lock file: there while rank 0 of the job training in it holds it (repro.run_lock)."""
HW_FLOP_FORMULA = ("Narayanan et al. 2021: 96 B s l h^2 (1 + s/6h + V/16lh) with activation checkpointing "
                   "(the forward recomputed), else the 72 form")


class StopSignal:
    """SIGTERM / SIGUSR1 (Slurm preemption, time limit) ask for a checkpoint and a clean exit, while
    inside `with StopSignal(group)`; the caller's handlers are back afterwards. So does passing
    `exit_after_s` seconds of this object's life (train.exit_duration_minutes)."""

    SIGNALS = STOP_SIGNALS

    def __init__(self, group: dist.ProcessGroup | None, exit_after_s: float = 0.0) -> None:
        self.group, self.received, self._saved = group, None, {}
        self.deadline = time.monotonic() + exit_after_s if exit_after_s > 0 else None

    def __enter__(self) -> "StopSignal":
        self._saved = {sig: signal.signal(sig, self._handle) for sig in self.SIGNALS}
        for previous in self._saved.values():  # one that came before this handler existed
            if isinstance(previous, PendingStop) and previous.received:
                self.received = previous.received
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._saved.items():
            signal.signal(sig, handler)

    def _handle(self, signum, _frame) -> None:
        self.received = signum

    def due(self) -> bool:
        """This rank's own view: a signal received, or the exit duration passed."""
        return bool(self.received) or (self.deadline is not None and time.monotonic() >= self.deadline)

    def agreed(self, device: torch.device) -> bool:
        """True on every rank of `group` once any is `due` (one tiny all-reduce; the ranks' clocks
        need not agree)."""
        flag = torch.tensor(1.0 if self.due() else 0.0, device=device)
        if self.group is not None:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        return bool(flag.item())


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def run_params(cfg: RunConfig, eng: Engine) -> dict[str, str]:
    """MLflow params: the resolved config plus the layout and provenance."""
    heads = BERT_HEADS_FLOPS if cfg.family == "bert" else ""
    return {**flat_params(cfg), "tp": str(eng.pg.tp_size), "dp": str(eng.pg.dp_size),
            "world_size": str(eng.pg.dims.world_size), "device_type": eng.device.type,
            "device_name": device_name(eng.device), "precision": cfg.precision.precision,
            "zero_stage": str(cfg.train.zero_stage), "git_sha": git_sha(),
            "slurm_job_id": os.environ.get("SLURM_JOB_ID", ""),
            "grad_accum_steps": str(eng.derived.grad_accum_steps),
            "padded_vocab_size": str(eng.derived.padded_vocab_size), "flop_formula": FLOP_FORMULA + heads,
            "hw_flop_formula": HW_FLOP_FORMULA + heads,
            "torch_version": torch.__version__}


def data_params(cfg: RunConfig, train_data) -> dict[str, str]:
    """The training split's size and how many epochs of it the run makes (MLflow params, and a line
    at start): the paper's GPT-2 runs made 300k iterations at 68,507 an epoch, 4.38 epochs."""
    samples = len(train_data)
    return {"data_train_tokens": str(train_data.data.num_tokens), "data_train_samples_per_epoch": str(samples),
            "data_epochs": f"{cfg.train.train_iters * cfg.train.global_batch_size / samples:.4f}"}


def _micro_batches(loader, n: int) -> list:
    return [next(loader) for _ in range(n)]


def _memory_gb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    import psutil

    return psutil.Process().memory_info().rss / 2**30


def eval_micro_batches(cfg: RunConfig, dp: int, samples: int) -> int:
    """Micro batches per DP rank of one evaluation: `train.eval_iters` global batches, as in
    Megatron-LM, so every layout evaluates the same first eval_iters x global_batch_size held-out
    samples; fewer whole global batches when the split is shorter (whole micro-batch rounds of all
    DP ranks when it is shorter than one global batch; 0 when shorter than one round, which the
    trainer refuses)."""
    t = cfg.train
    per_global = t.global_batch_size // (t.micro_batch_size * dp)  # micro batches of a global batch, per rank
    whole = min(t.eval_iters, samples // t.global_batch_size) * per_global
    return whole or min(t.eval_iters * per_global, samples // (t.micro_batch_size * dp))


def _valid_loader(cfg: RunConfig, pg: ProcessGroups, device_type: str):
    """Each evaluation's micro batches; DataError for a split too short to give every DP rank one."""
    if not cfg.data.valid_prefix:
        return None
    data = build_dataset(cfg, cfg.data.valid_prefix, write_cache=pg.rank == 0)  # once; each evaluation restarts it
    count = eval_micro_batches(cfg, pg.dp_size, len(data))
    if count == 0:
        round_ = cfg.train.micro_batch_size * pg.dp_size
        raise DataError(f"{cfg.data.valid_prefix}: the held-out split holds {len(data)} sample(s), fewer than one "
                        f"micro batch on each DP rank (train.micro_batch_size={cfg.train.micro_batch_size} x dp="
                        f"{pg.dp_size} = {round_}), so there would be nothing to evaluate. Fix: point "
                        "data.valid_prefix at a larger split (repro data prepare --split), lower "
                        "train.micro_batch_size, or set data.valid_prefix='' to train without evaluation")
    return lambda: _micro_batches(iter(data_loader(cfg, pg, data, device_type=device_type)), count)


def _log_line(state: TrainState, cfg: RunConfig, m: dict) -> str:
    return (f" iteration {state.iteration:>6}/{cfg.train.train_iters} | consumed samples {state.consumed_samples:>9}"
            f" | ms/iter {m['ms_per_iter']:8.1f} | tokens/s {m['tokens_per_s']:9.0f}"
            f" | TFLOP/s/device {m['tflops_per_device']:6.2f} | lr {m['lr']:.3e} | loss {m['loss']:.4f}"
            f" | loss scale {m['loss_scale']:.1f} | grad norm {m['grad_norm']:.3f}"
            f" | skipped {int(m['skipped_iters'])}")


def skipped_iters(eng: Engine) -> int:
    """Steps skipped for fp16 overflow since the run began (the loss scaler's count, or DeepSpeed's
    skipped_steps: both are checkpointed, so a resumed run continues the count)."""
    if eng.deepspeed:
        return int(getattr(eng.wrapped, "skipped_steps", 0))
    return eng.scaler.skipped if eng.scaler else 0


def _step_metrics(result, eng: Engine) -> dict:
    """Per-step metrics: the loss, its parts (BERT: mlm_loss, sop_loss), lr, grad norm, loss scale."""
    return {"loss": result.loss, **result.parts, "lr": result.lr, "grad_norm": result.grad_norm,
            "loss_scale": result.loss_scale, "skipped_iters": skipped_iters(eng)}


class _Interval:
    """Accumulates step results between log lines (evaluation and checkpoint time `exclude`d). The
    first interval of each launch (a fresh start or a resume) carries its warm-up (allocator, cuDNN
    and compile autotuning, data workers) and is logged with `warmup_interval` 1, so the tables drop
    it after every resume, not only the run's first. The flag stays `first` until an interval's row is
    written: a resume after a hard kill redoes steps whose rows the killed launch wrote, and the
    analysis finds where the last launch begins by the last flag (runs.last_launch)."""

    def __init__(self) -> None:
        self.start, self.steps, self.first = time.perf_counter(), 0, True

    def exclude(self, since: float) -> float:
        """Leave the seconds since `since` (a perf_counter value) out of this interval; returns them."""
        seconds = time.perf_counter() - since
        self.start += seconds
        return seconds

    def metrics(self, result, eng: Engine, peak: float | None) -> dict:
        seconds = (time.perf_counter() - self.start) / max(self.steps, 1)
        cfg = eng.cfg
        tokens = cfg.train.global_batch_size * cfg.model.seq_length
        tp = throughput(cfg.model, tokens, seconds, eng.pg.dims.world_size, device_name(eng.device),
                        cfg.precision.precision, cfg.model.activation_checkpointing, peak_tflops=peak,
                        bert=cfg.family == "bert", tp=eng.pg.tp_size)
        self.start, self.steps = time.perf_counter(), 0
        return {**_step_metrics(result, eng), "warmup_interval": float(self.first),
                "ms_per_iter": 1000 * seconds, "tokens_per_s": tp["tokens_per_s"],
                "tflops_per_device": tp["model_tflops_per_device"], "mfu": tp["mfu"],
                "hw_tflops_per_device": tp["hardware_tflops_per_device"], "hfu": tp["hfu"],
                "memory_gb": _memory_gb(eng.device)}


def train(cfg: RunConfig, pg: ProcessGroups, local_rank: int = 0, tags: dict[str, str] | None = None) -> dict:
    """Train (or resume) a GPT or BERT run; returns the final metrics. Every rank calls it."""
    derived = derive(cfg, pg.dims.world_size)
    if not cfg.data.train_prefix:
        raise ck.CheckpointError("data.train_prefix is empty: run `repro data prepare` and set it, e.g. "
                                 "--set data.train_prefix=data/wt2_gpt_train (the WikiText-2 split `make demo` "
                                 "prepares)")
    with _run_dir_locked(cfg.run_dir, pg):  # before anything is read from or written to the run dir
        return _train_locked(cfg, pg, derived, local_rank, tags)


@contextmanager
def _run_dir_locked(run_dir: str, pg: ProcessGroups):
    """Rank 0 holds RUN_DIR/.lock while inside; every rank raises RunConfigError at once when another
    job holds it (or it cannot be made), so two jobs never write one run dir together."""
    held, refusal, created = None, None, not Path(run_dir).exists()
    if pg.rank == 0:
        try:
            Path(run_dir).mkdir(parents=True, exist_ok=True)
            held = run_lock.acquire(Path(run_dir) / RUN_LOCK)
        except run_lock.LockHeld as other:
            refusal = _run_dir_in_use(run_dir, other.holder)
        except OSError as err:
            fix = ("free space there (or raise the quota), or set run_dir on a larger disk" if err.errno in FULL_DISK
                   else "set run_dir to a directory you can write")
            refusal = f"run_dir {run_dir}: cannot create its lock file {RUN_LOCK} ({err.strerror or err}). Fix: {fix}"
    refusal = _from_rank0(refusal, pg.world_group)
    if refusal:
        raise RunConfigError(refusal)
    try:
        yield
    finally:
        run_lock.release(held)
        if created and held is not None:
            _remove_if_empty(Path(run_dir))


def _remove_if_empty(run_dir: Path) -> None:
    """The run dir this launch created, if it failed before writing anything there (a config error)."""
    with suppress(OSError):  # not empty: the run wrote into it
        run_dir.rmdir()


def _run_dir_in_use(run_dir: str, holder: str) -> str:
    return (f"run_dir {run_dir} is in use by another training job ({holder}; lock file {Path(run_dir) / RUN_LOCK}): "
            "two jobs in one run dir overwrite each other's checkpoints and metrics. Fix: wait for that job to "
            "end (a later launch resumes from its checkpoint), or give this one another run dir (--set "
            "run_dir=..., or REPRO_RUN_NAME under slurm/launch.sh)")


def _from_rank0(value, group: dist.ProcessGroup | None):
    """Rank 0's `value` on every rank of `group` (itself without one)."""
    if group is None:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


def _train_locked(cfg: RunConfig, pg: ProcessGroups, derived, local_rank: int, tags: dict[str, str] | None) -> dict:
    """`train`'s body, run while rank 0 holds the run dir's lock."""
    latest, saved = resume_meta(cfg, pg.tp_size, pg.dims.world_size)
    if saved and saved["iteration"] >= cfg.train.train_iters:
        if _finished_at(cfg.run_dir) == saved["iteration"]:
            return _nothing_to_train(cfg, saved, pg.rank)
        _say_finishing(cfg, saved, pg.rank)  # trained, but stopped before its final evaluation
    # SIGTERM/SIGUSR1 from here on (Slurm warns before a time limit; setup may be under way): a signal
    # during setup or loading is honoured after the first step
    with StopSignal(pg.world_group, 60 * cfg.train.exit_duration_minutes) as stop:
        data_size = None  # (a resume reads the index once for both: ~16 s at 1.5B sentences)
        if latest is not None:  # before the engine is built, the checkpoint read, or a cache written
            data_size = train_data_size(cfg.data.train_prefix)
            check_same_train_data(saved, data_size, cfg.data.train_prefix, latest)
        eng = build_engine(cfg, derived, pg, local_rank)
        state, meta = TrainState(), {}
        if latest is not None:
            state, meta = load(eng, latest)
            if pg.rank == 0:
                print(f"resumed from {latest} at iteration {state.iteration} "
                      f"({state.consumed_samples:,} samples consumed)", flush=True)
                if meta.get("dp", pg.dp_size) != pg.dp_size:
                    print(f"note: saved at dp={meta['dp']}, resumed at dp={pg.dp_size}: the data order, weights and "
                          "optimizer state carry over, but the dropout masks and the gradient summation order "
                          f"differ, so the losses follow an uninterrupted dp={meta['dp']} run closely, not exactly",
                          flush=True)
            _say_if_the_code_changed(meta, latest, pg.rank)
        placement = pg.placement or gather_placement(pg.world_group)
        train_data = build_dataset(cfg, cfg.data.train_prefix, write_cache=pg.rank == 0)
        state.train_data = data_size or train_data_size(cfg.data.train_prefix)
        loader = iter(data_loader(cfg, pg, train_data, state.consumed_samples, eng.device.type))
        valid = _valid_loader(cfg, pg, eng.device.type)
        replaced = _set_aside_if_redone_differently(cfg, meta, state.iteration) if meta and pg.rank == 0 else None
        logger = _logger(cfg, eng, _resume_run_id(cfg, meta), tags or {}, data_params(cfg, train_data), placement,
                         starts_over=not meta, replaces_run_id=replaced) if pg.rank == 0 else None
        if logger and meta:  # a hard kill after the checkpoint: the steps it redoes are logged already
            logger.resume_at(state.iteration)
        peak = peak_tflops(device_name(eng.device), cfg.precision.precision)
        interval, final = _Interval(), {}
        if pg.rank == 0 and state.iteration >= cfg.train.train_iters:  # no step runs: the last one's, as logged
            final = _logged_step_metrics(cfg.run_dir, state.iteration)
        if "rng" in meta:
            ck.restore_rng(meta.pop("rng"), eng.rng, eng.device)
        try:
            while state.iteration < cfg.train.train_iters:
                result = train_step(eng, _micro_batches(loader, derived.grad_accum_steps))
                state.iteration += 1
                state.consumed_samples += cfg.train.global_batch_size
                interval.steps += 1
                final = _after_step(eng, state, result, interval, peak, logger, valid, stop)
                if stop.agreed(eng.device) and state.iteration < cfg.train.train_iters:  # the last step finishes
                    return _stop_for_signal(eng, state, final, logger, meta, stop)
            return _finish(eng, state, final, logger, valid, meta)
        except KeyboardInterrupt:  # Ctrl-C where no launcher turned it into a stop (one process, torchrun):
            if logger:             # ended by the user, as a stop is, not a failure; the last checkpoint stands
                logger.close("KILLED")
            raise
        except BaseException:
            if logger:
                logger.close("FAILED")
            raise


def _set_aside_if_redone_differently(cfg: RunConfig, meta: dict, iteration: int) -> str | None:
    """A resume redoes the steps after its checkpoint. Where the earlier launch ran them at another lr (a
    new schedule: optim.override_schedule, or a new train.train_iters with optim.lr_decay_iters unset), its
    rows after the checkpoint are moved aside, not kept in their place; so are its rows past a shortened
    run's end. Those cannot leave its MLflow run: the run id is set aside too and returned (this launch
    logs into a new run), else None."""
    saved = _previous_config(cfg, meta)
    if saved is None:
        return None
    changes = ", ".join(f"{key} {old!r} -> {new!r}" for key, (old, new) in schedule_differences(saved, cfg).items())
    end = cfg.train.train_iters
    if _lr_differs(saved, cfg, iteration):
        print(f"new schedule from iteration {iteration + 1}: {changes}", flush=True)
        keep = iteration
    else:
        keep = max(iteration, end)
    last = max((row["step"] for row in read_metrics(cfg.run_dir)), default=0)
    if last <= keep:
        return None
    if keep != iteration:
        print(f"the run now ends at iteration {end} ({changes})", flush=True)
    aside = set_aside_rows_after(Path(cfg.run_dir), keep)
    print(f"the earlier launch's rows after iteration {keep} are in {aside} only", flush=True)
    replaced = set_aside_run_id(Path(cfg.run_dir)) if last > end else None
    if replaced:
        print(f"its MLflow run {replaced} keeps its rows after iteration {end} (MLflow deletes no metric value): "
              "this launch logs into a new run, with metrics.jsonl's rows", flush=True)
    return replaced


def _previous_config(cfg: RunConfig, meta: dict) -> str | None:
    """The resolved config of the launch whose rows follow the checkpoint: the run dir's config.yaml
    (each launch writes it before logging), else the checkpoint's."""
    path = Path(cfg.run_dir) / "config.yaml"
    return path.read_text() if path.is_file() else meta.get("config_yaml")


def _lr_differs(saved_yaml: str, cfg: RunConfig, iteration: int) -> bool:
    """Whether a step after `iteration` that the saved config also ran gets another lr now."""
    old, old_iters = saved_schedule(saved_yaml, cfg)
    return any(lr_at(i, old, old_iters) != lr_at(i, cfg.optim, cfg.train.train_iters)
               for i in range(iteration, min(old_iters, cfg.train.train_iters)))


def _resume_run_id(cfg: RunConfig, meta: dict) -> str | None:
    """The MLflow run a resumed launch keeps (None for a run begun again): its checkpoint's, or the one
    the run dir names (after `repro tracking sync`, or where the checkpoint's was set aside)."""
    if not meta:
        return None
    saved = meta.get("mlflow_run_id")
    return (None if saved in set_aside_run_ids(Path(cfg.run_dir)) else saved) or recorded_run_id(cfg.run_dir)


def _stop_for_signal(eng: Engine, state: TrainState, final: dict, logger, meta: dict, stop: StopSignal) -> dict:
    """Checkpoint (unless this iteration's periodic save just did), mark the MLflow run KILLED, and leave
    the marker that has slurm/launch.sh requeue the job (the resumed launch reopens the same MLflow run)."""
    if logger:
        why = (f"signal {signal.Signals(stop.received).name}" if stop.received else
               f"train.exit_duration_minutes={eng.cfg.train.exit_duration_minutes:g} passed" if stop.due()
               else "another rank's stop")
        print(f"stopping at iteration {state.iteration} ({why}): checkpointing", flush=True)
    _save_unless_saved(eng, state, logger.run_id if logger else meta.get("mlflow_run_id"))
    _log(logger, {"preempted": 1.0}, state.iteration)
    if logger:  # sends queued metrics
        logger.close("KILLED")
    if eng.pg.rank == 0:
        write_atomic(Path(eng.cfg.run_dir) / STOP_MARKER, str(state.iteration).encode())
    return {**final, "stopped_by_signal": True, "iteration": state.iteration}


def _say_if_the_code_changed(meta: dict, path: Path, rank: int) -> None:
    """A resume under other code than wrote the checkpoint (a `git pull` between the pieces of a
    requeued job) goes on, but says so: the MLflow run keeps the first piece's git_sha."""
    if rank != 0:
        return
    saved, now = meta.get("git_sha", ""), git_sha()
    if saved and saved != now:
        print(f"WARNING: resuming {path} (written at git {saved}) with code at git {now}: the run's "
              "iterations before and after this point come from different code", flush=True)


def _nothing_to_train(cfg: RunConfig, saved: dict, rank: int) -> dict:
    """A finished run launched again: say so and leave its checkpoints, metrics and MLflow run alone."""
    if rank == 0:
        print(f"run {cfg.run_dir} is already at iteration {saved['iteration']} (train.train_iters="
              f"{cfg.train.train_iters}): nothing to train; raise train.train_iters to continue", flush=True)
    path = Path(cfg.run_dir) / "final_metrics.json"
    final = json.loads(path.read_text()) if rank == 0 and path.exists() else {}
    return {**final, "iteration": saved["iteration"], "consumed_samples": saved["consumed_samples"],
            "nothing_to_train": True}


def _finished_at(run_dir: str) -> int | None:
    """The iteration of the run dir's final_metrics.json (None without a readable one). A run extended
    past it (a higher train.train_iters) and killed before its new final evaluation has an older one."""
    path = Path(run_dir) / "final_metrics.json"
    try:
        return int(json.loads(path.read_text())["iteration"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _say_finishing(cfg: RunConfig, saved: dict, rank: int) -> None:
    if rank == 0:
        done = _finished_at(cfg.run_dir)
        what = f"its final_metrics.json is from iteration {done}" if done is not None else "it has no final_metrics.json"
        print(f"run {cfg.run_dir} is at iteration {saved['iteration']} (train.train_iters={cfg.train.train_iters}) "
              f"but {what}: it stopped before finishing; running only its held-out evaluation and final metrics",
              flush=True)


def placement_params(placement: Placement, eng: Engine) -> dict[str, str]:
    """MLflow params: how many hosts the ranks ran on, and whether every TP group stayed inside one."""
    return {"num_hosts": str(len(placement.ranks_by_host())),
            "tp_groups_within_host": str(not placement.split_tp_groups(eng.pg.dims)).lower()}


def _logger(cfg: RunConfig, eng: Engine, resume_run_id, tags, data: dict[str, str],
            placement: Placement, starts_over: bool, replaces_run_id: str | None = None) -> RunLogger:
    all_tags = {"family": cfg.tracking.experiment, "paper_ref": cfg.tracking.paper_ref,
                "slurm_job_id": os.environ.get("SLURM_JOB_ID", ""), **tags}
    print(f" train data {cfg.data.train_prefix}: {int(data['data_train_tokens']):,} tokens, "
          f"{int(data['data_train_samples_per_epoch']):,} samples an epoch; {cfg.train.train_iters:,} iterations "
          f"of {cfg.train.global_batch_size} = {float(data['data_epochs']):.2f} epochs", flush=True)
    print(" " + placement.summary(eng.pg.dims), flush=True)  # (init_distributed warned of any TP group across hosts)
    logger = RunLogger(cfg.run_dir, cfg.tracking.experiment, cfg.name,
                       {**run_params(cfg, eng), **data, **placement_params(placement, eng)},
                       all_tags, use_mlflow=cfg.tracking.enabled, resume_run_id=resume_run_id,
                       starts_over=starts_over, replaces_run_id=replaces_run_id)
    config_path = Path(cfg.run_dir) / "config.yaml"
    write_atomic(config_path, to_yaml(cfg).encode())
    logger.log_artifact(config_path)
    placement_path = Path(cfg.run_dir) / "placement.json"
    write_atomic(placement_path, json.dumps(placement.as_dict(), indent=1).encode())
    logger.log_artifact(placement_path)
    return logger


def _log(logger: RunLogger | None, metrics: dict, step: int) -> bool:
    """Whether a row was written (not without a logger, nor where an earlier launch logged them all)."""
    return bool(logger) and logger.log_metrics(metrics, step)


def _after_step(eng, state, result, interval, peak, logger, valid, stop: StopSignal) -> dict:
    """Log, and evaluate and save when due; their time is logged as eval_seconds and save_seconds,
    not charged to the next interval's ms/iter, tokens/s and TFLOP/s. A due evaluation is skipped
    once a stop signal is agreed: Slurm's warning leaves time for the checkpoint, not for both."""
    cfg, it = eng.cfg, state.iteration
    metrics = _step_metrics(result, eng)
    if it % cfg.train.log_interval == 0 or it == cfg.train.train_iters:
        metrics = interval.metrics(result, eng, peak)
        if logger:
            print(_log_line(state, cfg, metrics), flush=True)
    written = _log(logger, {**metrics, "consumed_samples": state.consumed_samples}, it)
    if "warmup_interval" in metrics and (written or not logger):  # a row logged already: the next one is flagged
        interval.first = False
    refuse_divergence(result, it, state.saved_at, eng)  # logged (MLflow shows it), then neither evaluated nor saved
    if valid and cfg.train.eval_interval and it % cfg.train.eval_interval == 0 and not stop.agreed(eng.device):
        began = time.perf_counter()
        state.held_out, state.held_out_at = evaluate(eng, valid()), it
        if logger:
            print(f" validation at iteration {it}: " + " | ".join(f"{k} {v:.4f}" for k, v in state.held_out.items()),
                  flush=True)
        _log(logger, {**state.held_out, "eval_seconds": interval.exclude(began)}, it)
    if cfg.train.save_interval and it % cfg.train.save_interval == 0:
        began = time.perf_counter()
        save(eng, state, logger.run_id if logger else None)
        _log(logger, {"save_seconds": interval.exclude(began)}, it)
    return metrics


def _logged_step_metrics(run_dir: str, iteration: int) -> dict:
    """What `_after_step` returned for step `iteration` (the `final` that `_finish` extends), read back from
    metrics.jsonl: a launch resumed at train.train_iters (the one before killed after its last checkpoint but
    before final_metrics.json) runs no step. Its row is the one `_Interval.metrics` gave (marked by
    `warmup_interval`), less the row's own fields; {} without one."""
    logged = {}
    for row in read_metrics(run_dir):
        if row["step"] == iteration and "warmup_interval" in row:
            logged.update(row)
    return {k: v for k, v in logged.items() if k not in ("step", "time", "consumed_samples")}


def _save_unless_saved(eng: Engine, state: TrainState, run_id: str | None) -> None:
    """Save, unless this iteration is saved already (a periodic save just wrote it, or the run resumed
    from it). Decided from the state every rank holds alike, so all ranks take the same branch of this
    collective (each reading `latest` from a caching network filesystem might not)."""
    if state.saved_at != state.iteration:
        save(eng, state, run_id)


def _finish(eng, state, final, logger, valid, meta) -> dict:
    cfg = eng.cfg
    _save_unless_saved(eng, state, logger.run_id if logger else meta.get("mlflow_run_id"))
    final = {**final, "iteration": state.iteration, "consumed_samples": state.consumed_samples,
             "optimizer_state_bytes": optimizer_state_bytes(eng),
             "local_parameters": sum(p.numel() for p in eng.model.parameters())}
    if valid and state.held_out_at == state.iteration:  # the last step's periodic evaluation: not run twice
        final.update(state.held_out)
    elif valid:
        held_out = evaluate(eng, valid())
        final.update(held_out)
        _log(logger, held_out, state.iteration)
    if logger:
        path = Path(cfg.run_dir) / "final_metrics.json"
        write_atomic(path, json.dumps(final, indent=1).encode())
        logger.log_artifact(path)
        logger.close()
        final["mlflow_run_id"] = logger.run_id
    return final
