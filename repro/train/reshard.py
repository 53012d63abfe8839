"""A checkpoint's model at another TP degree: merge the TP shards into full tensors and split them
again, on disk (`repro checkpoint reshard`, `import-hf`) or in memory (`load_model_for_eval`).

    reshard("runs/gpt/checkpoints", "runs/gpt_tp1", tp=1)      # model-only copy, atomically placed
    model = load_model_for_eval(ckpt, pg)                      # at pg's TP, whatever the saved TP
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import pickle
import re
import shutil
import socket
from contextlib import contextmanager
from pathlib import Path
from typing import Iterable, Mapping

import torch

from repro.models.config import ModelConfig
from repro.parallel.groups import ProcessGroups
from repro.parallel.layers import pad_vocab_rows, shard_master, to_empty_keeping_markers, unshard
from repro.provenance import git_sha, save_torch, unwritable_ancestor, write_atomic
from repro.train.checkpoint import (FORMAT_VERSION, CheckpointError, checkpoint_run_id, fsync_tree, load_file,
                                    mismatched_file, model_config, read_meta, resolve)


def partition_spec(cfg: ModelConfig, family: str = "gpt") -> dict[str, tuple[int, int]]:
    """name -> (partition_dim, stride) of every TP-sharded parameter (from a meta-device model)."""
    return _spec_of(_meta_model(cfg, family))


def _meta_model(cfg: ModelConfig, family: str):
    with torch.device("meta"):
        return _build(cfg, family)


def _spec_of(model) -> dict[str, tuple[int, int]]:
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


def shard_shapes(model, cfg: ModelConfig, tp: int) -> dict[str, torch.Size]:
    """name -> shape of every tensor in a TP=`tp` rank's model file of meta-device `model` (shard_state's)."""
    cfg.validate(tp)
    full = {n: t[:cfg.vocab_size] if _is_vocab(n) else t for n, t in model.state_dict().items()}
    return {n: t.shape for n, t in shard_state(full, _spec_of(model), 0, tp, cfg.padded_vocab_size(tp)).items()}


def check_shard(path: Path, state: Mapping, expected: Mapping[str, torch.Size]) -> None:
    """CheckpointError unless model file `path` (read as `state`) holds exactly `expected`'s tensors and shapes."""
    if not isinstance(state, Mapping):
        raise mismatched_file(path, f"it holds a {type(state).__name__}, not a state dict of named tensors")
    missing, extra = sorted(expected.keys() - state.keys()), sorted(state.keys() - expected.keys(), key=str)
    wrong = [f"{n} is {_shape_of(state[n])}, not {tuple(s)}" for n, s in expected.items()
             if n in state and (not torch.is_tensor(state[n]) or state[n].shape != s)]
    problems = [f"lacks {missing[:3]} ({len(missing)} in all)"] if missing else []
    problems += [f"has unexpected {extra[:3]} ({len(extra)} in all)"] if extra else []
    problems += wrong[:3] + ([f"{len(wrong)} of the wrong shape in all"] if len(wrong) > 3 else [])
    if problems:
        raise mismatched_file(path, "; ".join(problems))


def _shape_of(value) -> str:
    """A state dict entry's shape, or what it is instead of a tensor."""
    return str(tuple(value.shape)) if torch.is_tensor(value) else f"a {type(value).__name__}"


def _model_shards(ckpt: Path, meta: dict, model, mmap: bool = False) -> list[dict]:
    """Every TP rank's model file, each checked against meta-device `model` (meta.json's) at the saved TP."""
    expected = shard_shapes(model, model_config(ckpt, meta), meta["tp"])
    shards = []
    for rank in range(meta["tp"]):
        path = ckpt / f"model_tp{rank:02d}.pt"
        shards.append(load_file(path, mmap=mmap))
        check_shard(path, shards[-1], expected)
    return shards


class MergedModelState(Mapping):
    """A checkpoint's TP=1 state dict (unpadded vocab), each tensor merged from the memory-mapped TP
    shards when it is read: going through it holds one full tensor at a time, not the whole model.
    Shards that do not fit meta.json's model are a CheckpointError naming the file."""

    def __init__(self, ckpt: Path, meta: dict) -> None:
        cfg = model_config(ckpt, meta)
        model = _meta_model(cfg, meta.get("family", "gpt"))
        self.spec, self.vocab_size = _spec_of(model), cfg.vocab_size
        self.shards = _model_shards(ckpt, meta, model, mmap=True)

    def __getitem__(self, name: str) -> torch.Tensor:
        return merge_shards([{name: s[name]} for s in self.shards], self.spec, self.vocab_size)[name]

    def __contains__(self, name: object) -> bool:  # without merging the tensor (Mapping's default reads it)
        return name in self.shards[0]

    def __iter__(self):
        return iter(self.shards[0])

    def __len__(self) -> int:
        return len(self.shards[0])


def resharded_state(ckpt: Path, meta: dict, rank: int, tp: int, padded_vocab: int | None = None) -> dict:
    """TP rank `rank`'s state dict at degree `tp` from checkpoint `ckpt` saved at any TP degree, built
    one tensor at a time from memory-mapped shards: besides the result, at most one full tensor is in
    memory, two for the vocabulary rows (merged, then padded). An 8.3B model's ranks each hold their
    slice, not the 33 GB fp32 model; the price is merging every tensor again for each rank.
    `padded_vocab`: the vocabulary rows to pad to, when not this project's (Megatron-LM's, say)."""
    merged = MergedModelState(ckpt, meta)
    padded_vocab = padded_vocab or model_config(ckpt, meta).padded_vocab_size(tp)
    state = {}
    for name, full in merged.items():
        state.update(shard_state({name: full}, merged.spec, rank, tp, padded_vocab))
    return state


def load_full_model_state(ckpt: Path) -> tuple[dict, dict]:
    """(meta, TP=1 state dict with the unpadded vocab) of a checkpoint of any TP degree. Merged tensors
    are in memory; the others (layer norms, biases of row-parallel layers: one copy on every rank) are
    the shard file's private memory map: writing to one changes this copy only, never the file."""
    meta = read_meta(ckpt)
    return meta, dict(MergedModelState(ckpt, meta))


def _check_new_dir(dst: Path) -> None:
    """Refuse an output directory that holds anything (a run, a checkpoint, user files), that names no
    directory of its own (`.`), that lies under a file, or that this process cannot create."""
    if dst.name in ("", ".", ".."):
        raise CheckpointError(f"--out {dst} names no new directory: give the path of one to create, "
                              "e.g. --out runs/gpt_tp1 (nothing was written)")
    blocking = next((p for p in dst.parents if p.exists() and not p.is_dir()), None)
    if blocking is not None:
        raise CheckpointError(f"--out {dst}: {blocking} is a file, not a directory: choose an --out whose "
                              "parents are directories (nothing was written)")
    if dst.exists() and not (dst.is_dir() and not any(dst.iterdir())):
        raise CheckpointError(f"--out {dst} already exists: choose a new directory (nothing was written)")
    blocked = unwritable_ancestor(dst)
    if blocked is not None:
        raise CheckpointError(f"--out {dst}: {blocked} is not writable. Fix: give a writable path "
                              "(nothing was written)")


@contextmanager
def new_directory(dst: Path):
    """Yield a temporary sibling of the new (absent or empty) directory `dst`; rename it into place
    when the block completes, remove it when the block fails. An occupied `dst` is refused."""
    _check_new_dir(dst)
    tmp = _tmp_sibling(dst, os.getpid())
    try:
        dst.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_siblings(dst)
        tmp.mkdir()
    except OSError as err:
        raise CheckpointError(f"--out {dst}: cannot create {err.filename or tmp} ({err.strerror or err}). "
                              "Fix: give a writable path (nothing was written)") from None
    try:
        yield tmp
        _check_new_dir(dst)  # nothing appeared meanwhile
        fsync_tree(tmp)  # on disk before its name says it is complete, as a training checkpoint
        os.replace(tmp, dst)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _tmp_sibling(dst: Path, pid: int) -> Path:
    """The temporary sibling that process `pid` of this host builds `dst` in."""
    return dst.with_name(f".{dst.name}.{socket.gethostname()}.{pid}.tmp")


def remove_stale_siblings(dst: Path) -> list[Path]:
    """Remove the temporary siblings of `dst` left by killed processes of this host (their pid is
    gone; another host's are left alone); returns what was removed."""
    prefix = _tmp_sibling(dst, 0).name[:-len("0.tmp")]
    stale = [p for p in dst.parent.glob(glob.escape(prefix) + "*.tmp")
             if p.name[len(prefix):-4].isdigit() and not _running(int(p.name[len(prefix):-4]))]
    for path in stale:
        shutil.rmtree(path, ignore_errors=True)
    return stale


def _running(pid: int) -> bool:
    """Another live process of this host has this pid (this process's own is not yet in use)."""
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        return True
    return True


def reshard(src: str | Path, dst: str | Path, tp: int) -> Path:
    """Write a model-only copy of checkpoint `src` at TP degree `tp` (outputs unchanged) into the
    new directory `dst`, built in a temporary sibling and renamed into place when complete. It is
    credited to the training run of `src` (its MLflow run id, resolved now)."""
    dst = Path(dst)
    _check_new_dir(dst)  # before the (long) load; new_directory checks again before the rename
    src = resolve(src)
    meta = read_meta(src)
    cfg = model_config(src, meta)
    cfg.validate(tp)
    with new_directory(dst) as tmp:  # one output shard in memory at a time
        shards = (resharded_state(src, meta, rank, tp) for rank in range(tp))
        provenance = {"resharded_from": str(src), "mlflow_run_id": checkpoint_run_id(src)}
        _write_model_only(tmp, shards, {**meta, **provenance}, tp)
    return dst


def _write_model_only(tmp: Path, shards: Iterable[dict], meta: dict, tp: int) -> None:
    """Save the `tp` ranks' state dicts (made one by one by `shards`) into `tmp`, with a model-only meta.json."""
    for rank, state in enumerate(shards):
        save_torch(state, tmp / f"model_tp{rank:02d}.pt")  # a full disk: OSError, the command's clear error
        del state
    meta = {**meta, "tp": tp, "dp": 1, "world_size": tp, "model_only": True}
    write_atomic(tmp / "meta.json", json.dumps(meta, indent=1).encode())


def import_hf(source: str, dst: str | Path, tp: int = 1, make_vocab_size_divisible_by: int = 1024) -> Path:
    """Write a transformers GPT2LMHeadModel (a save_pretrained directory, or a hub name: from the local
    cache when it is there, else from the hub) as a model-only GPT checkpoint at TP degree `tp` into
    the new directory `dst`."""
    from transformers import GPT2Config

    from repro.models.hf import config_from_hf

    dst = Path(dst)
    _check_new_dir(dst)
    options = _hf_source_options(source)
    try:
        cfg = config_from_hf(GPT2Config.from_pretrained(source, **options), make_vocab_size_divisible_by)
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{source}: cannot import ({str(err).strip().splitlines()[0]})") from None
    cfg.validate(tp)
    imported_from = str(Path(source).resolve()) if Path(source).exists() else str(source)
    return _write_imported(_hf_weights(source, options), cfg, dst, tp, {"imported_from": imported_from,
                                                                         "imported_with": "import-hf"})


HUB_NAME = re.compile(r"[\w.-]+(/[\w.-]+)?")  # gpt2-medium, openai-community/gpt2
_SAVE_PRETRAINED = "give the directory transformers' save_pretrained wrote (with config.json)"


def _hf_source_options(source: str) -> dict:
    """from_pretrained's options for `source`, once it is known to name a model: a local directory
    must hold config.json; a name that looks like a local path must be a directory; a hub name loads
    from the local cache where it is there (no network), else from the hub, which must be reachable.
    A CheckpointError names the problem otherwise (before transformers' defaults or retries)."""
    path = Path(source)
    if path.is_file():
        raise CheckpointError(f"{source} is a file: {_SAVE_PRETRAINED}")
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise CheckpointError(f"{source} holds no config.json: {_SAVE_PRETRAINED}")
        return {}
    if _looks_like_a_path(source):
        raise CheckpointError(f"{source}: no such directory. Fix: give a directory written by transformers' "
                              "save_pretrained (with config.json), or a hub name such as gpt2-medium")
    if _in_hf_cache(source):
        return {"local_files_only": True}
    unreachable = _hub_unreachable()
    if unreachable:
        raise CheckpointError(f"no local directory {source}, and the Hugging Face hub could not be reached to "
                              f"download it ({unreachable}). Fix: {_SAVE_PRETRAINED}, or run where the hub "
                              "is reachable")
    return {}


def _looks_like_a_path(source: str) -> bool:
    """`source` names a local path rather than a hub model: not of the form `name` or `org/name`,
    starting with `.` or `~`, or under a directory that exists here (runs/gpt2_typo)."""
    parent = Path(source).parent
    return (not HUB_NAME.fullmatch(source) or source.startswith((".", "~"))
            or (parent != Path(".") and parent.is_dir()))


def _in_hf_cache(name: str) -> bool:
    """The local Hugging Face cache holds hub model `name`'s config (read without the network)."""
    from transformers import GPT2Config

    try:
        GPT2Config.from_pretrained(name, local_files_only=True)
    except (OSError, ValueError):
        return False
    return True


def _hub_unreachable(timeout: float = 10.0) -> str | None:
    """Why the Hugging Face hub cannot be reached (offline mode, no connection), in one try without
    transformers' retries; None when it answers."""
    from huggingface_hub import constants
    from huggingface_hub.utils import get_session

    if constants.HF_HUB_OFFLINE:
        return "offline mode: HF_HUB_OFFLINE or TRANSFORMERS_OFFLINE is set"
    try:
        get_session().head(constants.ENDPOINT, timeout=timeout)
    except Exception as err:  # the HTTP client's (requests or httpx) connection and timeout errors
        return f"{constants.ENDPOINT}: {(str(err).strip() or type(err).__name__).splitlines()[0]}"
    return None


def import_megatron(source: str | Path, dst: str | Path, tp: int = 1, options=None) -> Path:
    """Write a Megatron-LM GPT or BERT checkpoint (`torch` format, any TP x PP layout;
    `repro.models.megatron`; `options`: its ImportOptions) as a model-only checkpoint at TP degree `tp`
    into the new directory `dst`."""
    from repro.models.megatron import read_megatron
    from repro.models.megatron_files import MegatronFormatError

    dst = Path(dst)
    _check_new_dir(dst)
    try:
        megatron = read_megatron(source, options)
    except MegatronFormatError as err:
        raise CheckpointError(str(err)) from None
    cfg = megatron.config
    cfg.validate(tp)
    full = merge_shards(megatron.shards, partition_spec(cfg, megatron.family), cfg.vocab_size)
    megatron.shards.clear()  # the merged copy is all that is needed from here
    full = {name: tensor.float().contiguous() for name, tensor in full.items()}
    return _write_imported(full, cfg, dst, tp, {"imported_from": str(Path(source).resolve()),
                                                "imported_with": "import-megatron", **megatron.provenance},
                           megatron.family)


def export_megatron(src: str | Path, dst: str | Path, tp: int = 1) -> Path:
    """Write checkpoint `src`'s GPT (any saved TP degree) as a Megatron-LM `torch`-format release
    checkpoint at TP degree `tp` into the new directory `dst` (`repro.models.megatron_export`), one
    rank's tensors in memory at a time."""
    from repro.models.megatron_export import fill_padded_vocab, megatron_vocab_rows, write_megatron_gpt

    dst = Path(dst)
    _check_new_dir(dst)
    src = resolve(src)
    meta = read_meta(src)
    if meta.get("family", "gpt") != "gpt":
        raise CheckpointError(f"{src} is a {meta['family']} checkpoint: export-megatron writes GPT only")
    cfg = model_config(src, meta)
    cfg.validate(tp)
    rows = megatron_vocab_rows(cfg.vocab_size, tp)
    last_row = MergedModelState(src, meta)["transformer.wte.weight"][cfg.vocab_size - 1].clone()

    def rank_state(rank: int) -> dict:
        state = resharded_state(src, meta, rank, tp, rows)
        fill_padded_vocab(state, rank, cfg.vocab_size, last_row)
        return state

    with new_directory(dst) as tmp:
        write_megatron_gpt(tmp, (rank_state(rank) for rank in range(tp)), cfg, tp)
    return dst


def _write_imported(full: dict, cfg: ModelConfig, dst: Path, tp: int, provenance: dict, family: str = "gpt") -> Path:
    """Write full (TP=1, unpadded-vocab) weights as a model-only checkpoint at TP degree `tp`, atomically."""
    meta = {"format": FORMAT_VERSION, "family": family, "iteration": 0, "consumed_samples": 0, "zero_stage": 0,
            "model": dataclasses.asdict(cfg), "git_sha": git_sha(), **provenance}
    spec = partition_spec(cfg, family)
    with new_directory(dst) as tmp:
        _write_model_only(tmp, (shard_state(full, spec, r, tp, cfg.padded_vocab_size(tp)) for r in range(tp)), meta, tp)
    return dst


def _hf_weights(source: str, options: dict | None = None) -> dict:
    """Our TP=1 state dict of a GPT2LMHeadModel (`options`: from_pretrained's); a CheckpointError for
    unreadable or missing weights (transformers would fill missing ones with random values and only warn)."""
    from safetensors import SafetensorError
    from transformers import GPT2LMHeadModel

    from repro.models.hf import from_hf_state_dict

    try:
        hf, info = GPT2LMHeadModel.from_pretrained(source, output_loading_info=True, **(options or {}))
        missing = [k for k in info.get("missing_keys", []) if not k.endswith((".attn.bias", ".attn.masked_bias"))]
        wrong = [str(k) for k in info.get("mismatched_keys", [])]
        if missing or wrong:
            raise ValueError(f"weights missing {missing[:5]} or of the wrong shape {wrong[:5]}")
        return from_hf_state_dict(hf.state_dict())
    except pickle.UnpicklingError:
        raise CheckpointError(f"{source}: cannot import (its PyTorch weights file cannot be read: damaged, or "
                              "not a state dict). Fix: save the model again with save_pretrained") from None
    except (OSError, ValueError, RuntimeError, SafetensorError) as err:
        raise CheckpointError(f"{source}: cannot import ({str(err).strip().splitlines()[0]})") from None


def load_model_for_eval(ckpt: str | Path, pg: ProcessGroups, device="cpu"):
    """The checkpoint's model at this world's TP degree (resharded in memory if it differs)."""
    ckpt = resolve(ckpt)
    meta = read_meta(ckpt)
    cfg = model_config(ckpt, meta)
    cfg.validate(pg.tp_size)
    with torch.device("meta"):
        model = _build(cfg, meta.get("family", "gpt"), tp_group=pg.tp_group)
    if meta["tp"] == pg.tp_size:
        path = ckpt / f"model_tp{pg.tp_rank:02d}.pt"
        state = load_file(path)
        check_shard(path, state, {n: t.shape for n, t in model.state_dict().items()})
    else:
        state = resharded_state(ckpt, meta, pg.tp_rank, pg.tp_size)
    model = to_empty_keeping_markers(model, device)  # grad norm, ZeRO and resharding read the TP markers
    model.load_state_dict(state)
    return model.eval()
