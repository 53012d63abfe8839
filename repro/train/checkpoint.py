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
import errno
import json
import os
import re
import shutil
import warnings
import zipfile
from pathlib import Path

import torch
import torch.distributed as dist

from repro.models.config import ModelConfig
from repro.parallel.groups import ProcessGroups
from repro.provenance import write_atomic

FORMAT_VERSION = 1
ZIP_MAGIC = b"PK\x03\x04"  # how every torch.save archive (the zip format, torch >= 1.6) begins
MODEL_FIELDS = frozenset(f.name for f in dataclasses.fields(ModelConfig))
POINTER_NAME = re.compile(r"iter_[0-9]{7,}")
"""What `latest` holds: iter_name's form (7 digits, more past iteration 9,999,999)."""
FAMILIES = ("gpt", "bert")
"""meta.json's `family` values (a checkpoint without one is a GPT's)."""


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


def finish_save(root: Path, iteration: int, pg: ProcessGroups, keep: int = 0) -> Path:
    """Rename the finished temporary directory into place, then point `latest` at it; with `keep`,
    remove all but the `keep` newest checkpoints (prune_checkpoints).

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
        prune_checkpoints(root, keep, final)
    _barrier(pg)
    return final


def prune_checkpoints(root: Path, keep: int, newest: Path) -> list[Path]:
    """With keep > 0, remove the complete checkpoints under `root` before `newest` (the one `latest`
    names now) but the keep - 1 latest of them; returns what was removed (one that cannot be is left,
    with a warning). Those past `newest` (left by a launch whose `latest` was pointed back to an
    earlier one) are not counted nor removed. Each is renamed to iter_*.old first, so a kill while it
    is deleted leaves no partial checkpoint a resume or eval could take (the next save's
    remove_unfinished finishes the job). An eval or fine-tune still reading a removed one fails: point
    those at `latest`, or keep more."""
    if keep <= 0:
        return []
    at = int(newest.name[5:])
    before = [p for p in _complete_iterations(root) if int(p.name[5:]) < at]
    removed = []
    for path in before[:max(len(before) - (keep - 1), 0)]:
        aside = path.with_name(f"{path.name}.old")
        try:
            shutil.rmtree(aside, ignore_errors=True)  # (one a kill, or an open file on NFS, left)
            os.replace(path, aside)
        except OSError as err:  # the save is complete: a checkpoint left over never fails the run
            warnings.warn(f"train.keep_checkpoints={keep}: could not remove {path} ({err}); it stays", stacklevel=2)
            continue
        shutil.rmtree(aside, ignore_errors=True)
        removed.append(path)
    return removed


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
    is complete nothing reads them: a resume starts from `latest`); returns what was removed. No other
    job's save can be under way there: `train` holds the run dir's lock (loop.RUN_LOCK)."""
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


def check_rng_device(state: dict[str, torch.Tensor], tracker, device: torch.device, path: Path) -> None:
    """A CheckpointError when checkpoint `path`'s RNG states were saved on another device type: a
    generator state of one type does not fit the other's (a CPU run's tracker state in a GPU run, or a
    GPU run's in a CPU run, which would fail at the first attention dropout at TP > 1). A CUDA default
    state beside a CPU tracker state (a CPU run on a GPU node, saved before the device was checked)
    passes: restore_rng ignores it."""
    if device.type == "cuda" and "cuda" not in state:
        saved, fix = "cpu", "train.device: cpu"
    elif device.type != "cuda" and tracker is not None and "tracker" in state and \
            state["tracker"].numel() != tracker.get_state().numel():
        saved, fix = "cuda", "train.device: cuda, on a GPU node"
    else:
        return
    raise CheckpointError(f"{path} was saved by a run on {saved} and this run is on {device.type}: its RNG "
                          f"states do not fit this device's generators. Fix: resume on the device type it was "
                          f"saved on ({fix}), or train in a new run_dir")


def restore_rng(state: dict[str, torch.Tensor], tracker, device: torch.device) -> None:
    """Restore `rng_state`'s states (check_rng_device has checked they fit `device`); a CUDA state in
    a CPU run's checkpoint is ignored."""
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
    name = read_pointer(pointer)
    path = Path(root) / name
    aside = path.with_name(f"{path.name}.old")
    if not (path / "meta.json").exists() and (aside / "meta.json").exists():
        return aside  # killed between finish_save's two renames: the complete earlier copy
    if not (path / "meta.json").exists():
        raise CheckpointError(f"{pointer} names {name}, which has no meta.json (not a complete checkpoint): "
                              f"{_repoint(pointer)}")
    return path


def read_pointer(pointer: Path) -> str:
    """The checkpoint name a `latest` file holds (what finish_save writes: iter_name's form); a
    CheckpointError naming the complete checkpoints present and the fix for an empty, binary or
    otherwise damaged one (never a path outside the checkpoints root: an empty name is the root itself)."""
    try:
        raw = pointer.read_bytes()
    except OSError as err:
        raise CheckpointError(f"{pointer} cannot be read ({err.strerror or err}): {_repoint(pointer)}") from None
    name = raw.strip().decode("ascii", errors="replace")
    if not POINTER_NAME.fullmatch(name):
        shown = repr(raw[:40]) + ("..." if len(raw) > 40 else "")
        raise CheckpointError(f"{pointer} is damaged: it holds {shown}, not a checkpoint name like "
                              f"{iter_name(0)}: {_repoint(pointer)}")
    return name


def _repoint(pointer: Path) -> str:
    """The complete checkpoints beside `pointer` (newest first) and the command that points it at the
    newest; where there is none, that the run starts again (in a new run_dir, or once `pointer` is gone)."""
    complete = [p.name for p in reversed(_complete_iterations(pointer.parent))]
    if not complete:
        return (f"no complete checkpoint (an iter_XXXXXXX directory with meta.json) is in {pointer.parent}. "
                f"Fix: start again in a new run_dir (or delete the file {pointer} only, to train this run_dir "
                "from iteration 0)")
    return (f"the complete checkpoints there, newest first: {', '.join(complete)}. "
            f"Fix: `echo {complete[0]} > {pointer}`")


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


def _way_back(path: Path) -> str | None:
    """How to go back to the checkpoint before the one (iter_* directory) holding `path`; None without one."""
    ckpt = next((p for p in path.parents if p.name.startswith("iter_")), path.parent)
    earlier = sorted(p.name for p in ckpt.parent.glob("iter_*[0-9]")
                     if p.name < ckpt.name and (p / "meta.json").exists())
    if not earlier:
        return None
    latest = ckpt.parent / "latest"
    return f"use the previous checkpoint {earlier[-1]}: move {ckpt} aside and run `echo {earlier[-1]} > {latest}`"


def error_reason(err: Exception) -> str:
    """An exception's first sentence (torch's load errors run on for lines), else its type's name."""
    text = str(err).strip()
    return text.splitlines()[0].split(". ")[0] if text else type(err).__name__


def _remake(ckpt: Path) -> str | None:
    """How to write model-only checkpoint `ckpt` again: the reshard or import that made it (its meta.json's
    `resharded_from` or `imported_from`); None for a training checkpoint or an unreadable meta.json."""
    try:
        meta = json.loads((ckpt / "meta.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(meta, dict) or not meta.get("model_only"):
        return None
    if meta.get("resharded_from"):
        src = meta["resharded_from"]
        return (f"re-run the reshard that made it (from {src}): `repro checkpoint reshard {src} "
                f"--tp {meta.get('tp')} --out NEW_DIR`")
    if meta.get("imported_from"):
        return (f"re-run the {meta.get('imported_with', 'import')} that made it (from {meta['imported_from']}) "
                "with a new --out")
    return None


def _damaged(path: Path, err: Exception) -> CheckpointError:
    """The error for an unreadable file of a checkpoint (the iter_* directory above it), naming the way
    back: the reshard or import that made a model-only copy, else an earlier checkpoint of the run."""
    fix = (_remake(path.parent) or _way_back(path)
           or "there is no earlier checkpoint to go back to: start again in a new run_dir")
    return CheckpointError(f"checkpoint file {path} is damaged ({error_reason(err)}): {fix}")


def mismatched_file(path: Path, detail: str) -> CheckpointError:
    """The error for a model file whose tensors are not those of the model its meta.json describes."""
    back = _way_back(path)
    return CheckpointError(f"checkpoint file {path} does not hold the model of {path.parent / 'meta.json'} "
                           f"({detail}). Fix: write it again (re-save, or re-run the reshard or import that made "
                           f"it){f', or {back}' if back else ''}")


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
    _check_meta_fields(path, meta)
    return meta


def _check_meta_fields(path: Path, meta: dict) -> None:
    """A CheckpointError unless meta.json's `tp` is a positive integer, its `family` (where given: older
    checkpoints, all GPT, have none) gpt or bert and its `model` (where given) a mapping of ModelConfig's
    fields; fields unknown here come from a newer checkout."""
    tp, model = meta["tp"], meta.get("model", {})
    if type(tp) is not int or tp < 1:
        raise _damaged(path, ValueError(f"`tp` is {tp!r}, not a positive integer"))
    if meta.get("family", "gpt") not in FAMILIES:
        raise CheckpointError(f"{path}: `family` is {meta['family']!r}, not one of {FAMILIES}. Fix: set it to the "
                              "model's family, gpt or bert (lower case), as training writes it")
    if not isinstance(model, dict):
        raise _damaged(path, ValueError(f"`model` is a {type(model).__name__}, not a mapping of model settings"))
    unknown = sorted(set(model) - MODEL_FIELDS)
    if unknown:
        raise CheckpointError(f"{path}: model settings {unknown} are unknown to this checkout: the checkpoint was "
                              "written by a newer checkout of megatron-repro. Fix: update it (git pull) to the "
                              "version that wrote the checkpoint")


def model_config(ckpt: Path, meta: dict, config_type: type[ModelConfig] = ModelConfig) -> ModelConfig:
    """The model that checkpoint `ckpt`'s meta.json (read by read_meta) describes, as `config_type`; a
    CheckpointError naming the file when it describes none."""
    if "model" not in meta:
        raise _damaged(Path(ckpt) / "meta.json", ValueError("no `model`: it describes no model"))
    return config_type(**meta["model"])


def load_file(path: Path, mmap: bool = False) -> dict:
    """torch.load(weights_only=True) with an error naming a missing or damaged file; `mmap` maps the
    tensors' bytes instead of reading them (pages load on first touch, shared by a node's processes)."""
    if not path.exists():
        raise CheckpointError(f"checkpoint file {path} is missing: the checkpoint is incomplete; "
                              "use an earlier one or re-save it")
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except MemoryError:
        raise
    except Exception as err:  # noqa: BLE001 - unpickling damaged bytes raises almost any type (KeyError, IndexError...)
        raise _damaged(path, _load_failure(path, err)) from None


def _load_failure(path: Path, err: Exception) -> Exception:
    """What is wrong with a file torch.load failed on: not a torch.save archive at all (torch's legacy
    reader then fails anywhere in its unpickler), one cut short where the zip reader says only
    `[Errno 22] Invalid argument`, else torch's own error."""
    try:
        with open(path, "rb") as f:
            head = f.read(len(ZIP_MAGIC))
    except OSError:
        return err
    if head != ZIP_MAGIC:
        return ValueError("an empty file" if not head else "not a torch.save zip archive")
    if isinstance(err, OSError) and err.errno == errno.EINVAL and not zipfile.is_zipfile(path):
        return ValueError("a torch.save zip archive cut short")
    return err


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
    unreachable, the one `repro tracking sync` recorded in its run directory afterwards. A model-only copy
    (reshard, import) is not in a run directory: its own id, else its `resharded_from` source's, else None."""
    from repro.tracking.run_dir import recorded_run_id

    path, seen = resolve(ckpt), set()
    while path not in seen:
        seen.add(path)
        meta = read_meta(path)
        if meta.get("mlflow_run_id") or not meta.get("model_only"):
            run_dir = path.parent.parent if path.parent.name == "checkpoints" else path.parent
            return meta.get("mlflow_run_id") or recorded_run_id(run_dir)
        try:
            path = resolve(meta["resharded_from"])
        except (KeyError, CheckpointError, OSError):  # an import, or its source is gone
            return None
    return None


def training_provenance(path: str | Path) -> dict[str, str]:
    """What an evaluation or fine-tuning records of the `repro train` checkpoint it read: its iteration
    and training run id; the source and command of imported weights ({} for another kind of file, e.g.
    a `save_bert` .pt)."""
    try:
        ckpt = resolve(path)
        meta = read_meta(ckpt)
        run_id = None if meta.get("imported_from") else checkpoint_run_id(ckpt)
    except (CheckpointError, OSError):
        return {}
    if meta.get("imported_from"):  # `repro checkpoint import-*` weights: pretrained elsewhere, no training run
        return {"imported_from": meta["imported_from"], "imported_with": meta.get("imported_with", "import-hf")}
    return {k: str(v) for k, v in (("checkpoint_iteration", meta.get("iteration")), ("training_run_id", run_id))
            if v is not None}
