"""Find and read the rank files of a Megatron-LM checkpoint (its `torch` format) without Megatron.

Layout (Megatron-LM's checkpointing.py): DIR/latest_checkpointed_iteration.txt holds `release` or an
iteration and so names DIR/release/ or DIR/iter_0000500/, which holds one folder per model-parallel
rank, mp_rank_{tp:02d}/model_optim_rng.pt, or mp_rank_{tp:02d}_{pp:03d}/... with pipeline stages. A
folder holding the mp_rank_* folders, or one model_optim_rng.pt of a TP=1, PP=1 run, is read too.
Files are read with torch.load(weights_only=True): Megatron's own pickled classes (enums, loss
scalers, Transformer Engine's extra state) become inert placeholders, so nothing in a file runs.
"""

from __future__ import annotations

import argparse
import pickle
import re
import zipfile
from dataclasses import dataclass
from pathlib import Path

import torch

TRACKER = "latest_checkpointed_iteration.txt"
RANK_DIR = re.compile(r"^mp_rank_(\d{2})(?:_(\d{3}))?$")
ZIP_MAGIC = b"PK\x03\x04"  # how torch.save's zip archive begins (the format before torch 1.6 is a pickle)
_TO_TORCH_FORMAT = ("re-save it in Megatron-LM's `torch` format: launch its training script with --load DIR "
                    "--ckpt-convert-format torch --ckpt-convert-save NEW_DIR, then import NEW_DIR")


class MegatronFormatError(ValueError):
    """A Megatron-LM checkpoint this project cannot read or build a model from; the message names the
    problem and the fix."""


@dataclass(frozen=True)
class MegatronFiles:
    """The model_optim_rng.pt of every (tp_rank, pp_rank) of one saved iteration."""

    files: dict[tuple[int, int], Path]
    iteration: str  # "release", an iteration number, or "" when no tracker file named it

    @property
    def tp(self) -> int:
        return 1 + max(t for t, _ in self.files)

    @property
    def pp(self) -> int:
        return 1 + max(p for _, p in self.files)


def locate(path: str | Path) -> MegatronFiles:
    """The rank files of a Megatron-LM checkpoint directory (or of one .pt file)."""
    path = Path(path)
    if path.is_file():
        if path.suffix == ".zip":
            raise MegatronFormatError(f"{path} is a zip archive: unzip it (unzip {path.name} -d DIR) and import DIR")
        return MegatronFiles({(0, 0): path}, "")
    if not path.is_dir():
        raise MegatronFormatError(f"{path} does not exist: give a Megatron-LM checkpoint directory (the --save "
                                  f"directory holding {TRACKER}) or one model_optim_rng.pt")
    path, iteration = _iteration_folder(path)
    _refuse_distributed(path)
    files = {}
    for folder in path.iterdir() if path.is_dir() else ():
        match = RANK_DIR.match(folder.name)
        if match and (folder / "model_optim_rng.pt").is_file():
            files[(int(match[1]), int(match[2] or 0))] = folder / "model_optim_rng.pt"
    if not files:
        raise MegatronFormatError(f"{path} holds no mp_rank_*/model_optim_rng.pt: give the directory Megatron-LM "
                                  f"saved to (with {TRACKER}), one iteration's folder, or one .pt file")
    found = MegatronFiles(files, iteration)
    missing = [f"mp_rank_{t:02d}" + (f"_{p:03d}" if found.pp > 1 else "")
               for t in range(found.tp) for p in range(found.pp) if (t, p) not in files]
    if missing:
        raise MegatronFormatError(f"{path} lacks {', '.join(missing)} of a TP={found.tp} x PP={found.pp} "
                                  "checkpoint: copy every rank's folder")
    return found


def _iteration_folder(path: Path) -> tuple[Path, str]:
    """The folder of rank folders that PATH's tracker file names (else PATH, or its lone release/)."""
    if (path / TRACKER).is_file():
        iteration = (path / TRACKER).read_text().strip()
        if iteration != "release" and not iteration.isdigit():
            raise MegatronFormatError(f"{path / TRACKER} holds {iteration!r}, neither 'release' nor an iteration")
        return path / ("release" if iteration == "release" else f"iter_{int(iteration):07d}"), iteration
    if any(RANK_DIR.match(p.name) for p in path.iterdir()):
        return path, ""
    if (path / "release").is_dir():  # NVIDIA's release zips hold release/mp_rank_00/ only
        return path / "release", "release"
    saved = sorted(p.name for p in path.glob("iter_*"))
    if saved:
        raise MegatronFormatError(f"{path} has no {TRACKER} naming one of its iterations: import one of "
                                  f"{', '.join(saved[-3:])} (e.g. {path / saved[-1]})")
    return path, ""


def _refuse_distributed(path: Path) -> None:
    if (path / ".metadata").exists() or (path / "common.pt").exists() or any(path.glob("*.distcp")):
        raise MegatronFormatError(f"{path} is a torch_dist (distributed) checkpoint, which needs Megatron-LM to "
                                  f"read: {_TO_TORCH_FORMAT}")


class _Opaque:
    """Stands in for a class the checkpoint pickled but an import does not need (Megatron's enums and
    loss scalers, Transformer Engine's extra state, numpy RNG states): it keeps what it was given."""

    def __init__(self, *args, **kwargs) -> None:
        self.args = args

    def __setstate__(self, state) -> None:
        self.state = state


def load_rank_file(path: Path) -> dict:
    """torch.load(weights_only=True) with argparse.Namespace allowed and every other class the file
    names replaced by an inert placeholder: nothing in the file runs and Megatron need not be installed."""
    allowed: list = [argparse.Namespace]
    try:  # the zip format lists its classes up front; the pre-1.6 format is learned one error at a time
        allowed += [_placeholder(name) for name in torch.serialization.get_unsafe_globals_in_checkpoint(path)
                    if name != "argparse.Namespace"]
    except Exception:  # noqa: BLE001 - the legacy format, or a torch without the function
        pass
    for _ in range(100):
        try:
            with torch.serialization.safe_globals(allowed):
                return torch.load(path, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as err:
            name = re.search(r"GLOBAL ([\w.]+)", str(err))
            if name is None or any(isinstance(a, tuple) and a[1] == name[1] for a in allowed):
                raise MegatronFormatError(f"{path}: cannot unpickle ({str(err).splitlines()[0]})") from None
            allowed.append(_placeholder(name[1]))
        except MemoryError:
            raise
        except Exception as err:  # noqa: BLE001 - unpickling damaged bytes raises almost any type (KeyError, EOFError...)
            raise _damaged(path, err) from None
    raise MegatronFormatError(f"{path}: names over 100 classes; it is not a Megatron-LM checkpoint")


def _damaged(path: Path, err: Exception) -> MegatronFormatError:
    """The error for a rank file torch cannot read, naming the file, what is wrong with it and the fix."""
    return MegatronFormatError(f"{path} is damaged ({_what_is_wrong(path, err)}): torch cannot read it. Fix: copy "
                               "it again from where Megatron-LM saved it (the copy was cut short or overwritten), "
                               "then import again")


def _what_is_wrong(path: Path, err: Exception) -> str:
    """Empty, not a torch.save file (neither its zip archive nor the pickle before torch 1.6), cut short
    (where torch says only `[Errno 22] Invalid argument` or raises a bare EOFError), else torch's error."""
    try:
        with open(path, "rb") as f:
            head = f.read(4)
    except OSError:
        head = None  # unreadable now: torch's error says why
    if head == b"":
        return "an empty file"
    if head is not None and head != ZIP_MAGIC and not head.startswith(b"\x80"):  # nor a pickle's PROTO opcode
        return "not a torch.save file"
    if head == ZIP_MAGIC and isinstance(err, OSError) and not zipfile.is_zipfile(path):
        return "a torch.save zip archive cut short"
    if isinstance(err, EOFError):  # the pickle before torch 1.6, cut short
        return "it ends too soon"
    text = str(err).strip()
    return text.splitlines()[0].split(". ")[0] if text else type(err).__name__


def _placeholder(qualified_name: str) -> tuple[type, str]:
    return type(qualified_name.rsplit(".", 1)[-1], (_Opaque,), {}), qualified_name


def flatten(tree: dict, prefix: str = "") -> dict[str, object]:
    """Nested state dicts (the legacy `language_model` -> `embedding` -> ...) as dotted names."""
    flat = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        flat |= flatten(value, name + ".") if isinstance(value, dict) else {name: value}
    return flat


def model_state(saved: dict, path: Path) -> dict[str, torch.Tensor]:
    """The flat model state of one rank file (tensors only: Transformer Engine's extra state dropped)."""
    if "model" not in saved:
        chunks = sorted(k for k in saved if re.fullmatch(r"model\d+", str(k)))
        hint = (f"it holds {', '.join(chunks)} (interleaved pipeline stages): re-save it with one model chunk per "
                "stage (Megatron-LM's tools/checkpoint, target pipeline size 1)") if chunks else \
            f"its keys are {sorted(map(str, saved))[:8]}"
        raise MegatronFormatError(f"{path} has no 'model' entry: {hint}")
    return {k: v for k, v in flatten(saved["model"]).items()
            if isinstance(v, torch.Tensor) and not k.endswith("_extra_state")}
