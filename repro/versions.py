"""Which torch releases this project runs on, read without importing torch.

The whole test suite passes with torch 2.11.0 and 2.13.0, and with 2.9.1 but for one test that passes
since the attention enters its RNG context directly (results/torch_versions.md). With 2.6.0 all passes except
`train.compile` of the whole step at TP > 1 (inductor fails in its generated code), so `auto` compiles
per layer there on torch older than 2.9 (repro.train.engine.compile_scope). Below 2.6 transformers
turns itself off, which breaks the Hugging Face checks, import/export and lm-eval: `repro` refuses it.
"""

from __future__ import annotations

MIN_TORCH = (2, 6)
WHOLE_TP_GRAPH_TORCH = (2, 9)
"""The oldest torch `auto` trusts to compile the whole training step at TP > 1: 2.9.1 and the stable
2.8.0 do (results/torch_versions.md), 2.6.0 fails; 2.7 and NGC's 2.8.0a0 pre-release are untried."""


def release(version: str) -> tuple[int, int]:
    """(major, minor) of a version string: '2.6.0a0+ecf3bae40a.nv25.01' -> (2, 6)."""
    major, minor = version.split("+")[0].split(".")[:2]
    return int(major), int("".join(ch for ch in minor if ch.isdigit()))


def installed_torch() -> str | None:
    """The installed torch's version from its metadata (no import); "" for a torch importable without
    metadata (a source tree on PYTHONPATH: not checked), None when there is none."""
    from importlib.metadata import PackageNotFoundError, version
    from importlib.util import find_spec

    try:
        return version("torch")
    except PackageNotFoundError:
        return "" if find_spec("torch") is not None else None


def torch_version_problem(installed: str | None) -> str | None:
    """Why this torch (its version string, None when not installed) cannot run `repro`, or None."""
    want = ".".join(map(str, MIN_TORCH))
    fix = (f"install torch>={want} in this environment, the build for your CUDA from "
           "https://download.pytorch.org/whl/ (make setup installs the pinned CPU build)")
    if installed is None:
        return f"torch is not installed. Fix: {fix}"
    if installed and release(installed) < MIN_TORCH:
        return f"torch {installed} is older than {want}, the oldest this project is tested with. Fix: {fix}"
    return None
