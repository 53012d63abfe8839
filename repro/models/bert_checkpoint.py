"""TP-agnostic BERT checkpoints: save full (unsharded, unpadded) tensors, load at any TP degree.

A model saved at tp=k (every rank calls `save_bert`, rank 0 writes) loads at tp=m: each rank
slices the full master tensor exactly as the layers do at init (`shard_master`), and the
vocabulary rows are re-padded for m. This is how `repro finetune race` starts from a pretrained
checkpoint of any TP degree.
"""

from __future__ import annotations

import os
from dataclasses import asdict
from pathlib import Path
from typing import Mapping

import torch
import torch.distributed as dist

from repro.models.bert import BERT, BertConfig
from repro.parallel.layers import gather_full, is_tensor_parallel, pad_vocab_rows, shard_master
from repro.parallel.mappings import group_rank, group_size
from repro.provenance import save_torch

VOCAB_ROWS = ("embeddings.word.weight", "lm_head.bias")  # padded along dim 0


def full_state_dict(model: BERT) -> dict[str, torch.Tensor]:
    """Every tensor whole (TP shards gathered) with the padded vocabulary rows dropped."""
    out = {}
    params = dict(model.named_parameters())
    for name, tensor in model.state_dict().items():
        p = params.get(name)
        if p is not None and is_tensor_parallel(p) and group_size(model.tp_group) > 1:
            t = tensor.detach()
            t.partition_dim, t.partition_stride = p.partition_dim, getattr(p, "partition_stride", 1)
            tensor = gather_full(t, model.tp_group)
        if name in VOCAB_ROWS:
            tensor = tensor[: model.cfg.vocab_size]
        out[name] = tensor.detach().cpu().clone()
    return out


def load_full_state_dict(model: BERT, state: Mapping[str, torch.Tensor], strict: bool = True,
                         skip: tuple[str, ...] = ()) -> None:
    """Copy full tensors into a model of any TP degree (this rank's slice of each), reading `state`
    one tensor at a time; names starting with a `skip` prefix are not read."""
    tp, rank = group_size(model.tp_group), group_rank(model.tp_group)
    params, local = dict(model.named_parameters()), {}
    for name in state:
        if name.startswith(skip):
            continue
        full = state[name]
        if name in VOCAB_ROWS:
            full = pad_vocab_rows(full, model.padded_vocab)
        p = params.get(name)
        if p is not None and is_tensor_parallel(p):
            full = shard_master(full, p.partition_dim, rank, tp, getattr(p, "partition_stride", 1))
        local[name] = full
    missing, unexpected = model.load_state_dict(local, strict=False)
    if strict and (missing or unexpected):
        raise RuntimeError(f"checkpoint does not fit the model: missing {missing}, unexpected {unexpected}")


def save_bert(model: BERT, path: Path | str) -> None:
    """Every rank calls this (the TP gather is collective); global rank 0 writes the file, through a
    temporary sibling renamed into place (a reader mapping the old file keeps its own copy)."""
    state = full_state_dict(model)
    if not dist.is_initialized() or dist.get_rank() == 0:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        save_torch({"config": asdict(model.cfg), "model": state}, tmp)
        os.replace(tmp, path)


def read_bert(path: Path | str) -> tuple[BertConfig, Mapping[str, torch.Tensor]]:
    """The config and full state dict of a checkpoint written by `save_bert`, or of a `repro train`
    BERT checkpoint (a run directory, its checkpoints/ folder or an iter_XXXXXXX folder; any TP).
    Both are memory-mapped; a run's TP shards are merged one tensor at a time as they are read, so a
    rank loading its slice never holds the whole model."""
    path = Path(path)
    if path.is_dir():
        from repro.train.checkpoint import model_config, read_meta, resolve
        from repro.train.reshard import MergedModelState

        ckpt = resolve(path)
        meta = read_meta(ckpt)
        family = meta.get("family", "gpt")  # (checkpoints from before the family was recorded are GPT's)
        if family != "bert":
            raise FileNotFoundError(f"{path}: a {family.upper()} checkpoint, not BERT. Fix: pass a BERT run")
        return model_config(ckpt, meta, BertConfig), MergedModelState(ckpt, meta)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such checkpoint. Fix: pass a file written by save_bert "
                                "or a `repro train` BERT run directory")
    return _read_file(path)


FILE_FIX = ("Fix: pass a file written by save_bert (copy or save it again if it was cut short) or a "
            "`repro train` BERT run directory")


def _read_file(path: Path) -> tuple[BertConfig, Mapping[str, torch.Tensor]]:
    """A `save_bert` file's config and state; CheckpointError naming the file for anything else."""
    import pickle

    from repro.train.checkpoint import CheckpointError, error_reason

    try:  # memory-mapped: each rank copies only its TP slices out; a node's ranks share the file's pages
        blob = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except (RuntimeError, EOFError, OSError, ValueError, pickle.UnpicklingError) as err:
        raise CheckpointError(f"{path} is not a readable torch file ({error_reason(err)}). {FILE_FIX}") from None
    keys = sorted(map(str, blob)) if isinstance(blob, dict) else type(blob).__name__
    if not isinstance(blob, dict) or not isinstance(blob.get("config"), dict) or "model" not in blob:
        raise CheckpointError(f"{path} holds no save_bert 'config' and 'model' (found: {keys}). {FILE_FIX}")
    try:
        cfg = BertConfig(**blob["config"])
        misfit = _misfit(cfg, blob["model"])  # (builds the model its config describes, on the meta device)
    except (TypeError, ValueError) as err:  # (ConfigError is a ValueError)  # an unknown key, a layer count of 0, a width "x"
        raise CheckpointError(f"{path}: its config is not a valid BertConfig ({err}). {FILE_FIX}") from None
    if misfit:
        raise CheckpointError(f"{path}: its weights do not fit its own config ({misfit}). {FILE_FIX}")
    return cfg, blob["model"]


HEADS = ("lm_head.", "sop_head.")  # pretraining heads: a file may leave them out (fine-tuning reads none)


def _misfit(cfg: BertConfig, state) -> str:
    """What keeps `state` from loading into the model `cfg` describes ("" if nothing): checked on the
    tensors' shapes before any work, not at load time, after a fine-tuning's data were prepared."""
    if not isinstance(state, Mapping):
        return f"'model' is a {type(state).__name__}, not a state dict"
    want = {name: tuple(t.shape) for name, t in BERT(cfg, device="meta").state_dict().items()}
    for name in VOCAB_ROWS:
        want[name] = (cfg.vocab_size, *want[name][1:])  # saved without the padded rows
    missing = [n for n in want if n not in state and not n.startswith(HEADS)]
    unexpected = [n for n in state if n not in want]
    held = {n: tuple(getattr(state[n], "shape", ())) for n in want if n in state}
    wrong = [f"{n} {shape} for {want[n]}" for n, shape in held.items() if shape != want[n]]
    parts = [f"{label} {', '.join(map(str, names[:4]))}{' ...' if len(names) > 4 else ''}"
             for label, names in (("missing", missing), ("unexpected", unexpected), ("shape", wrong)) if names]
    return "; ".join(parts)


def checkpoint_identity(path: Path | str) -> dict:
    """What tells this checkpoint from another at the same path (a `latest` that moved, a file saved
    again), and survives a copy: a `repro train` checkpoint's iteration and training run id; a file's
    size and torch serialization id (a fresh one per save)."""
    path = Path(path)
    if path.is_dir():
        from repro.train.checkpoint import training_provenance

        return training_provenance(path)
    return {"bytes": path.stat().st_size, "serialization_id": _serialization_id(path)}


def _serialization_id(path: Path) -> str:
    """The random id torch.save writes into its zip (read from the zip's index: cheap); "" if none."""
    import zipfile

    try:
        with zipfile.ZipFile(path) as z:
            name = next((n for n in z.namelist() if n.endswith(".data/serialization_id")), None)
            return z.read(name).decode(errors="replace") if name else ""
    except (OSError, zipfile.BadZipFile, ValueError):
        return ""
