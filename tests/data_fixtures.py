"""Fixtures of the data-pipeline tests: the mirror, a fetched data dir, tokenizers.

Import the ones a test file uses (`from data_fixtures import data_dir`). The mirror comes from
REPRO_DATA_MIRROR, else /work/shared/data when it exists; without one the tests skip locally and
FAIL in CI (CI=true), so a CI machine without the data cannot pass by skipping. `make test` sets
REPRO_DATA_MIRROR to the data dir `make data` filled (downloaded and sha256-checked) when no
mirror is configured: a fetched data dir has the mirror's layout.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from conftest import require

DEFAULT_MIRROR = Path("/work/shared/data")


def mirror_path() -> Path | None:
    """The mirror directory to test against, or None."""
    value = os.environ.get("REPRO_DATA_MIRROR")
    if value:
        return Path(value).absolute()
    return DEFAULT_MIRROR if DEFAULT_MIRROR.is_dir() else None


@pytest.fixture(scope="session")
def data_mirror() -> Path:
    """The read-only mirror (REPRO_DATA_MIRROR or /work/shared/data)."""
    mirror = mirror_path()
    require(mirror is not None and mirror.is_dir(),
            f"the data mirror (REPRO_DATA_MIRROR={os.environ.get('REPRO_DATA_MIRROR')!r})")
    return mirror


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory: pytest.TempPathFactory, data_mirror: Path) -> Path:
    """A data dir filled by `fetch` from the mirror, every file sha256-verified."""
    from repro.data.fetch import FetchOptions, fetch

    target = tmp_path_factory.mktemp("data")
    fetch(FetchOptions(data_dir=target, mirror=data_mirror))
    return target


@pytest.fixture(scope="session")
def gpt2_tokenizer(data_dir: Path):
    """GPT-2 BPE from the fetched vocab."""
    from repro.data.tokenizers import build_tokenizer

    return build_tokenizer("gpt2", data_dir)


@pytest.fixture(scope="session")
def bert_tokenizer(data_dir: Path):
    """BERT uncased WordPiece from the fetched vocab."""
    from repro.data.tokenizers import build_tokenizer

    return build_tokenizer("bert", data_dir)
