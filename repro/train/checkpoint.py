"""Checkpoints: per-TP-rank model shards, optimizer/ZeRO state, RNG, data position, config.

Layout of `<run_dir>/checkpoints/`::

    iter_0000200/meta.json            iteration, consumed samples, layout, resolved config, git SHA
    iter_0000200/model_tp00.pt        TP rank 0's model shard, fp32 weights (written by DP replica 0 of tp 0)
    iter_0000200/optim_tp00.pt        optimizer, lr scheduler, loss scaler (plain trainer)
    iter_0000200/deepspeed/           DeepSpeed's ZeRO state (when zero_stage > 0)
    iter_0000200/rng_rank00000.pt     CPU/CUDA generator states and the TP-region tracker, per rank
    latest                            the name of the newest complete checkpoint

Every file is written into `iter_XXXXXXX.tmp/`, which is renamed once all ranks are done; `latest`
is replaced last. A crash mid-write leaves the previous checkpoint loadable (and a second save of the
iteration `latest` names keeps the first until the second is in place). Files are read with
`torch.load(weights_only=True)`. The DP replicas hold the same model and optimizer state, so TP rank
t's files are written and read by one replica (t mod dp: the shards of a node-wide TP group move
through different nodes) and broadcast over the DP group on resume (`load_replicated`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import shutil
import warnings
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist

from repro.models.config import ModelConfig
from repro.parallel.groups import ProcessGroups
from repro.parallel.layers import pad_vocab_rows, shard_master, to_empty_keeping_markers, unshard
from repro.provenance import git_sha, write_atomic

FORMAT_VERSION = 1


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be loaded as asked; the message names the file and the fix."""


def iter_name(iteration: int) -> str:
    return f"iter_{iteration:07d}"


def _barrier(pg: ProcessGroups) -> None:
    if pg.world_group is not None:
        dist.barrier(group=pg.world_group)


def begin_save(root: Path, iteration: int, pg: ProcessGroups) -> Path:
    """Create a clean temporary directory for this iteration's checkpoint (all ranks call)."""
    tmp = root / f"{iter_name(iteration)}.tmp"
    if pg.rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    _barrier(pg)
    return tmp


def finish_save(root: Path, iteration: int, pg: ProcessGroups) -> Path:
    """Rename the finished temporary directory into place, then point `latest` at it.

    An older copy of the same iteration (which `latest` may name) is renamed aside, not deleted,
    until the new one is in place and `latest` rewritten: a kill at any point leaves a complete copy
    (`latest_checkpoint` reads the one set aside when killed between the two renames)."""
    _barrier(pg)
    name = iter_name(iteration)
    final, old = root / name, root / f"{name}.old"
    if pg.rank == 0:
        shutil.rmtree(old, ignore_errors=True)  # left by a kill after the rename below
        fsync_tree(root / f"{name}.tmp")  # on disk before `latest` can name it
        if final.exists():
            os.replace(final, old)
        os.replace(root / f"{name}.tmp", final)
        _fsync_dir(root)
        write_atomic(root / "latest", name.encode())
        _fsync_dir(root)
        shutil.rmtree(old, ignore_errors=True)
        remove_unfinished(root)
    _barrier(pg)
    return final


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """fsync every file under `root`, then every directory, deepest first: a power loss after the
    rename that publishes it cannot leave a named checkpoint with missing data."""
    paths = sorted(Path(root).rglob("*"), key=lambda p: len(p.parts), reverse=True)
    for path in paths:
        if path.is_file() and not path.is_symlink():
            with open(path, "rb") as f:
                os.fsync(f.fileno())
    for path in [*(p for p in paths if p.is_dir() and not p.is_symlink()), Path(root)]:
        _fsync_dir(path)


def remove_unfinished(root: Path) -> list[Path]:
    """Remove the iter_*.tmp and iter_*.old directories a kill left under `root` (once a newer save
    is complete nothing reads them: a resume starts from `latest`); returns what was removed."""
    stale = [p for p in Path(root).glob("iter_*") if p.is_dir() and p.suffix in (".tmp", ".old")]
    for path in stale:
        shutil.rmtree(path, ignore_errors=True)
    return stale


def rng_state(tracker, device: torch.device) -> dict[str, torch.Tensor]:
    """The generator states a resume restores: CPU, this rank's GPU (the run's device, not GPU 0, and
    no CUDA context for a CPU run on a GPU node), the TP-region tracker."""
    state = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    if tracker is not None:
        state["tracker"] = tracker.get_state()
    return state


def restore_rng(state: dict[str, torch.Tensor], tracker, device: torch.device) -> None:
    """Restore `rng_state`'s states. A CPU run's states in a GPU run are a CheckpointError (the
    tracker's CPU generator state does not fit a CUDA generator); a CUDA state in a CPU run's
    checkpoint (saved on a GPU node before the device was checked) is ignored."""
    if device.type == "cuda" and "cuda" not in state:
        raise CheckpointError("the checkpoint's RNG states come from a CPU run, and this run is on cuda: a run "
                              "resumes on the device type it was saved on (train.device)")
    torch.set_rng_state(state["cpu"])
    if device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"], device)
    if tracker is not None and "tracker" in state:
        tracker.set_state(state["tracker"])


def _complete_iterations(root: Path) -> list[Path]:
    """The iter_XXXXXXX directories under `root` that finish_save renamed into place (oldest first)."""
    found = [p for p in Path(root).glob("iter_*") if p.name[5:].isdigit() and (p / "meta.json").is_file()]
    return sorted(found, key=lambda p: int(p.name[5:]))


def latest_checkpoint(root: Path) -> Path | None:
    """The newest complete checkpoint under `root`, or None. Without a `latest` pointer but with
    complete iter_* directories (a kill between the first save's rename and its pointer, or a copy of
    the iter_* directories only) it is the newest of them, with a warning: never a restart from 0 that
    would overwrite them."""
    pointer = Path(root) / "latest"
    if not pointer.exists():
        complete = _complete_iterations(root)
        if complete:
            warnings.warn(f"{pointer} is missing but {complete[-1]} is a complete checkpoint: resuming from it "
                          f"(rewrite {pointer} to name another, or train in a new run_dir to start over)",
                          stacklevel=2)
            return complete[-1]
        return None
    path = Path(root) / pointer.read_text().strip()
    aside = path.with_name(f"{path.name}.old")
    if not (path / "meta.json").exists() and (aside / "meta.json").exists():
        return aside  # killed between finish_save's two renames: the complete earlier copy
    if not (path / "meta.json").exists():
        raise CheckpointError(f"{pointer} names {path.name}, which has no meta.json: remove the "
                              "broken directory and point `latest` at an earlier one")
    return path


def resolve(path: str | Path) -> Path:
    """A checkpoint directory from itself, a checkpoints root, a run directory, or the `latest`
    pointer file of a checkpoints root."""
    path = Path(path)
    if path.name == "latest" and path.is_file():
        path = path.parent
    for candidate in (path, path / "checkpoints"):
        if (candidate / "meta.json").exists():
            return candidate
        found = latest_checkpoint(candidate) if (candidate / "latest").exists() else None
        if found:
            return found
    raise CheckpointError(f"no checkpoint at {path}: give a run directory, its checkpoints/ folder, "
                          "or an iter_XXXXXXX directory with meta.json")


def _damaged(path: Path, err: Exception) -> CheckpointError:
    """The error for an unreadable file of a checkpoint (the iter_* directory above it), naming the way back."""
    ckpt = next((p for p in path.parents if p.name.startswith("iter_")), path.parent)
    latest = ckpt.parent / "latest"
    earlier = sorted(p.name for p in ckpt.parent.glob("iter_*[0-9]")
                     if p.name < ckpt.name and (p / "meta.json").exists())
    fix = (f"use the previous checkpoint {earlier[-1]}: move {ckpt} aside and run "
           f"`echo {earlier[-1]} > {latest}`" if earlier else
           "there is no earlier checkpoint to go back to: start again in a new run_dir")
    reason = str(err).strip().splitlines()[0].split(". ")[0] if str(err).strip() else type(err).__name__
    return CheckpointError(f"checkpoint file {path} is damaged ({reason}): {fix}")


def read_meta(ckpt: Path) -> dict:
    """meta.json of a checkpoint directory (CheckpointError when missing or damaged)."""
    path = Path(ckpt) / "meta.json"
    try:
        meta = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint file {path} is missing: give an iter_XXXXXXX directory "
                              "with meta.json, or a run directory") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise _damaged(path, err) from None
    if not isinstance(meta, dict) or "tp" not in meta:
        raise _damaged(path, ValueError("not a checkpoint meta.json: no `tp`"))
    if not isinstance(meta.get("format", FORMAT_VERSION), int) or meta.get("format", FORMAT_VERSION) > FORMAT_VERSION:
        raise CheckpointError(f"{path}: checkpoint format {meta.get('format')!r} is newer than this checkout reads "
                              f"(up to {FORMAT_VERSION}). Fix: update megatron-repro (git pull) to the version "
                              "that wrote it")
    return meta


def load_file(path: Path) -> dict:
    """torch.load(weights_only=True) with an error naming a missing or damaged file."""
    if not path.exists():
        raise CheckpointError(f"checkpoint file {path} is missing: the checkpoint is incomplete; "
                              "use an earlier one or re-save it")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except (RuntimeError, EOFError, OSError, pickle.UnpicklingError) as err:
        raise _damaged(path, err) from None


def shard_owner(pg: ProcessGroups) -> int:
    """The DP rank that writes and reads this TP rank's model and optimizer files."""
    return pg.tp_rank % pg.dp_size


class _TensorSlot(int):
    """Where a tensor was in a broadcast state's skeleton (the position in its tensor list)."""


def _same_mapping(obj: dict, items) -> dict:
    """A dict of `obj`'s type (an OrderedDict state dict keeps its `_metadata`) holding `items`."""
    out = type(obj)(items)
    if hasattr(obj, "_metadata"):
        out._metadata = obj._metadata
    return out


def _split_tensors(obj, tensors: list):
    if torch.is_tensor(obj):
        tensors.append(obj.contiguous())  # broadcast sends the storage: a view must be made whole
        return _TensorSlot(len(tensors) - 1)
    if isinstance(obj, dict):
        return _same_mapping(obj, ((k, _split_tensors(v, tensors)) for k, v in obj.items()))
    if isinstance(obj, (list, tuple)):
        return type(obj)(_split_tensors(v, tensors) for v in obj)
    return obj


def _fill_tensors(obj, tensors: list):
    if isinstance(obj, _TensorSlot):
        return tensors[obj]
    if isinstance(obj, dict):
        return _same_mapping(obj, ((k, _fill_tensors(v, tensors)) for k, v in obj.items()))
    if isinstance(obj, (list, tuple)):
        return type(obj)(_fill_tensors(v, tensors) for v in obj)
    return obj


def load_replicated(path: Path, pg: ProcessGroups, device: torch.device) -> dict:
    """A TP shard's file, read by its owner replica only and broadcast over the DP group (on CPU in
    the end, like `load_file`): a resume reads each file once instead of dp times. All DP ranks
    call it; a missing or damaged file raises the same CheckpointError on every one of them."""
    if pg.dp_size == 1:
        return load_file(path)
    owner = shard_owner(pg)
    src = dist.get_global_rank(pg.dp_group, owner)
    header: list = [None]
    if pg.dp_rank == owner:
        try:
            tensors: list = []
            skeleton = _split_tensors(load_file(path), tensors)
            header = [(skeleton, [(t.shape, t.dtype) for t in tensors], None)]
        except Exception as err:  # noqa: BLE001 - every peer must hear of it, or it waits in the broadcast
            header = [(None, [], str(err) if isinstance(err, CheckpointError) else f"{path}: {err!r}")]
    dist.broadcast_object_list(header, src=src, group=pg.dp_group, device=device)
    skeleton, specs, error = header[0]
    if error:
        raise CheckpointError(error)
    received = []
    for i, (shape, dtype) in enumerate(specs):
        buf = tensors[i].to(device) if pg.dp_rank == owner else torch.empty(shape, dtype=dtype, device=device)
        dist.broadcast(buf, src=src, group=pg.dp_group)
        if device.type == "cuda":  # one tensor at a time on the device, on the owner too
            torch.cuda.current_stream(device).synchronize()
        received.append(tensors[i] if pg.dp_rank == owner else buf.cpu())
    return _fill_tensors(skeleton, received)


def checkpoint_run_id(ckpt: str | Path) -> str | None:
    """The MLflow run id of the training run that wrote the checkpoint; for a run trained while MLflow was
    unreachable, the one `repro tracking sync` recorded in its run directory afterwards."""
    from repro.tracking.logger import recorded_run_id

    path = resolve(ckpt)
    run_dir = path.parent.parent if path.parent.name == "checkpoints" else path.parent
    return read_meta(path).get("mlflow_run_id") or recorded_run_id(run_dir)


def training_provenance(path: str | Path) -> dict[str, str]:
    """What an evaluation or fine-tuning records of the `repro train` checkpoint it read: its iteration
    and training run id ({} for another kind of file, e.g. a `save_bert` .pt)."""
    try:
        ckpt = resolve(path)
        iteration, run_id = read_meta(ckpt).get("iteration"), checkpoint_run_id(ckpt)
    except (CheckpointError, OSError):
        return {}
    return {k: str(v) for k, v in (("checkpoint_iteration", iteration), ("training_run_id", run_id)) if v is not None}


# ---- resharding -------------------------------------------------------------------------------

def partition_spec(cfg: ModelConfig, family: str = "gpt") -> dict[str, tuple[int, int]]:
    """name -> (partition_dim, stride) of every TP-sharded parameter (from a meta-device model)."""
    with torch.device("meta"):
        model = _build(cfg, family)
    return {n: (p.partition_dim, p.partition_stride)
            for n, p in model.named_parameters() if getattr(p, "tensor_model_parallel", False)}


def _build(cfg: ModelConfig, family: str, **kwargs):
    if family == "bert":
        from repro.models.bert import BERT

        return BERT(cfg, **kwargs)
    from repro.models.gpt import GPT

    return GPT(cfg, **kwargs)


VOCAB_ROWS = ("transformer.wte.weight", "embeddings.word.weight", "lm_head.bias")  # padded along dim 0


def _is_vocab(name: str) -> bool:
    return name in VOCAB_ROWS


def merge_shards(shards: list[dict], spec: dict[str, tuple[int, int]], vocab_size: int) -> dict:
    """Full (TP=1, unpadded-vocab) tensors from every TP rank's state dict."""
    full = {}
    for name, first in shards[0].items():
        if name in spec:
            dim, stride = spec[name]
            first = unshard([s[name] for s in shards], dim, stride)
        full[name] = first[:vocab_size] if _is_vocab(name) else first
    return full


def shard_state(full: dict, spec: dict[str, tuple[int, int]], rank: int, tp: int, padded_vocab: int) -> dict:
    """TP rank `rank`'s state dict from full tensors (vocab padded with zero rows)."""
    shard = {}
    for name, tensor in full.items():
        if _is_vocab(name):
            tensor = pad_vocab_rows(tensor, padded_vocab)
        if name in spec:
            dim, stride = spec[name]
            tensor = shard_master(tensor, dim, rank, tp, stride)
        shard[name] = tensor.clone()
    return shard


def load_full_model_state(ckpt: Path) -> tuple[dict, dict]:
    """(meta, TP=1 state dict with the unpadded vocab) of a checkpoint of any TP degree."""
    meta = read_meta(ckpt)
    cfg = ModelConfig(**meta["model"])
    shards = [load_file(ckpt / f"model_tp{r:02d}.pt") for r in range(meta["tp"])]
    return meta, merge_shards(shards, partition_spec(cfg, meta.get("family", "gpt")), cfg.vocab_size)


def _check_new_dir(dst: Path) -> None:
    """Refuse an output directory that holds anything (a run, a checkpoint, user files)."""
    if dst.is_dir() and not any(dst.iterdir()):
        return
    if dst.exists():
        raise CheckpointError(f"--out {dst} already exists: choose a new directory (nothing was written)")


@contextmanager
def new_directory(dst: Path):
    """Yield a temporary sibling of the new (absent or empty) directory `dst`; rename it into place
    when the block completes, remove it when the block fails. An occupied `dst` is refused."""
    _check_new_dir(dst)
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(f".{dst.name}.{os.getpid()}.tmp")
    tmp.mkdir()
    try:
        yield tmp
        _check_new_dir(dst)  # nothing appeared meanwhile
        os.replace(tmp, dst)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def reshard(src: str | Path, dst: str | Path, tp: int) -> Path:
    """Write a model-only copy of checkpoint `src` at TP degree `tp` (outputs unchanged) into the
    new directory `dst`, built in a temporary sibling and renamed into place when complete."""
    dst = Path(dst)
    _check_new_dir(dst)  # before the (long) load; new_directory checks again before the rename
    src = resolve(src)
    meta = read_meta(src)
    cfg = ModelConfig(**meta["model"])
    cfg.validate(tp)
    _, full = load_full_model_state(src)
    with new_directory(dst) as tmp:
        _write_model_only(tmp, full, cfg, {**meta, "resharded_from": str(src)}, tp)
    return dst


def _write_model_only(tmp: Path, full: dict, cfg: ModelConfig, meta: dict, tp: int) -> None:
    """Shard full (TP=1, unpadded-vocab) tensors over `tp` ranks into `tmp`, with a model-only meta.json."""
    spec = partition_spec(cfg, meta.get("family", "gpt"))
    for rank in range(tp):
        torch.save(shard_state(full, spec, rank, tp, cfg.padded_vocab_size(tp)), tmp / f"model_tp{rank:02d}.pt")
    meta = {**meta, "tp": tp, "dp": 1, "world_size": tp, "model_only": True}
    write_atomic(tmp / "meta.json", json.dumps(meta, indent=1).encode())


def import_hf(source: str, dst: str | Path, tp: int = 1, make_vocab_size_divisible_by: int = 1024) -> Path:
    """Write a transformers GPT2LMHeadModel (a save_pretrained directory, or a hub name where the hub
    is reachable) as a model-only GPT checkpoint at TP degree `tp` into the new directory `dst`."""
    from transformers import GPT2Config

    from repro.models.hf import config_from_hf

    dst = Path(dst)
    _check_new_dir(dst)
    try:
        cfg = config_from_hf(GPT2Config.from_pretrained(source), make_vocab_size_divisible_by)
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{source}: cannot import ({str(err).strip().splitlines()[0]})") from None
    cfg.validate(tp)
    full = _hf_weights(source)
    meta = {"format": FORMAT_VERSION, "family": "gpt", "iteration": 0, "consumed_samples": 0, "zero_stage": 0,
            "model": dataclasses.asdict(cfg), "git_sha": git_sha(),
            "imported_from": str(Path(source).resolve()) if Path(source).exists() else str(source)}
    with new_directory(dst) as tmp:
        _write_model_only(tmp, full, cfg, meta, tp)
    return dst


def _hf_weights(source: str) -> dict:
    """Our TP=1 state dict of a GPT2LMHeadModel; a CheckpointError for unreadable or missing weights
    (transformers would fill missing ones with random values and only warn)."""
    from safetensors import SafetensorError
    from transformers import GPT2LMHeadModel

    from repro.models.hf import from_hf_state_dict

    try:
        hf, info = GPT2LMHeadModel.from_pretrained(source, output_loading_info=True)
        missing = [k for k in info.get("missing_keys", []) if not k.endswith((".attn.bias", ".attn.masked_bias"))]
        wrong = [str(k) for k in info.get("mismatched_keys", [])]
        if missing or wrong:
            raise ValueError(f"weights missing {missing[:5]} or of the wrong shape {wrong[:5]}")
        return from_hf_state_dict(hf.state_dict())
    except (OSError, ValueError, RuntimeError, SafetensorError) as err:
        raise CheckpointError(f"{source}: cannot import ({str(err).strip().splitlines()[0]})") from None


def load_model_for_eval(ckpt: str | Path, pg: ProcessGroups, device="cpu"):
    """The checkpoint's model at this world's TP degree (resharded in memory if it differs)."""
    ckpt = resolve(ckpt)
    meta = read_meta(ckpt)
    cfg = ModelConfig(**meta["model"])
    cfg.validate(pg.tp_size)
    if meta["tp"] == pg.tp_size:
        state = load_file(ckpt / f"model_tp{pg.tp_rank:02d}.pt")
    else:
        _, full = load_full_model_state(ckpt)
        spec = partition_spec(cfg, meta.get("family", "gpt"))
        state = shard_state(full, spec, pg.tp_rank, pg.tp_size, cfg.padded_vocab_size(pg.tp_size))
    with torch.device("meta"):
        model = _build(cfg, meta.get("family", "gpt"), tp_group=pg.tp_group)
    model = to_empty_keeping_markers(model, device)  # grad norm, ZeRO and resharding read the TP markers
    model.load_state_dict(state)
    return model.eval()
