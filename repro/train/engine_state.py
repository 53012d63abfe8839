"""Saving and restoring a training engine: a run's complete checkpoint (model shards, optimizer,
schedule, loss scale, RNG, DeepSpeed ZeRO state) and the checks a launch makes before resuming it.

The on-disk format (atomic directories, `latest`, shard ownership) is repro.train.checkpoint's (another TP
degree: repro.train.reshard);
this module decides what of an Engine goes into it and comes back out.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from repro.data.indexed_dataset import IndexedDataset
from repro.parallel.groups import ProcessGroups
from repro.provenance import full_disk_behind, git_sha, save_torch
from repro.train import checkpoint as ck
from repro.train.config import RunConfig, check_resume, to_yaml
from repro.train.engine import Engine
from repro.train.optim import resync_lr


@dataclass
class TrainState:
    iteration: int = 0
    consumed_samples: int = 0
    saved_at: int = -1
    """The iteration the last checkpoint holds (known alike on every rank: no filesystem read)."""
    held_out: dict[str, float] = field(default_factory=dict)
    """This launch's latest periodic held-out evaluation; `held_out_at` its iteration."""
    held_out_at: int = -1
    train_data: dict[str, int] = field(default_factory=dict)
    """The training split's size (`train_data_size`), saved with checkpoints and checked at resume."""


def save(eng: Engine, state: TrainState, run_id: str | None) -> Path:
    """Write a complete checkpoint of every rank (atomic: temp dir, rename, then `latest`).

    The DP replicas hold the same model and optimizer state; TP rank t's shard is written by DP
    replica t mod dp (`shard_owner`), so at TP=8 the 8 shards leave from 8 nodes, not all from node 0.
    A full disk is a CheckpointError (`disk_full_error`)."""
    root = Path(eng.cfg.run_dir) / "checkpoints"
    try:
        return _save(eng, state, run_id, root)
    except OSError as err:
        if err.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        raise disk_full_error(root, state.iteration, err) from None


def disk_full_error(root: Path, iteration: int, err: OSError) -> ck.CheckpointError:
    """The error for a checkpoint that did not fit: the file, the space left, what `latest` names, the fix."""
    try:
        free = f"{shutil.disk_usage(root).free / 2**20:,.0f} MiB free"
    except OSError:
        free = "free space unknown"
    try:
        latest = ck.read_pointer(root / "latest") if (root / "latest").is_file() else None
    except ck.CheckpointError:
        latest = None
    kept = f"the last good checkpoint, {latest}" if latest else "no complete checkpoint"
    name = ck.iter_name(iteration)
    return ck.CheckpointError(
        f"checkpoint {name} did not fit: {err.strerror} writing {err.filename or root} ({free} in {root}). "
        f"`latest` still points to {kept}. Fix: free space there (the partial {name}.tmp can go) or point "
        "run_dir at a larger disk, then rerun the same command: it resumes from `latest`")


def _deepspeed_save(eng: Engine, folder: Path) -> None:
    """DeepSpeed's ZeRO checkpoint. It writes through torch's C++ file writer, whose failed write is a
    RuntimeError with no OSError behind it: one raised while the disk has less than FULL_MIB left is
    taken for a full disk."""
    try:
        eng.wrapped.save_checkpoint(str(folder), tag="zero", save_latest=False)
    except RuntimeError as err:
        full = full_disk_behind(err)
        if full is None and _free_mib(folder) < FULL_MIB:
            full = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(folder))
        if full is None:
            raise
        raise full from None


FULL_MIB = 16  # less free space than this after a failed write: the write did not fit


def _free_mib(folder: Path) -> float:
    try:
        return shutil.disk_usage(folder if folder.exists() else folder.parent).free / 2**20
    except OSError:
        return float("inf")


def _save(eng: Engine, state: TrainState, run_id: str | None, root: Path) -> Path:
    pg = eng.pg
    tmp = ck.begin_save(root, state.iteration, pg)
    owner = pg.dp_rank == ck.shard_owner(pg)  # one DP replica per TP shard, spread over nodes
    model_state = _model_state(eng, owner)
    if owner:
        save_torch(model_state, tmp / f"model_tp{pg.tp_rank:02d}.pt")
        if not eng.deepspeed:
            extra = {"optimizer": eng.optimizer.state_dict(), "scheduler": eng.scheduler.state_dict(),
                     "scaler": eng.scaler.state_dict() if eng.scaler else {}}
            save_torch(extra, tmp / f"optim_tp{pg.tp_rank:02d}.pt")
    if eng.deepspeed:
        _deepspeed_save(eng, tmp / "deepspeed")
    save_torch(ck.rng_state(eng.rng, eng.device), tmp / f"rng_rank{pg.rank:05d}.pt")
    if pg.rank == 0:
        meta = {"format": ck.FORMAT_VERSION, "family": eng.cfg.family, "iteration": state.iteration,
                "consumed_samples": state.consumed_samples, "tp": pg.tp_size,
                "dp": pg.dp_size, "world_size": pg.dims.world_size, "zero_stage": eng.cfg.train.zero_stage,
                "model": eng.cfg.model.__dict__, "config_yaml": to_yaml(eng.cfg), "git_sha": git_sha(),
                "mlflow_run_id": run_id, "train_data": state.train_data}
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
    final = ck.finish_save(root, state.iteration, pg, keep=eng.cfg.train.keep_checkpoints)
    state.saved_at = state.iteration
    return final


def _model_state(eng: Engine, owner: bool) -> dict | None:
    """The model file's fp32 weights (a half model's masters; ZeRO's fp32 partitions, gathered with
    every DP rank taking part) on the owner replica; None elsewhere."""
    if eng.deepspeed:
        return zero_fp32_state_dict(eng.model, owner)
    if not owner:
        return None
    return eng.masters.state_dict(eng.model) if eng.masters else eng.model.state_dict()


def zero_fp32_state_dict(model: torch.nn.Module, keep: bool) -> dict[str, torch.Tensor] | None:
    """The model's state dict with DeepSpeed ZeRO's fp32 master of every parameter (not the
    bf16/fp16 copy the module holds), as the plain trainer saves; None where not `keep`.

    Each master is partitioned over the DP group: `safe_get_full_fp32_param` all-reduces it, so every
    DP rank calls this in the same parameter order; only the ranks that `keep` hold the result, in host
    memory (a whole fp32 copy of the TP shard would not fit beside ZeRO's state on every GPU)."""
    from deepspeed.utils import safe_get_full_fp32_param

    params = {id(p) for p in model.parameters()}
    state = {}
    for name, tensor in model.state_dict(keep_vars=True).items():  # buffers as they are
        full = safe_get_full_fp32_param(tensor) if id(tensor) in params else None
        if keep:
            state[name] = (full if full is not None else tensor.detach()).cpu()
    return state if keep else None


def train_data_size(prefix: str) -> dict[str, int]:
    """What identifies a training split cheaply (from its index): its tokens, documents and sequences
    (GPT documents, BERT sentences)."""
    data = IndexedDataset(prefix)
    return {"tokens": int(data.num_tokens), "documents": data.num_documents, "sequences": len(data)}


def check_same_train_data(meta: dict, size: dict[str, int], prefix: str, ckpt: Path) -> None:
    """Refuse to resume on another training split: the checkpoint's consumed_samples is a position in
    the data it was trained on, and elsewhere it would silently skip or repeat data (data.train_prefix
    may move, as long as the files hold the same split)."""
    saved = meta.get("train_data")
    if saved and saved != size:
        changed = ", ".join(f"{key} {saved.get(key)} -> {size.get(key)}" for key in size if saved.get(key) != size.get(key))
        raise ck.CheckpointError(
            f"{ckpt} was trained on other data than data.train_prefix={prefix} holds ({changed}): a resume "
            "continues at the checkpoint's position in its data. Fix: point data.train_prefix at the split it "
            "was trained on, or start a new run with --set run_dir=NEW_DIR")


def _refuse_model_only(path: Path) -> None:
    raise ck.CheckpointError(f"{path} is a model-only (resharded) checkpoint without optimizer state: it cannot "
                             "be resumed; train in a new run_dir (`repro train` does not start from one: use it with "
                             "repro eval, generate or finetune)")


def _refuse_model_only_in(run_dir: Path) -> None:
    """A model-only checkpoint (a reshard's or import's --out) at run_dir/checkpoints or run_dir itself: not
    a run to resume, nor one to start afresh beside it (its files would silently go unused)."""
    for path in (run_dir / "checkpoints", run_dir):
        try:
            meta = json.loads((path / "meta.json").read_text())
        except (OSError, ValueError):
            continue
        if isinstance(meta, dict) and meta.get("model_only"):
            _refuse_model_only(path)


def resume_meta(cfg: RunConfig, tp: int, world_size: int) -> tuple[Path | None, dict]:
    """The run's latest checkpoint and its meta, checked against this launch (nothing is loaded)."""
    latest = ck.latest_checkpoint(Path(cfg.run_dir) / "checkpoints")
    if latest is None:
        _refuse_model_only_in(Path(cfg.run_dir))
        return None, {}
    meta = ck.read_meta(latest)
    if meta.get("model_only"):
        _refuse_model_only(latest)
    if meta["tp"] != tp:
        ranks = f" on a multiple of {meta['tp']} ranks" if meta["tp"] > 1 else ""
        raise ck.CheckpointError(
            f"{latest} was saved at tp={meta['tp']} but this run has tp={tp}: a run resumes at its saved "
            f"layout, so launch with --set parallel.tp={meta['tp']}{ranks}. `repro checkpoint reshard` "
            "converts the model weights only (for evaluation, fine-tuning or export), not a run to resume")
    if meta.get("zero_stage", 0) > 0 and meta["dp"] != world_size // tp:
        raise ck.CheckpointError(
            f"{latest} was saved by DeepSpeed ZeRO-{meta['zero_stage']} at world size {meta['world_size']} "
            f"(tp={meta['tp']} x dp={meta['dp']}) but this launch has world size {world_size} (dp={world_size // tp}): "
            "ZeRO's optimizer state is partitioned over dp and DeepSpeed cannot repartition it, so resume "
            f"on {meta['world_size']} ranks (--nproc {meta['world_size']}, srun -n {meta['world_size']})")
    if "config_yaml" in meta:
        check_resume(meta["config_yaml"], cfg, str(latest))
    return latest, meta


def _zero_files(eng: Engine, path: Path) -> list[Path]:
    """The DeepSpeed ZeRO files this rank's load_checkpoint reads (DeepSpeed prefixes the optimizer
    partition's name with `bf16_` in a bf16 run, whichever of its optimizers wrote it)."""
    zero, pg = path / "deepspeed" / "zero", eng.pg
    optim = f"zero_pp_rank_{pg.dp_rank}_mp_rank_{pg.tp_rank:02d}_optim_states.pt"
    saved = zero / (("bf16_" if eng.cfg.precision.precision == "bf16" else "") + optim)  # named when missing
    return [zero / f"mp_rank_{pg.tp_rank:02d}_model_states.pt", next(iter(zero.glob(f"*{optim}")), saved)]


def _probe_zip(path: Path) -> None:
    """A CheckpointError unless `path` is a whole torch.save archive (its zip directory reads): a
    missing or cut-short ZeRO file, found before DeepSpeed's own load fails on one rank only."""
    import zipfile

    if not path.is_file():
        raise ck._damaged(path, FileNotFoundError("missing"))
    try:
        with zipfile.ZipFile(path):
            pass
    except (OSError, zipfile.BadZipFile) as err:
        raise ck._damaged(path, err) from None


def _rng_file(path: Path, pg: ProcessGroups) -> Path:
    rng_file = path / f"rng_rank{pg.rank:05d}.pt"
    if not rng_file.exists():  # a different DP size: take the same TP rank's state
        rng_file = path / f"rng_rank{pg.tp_rank:05d}.pt"
    return rng_file


def _read_shards(eng: Engine, path: Path) -> tuple[dict, dict | None, dict]:
    """This rank's model and (plain trainer) optimizer files, each read once per DP group, its RNG
    states, and (ZeRO) a check that DeepSpeed's files for this rank are there and whole."""
    pg = eng.pg
    model_state = ck.load_replicated(path / f"model_tp{pg.tp_rank:02d}.pt", pg, eng.device)
    extra = None if eng.deepspeed else ck.load_replicated(path / f"optim_tp{pg.tp_rank:02d}.pt", pg, eng.device)
    if eng.deepspeed:
        for file in _zero_files(eng, path):
            _probe_zip(file)
    return model_state, extra, ck.load_file(_rng_file(path, pg))


def _read_shards_everywhere(eng: Engine, path: Path) -> tuple[dict, dict | None, dict]:
    """`_read_shards` on every rank, or a CheckpointError on every rank: a damaged shard of one TP
    rank stops the whole job here, not with the other TP ranks waiting in the first all-reduce."""
    try:
        shards, failure = _read_shards(eng, path), None
    except ck.CheckpointError as err:
        shards, failure = None, err
    group = eng.pg.world_group
    if group is None:
        if failure:
            raise failure
        return shards
    flag = torch.tensor(float(failure is not None), device=eng.device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    if flag.item():  # every rank raises the first failing rank's error, which names the file
        messages: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(messages, str(failure) if failure else None, group=group)
        raise failure or ck.CheckpointError(next(m for m in messages if m))
    return shards


def load(eng: Engine, path: Path) -> tuple[TrainState, dict]:
    """Restore model, optimizer, schedule, scaler and data position; RNG states go in meta["rng"]."""
    meta = ck.read_meta(path)
    model_state, extra, rng = _read_shards_everywhere(eng, path)
    ck.check_rng_device(rng, eng.rng, eng.device, path)  # before any state changes, as a damaged file
    if eng.masters is not None:
        eng.masters.load_state_dict(eng.model, model_state)
    else:
        eng.model.load_state_dict(model_state)
    if eng.deepspeed:
        try:
            eng.wrapped.load_checkpoint(str(path / "deepspeed"), tag="zero")
        except Exception as err:  # the files were probed whole; what DeepSpeed still refuses, named
            raise ck._damaged(path / "deepspeed" / "zero", err) from None
    else:
        eng.optimizer.load_state_dict(extra["optimizer"])
        eng.scheduler.load_state_dict(extra["scheduler"])
        if eng.scaler and extra["scaler"]:
            eng.scaler.load_state_dict(extra["scaler"])
    if eng.cfg.optim.override_schedule:  # the peak lr from this config, not the checkpoint's
        eng.scheduler.base_lrs = [eng.cfg.optim.lr] * len(eng.scheduler.base_lrs)
    resync_lr(eng.scheduler)  # the schedule may have changed with train.train_iters
    meta["rng"] = rng  # restored just before the first step (setup draws too)
    return TrainState(meta["iteration"], meta["consumed_samples"], saved_at=meta["iteration"]), meta


def optimizer_state_bytes(eng: Engine) -> int:
    """Bytes of optimizer state (Adam moments) held by this rank; ZeRO's partition only."""
    opt = eng.optimizer.optimizer if eng.deepspeed else eng.optimizer
    return sum(t.numel() * t.element_size() for st in opt.state.values()
               for t in st.values() if torch.is_tensor(t) and t.ndim > 0)
