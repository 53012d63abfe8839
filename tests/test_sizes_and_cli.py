"""Named sizes round to the paper's counts; `repro selftest` and `repro sizes` run end to end; `repro`
refuses a torch older than the oldest tested one."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from repro.versions import torch_version_problem
from repro.models.sizes import SIZES, count_parameters

PAPER_COUNTS = {"1.2B": 1.2e9, "2.5B": 2.5e9, "4.2B": 4.2e9, "8.3B": 8.3e9, "355M": 355e6,
                "336M": 336e6, "1.3B": 1.3e9, "3.9B": 3.9e9}


def _rounds_to(n: int, paper: str) -> bool:
    """True when n rounds to the paper's figure at the paper's precision ("1.2B": +-0.05B)."""
    unit = 1e9 if paper.endswith("B") else 1e6
    digits = paper[:-1].split(".")
    half_step = 0.5 * unit * (10.0 ** -len(digits[1]) if len(digits) == 2 else 1.0)
    return abs(n - PAPER_COUNTS[paper]) <= half_step


@pytest.mark.parametrize("name", [n for n, s in SIZES.items() if s.family == "gpt"])
def test_gpt_sizes_round_to_the_papers(name):
    """Counted on the meta device. GPT-2 355M rounds to the paper only with the unpadded vocab
    (354.8M; the padded 51,200 rows give 355.8M): the paper's figure is GPT-2 medium's usual name."""
    size = SIZES[name]
    padded = count_parameters(size)
    unpadded = padded - (size.model_config().padded_vocab_size() - size.vocab_size) * size.hidden_size
    assert _rounds_to(padded, size.paper_params) or _rounds_to(unpadded, size.paper_params), (padded, unpadded)


def test_selftest_cli_passes_on_two_ranks():
    """Run as the one task of an srun step (an interactive `srun --pty bash`): --nproc still spawns its
    ranks; before, the step checked itself alone and said so in a one-rank table."""
    launchers = ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_STEP_ID", "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS")
    env = {**{k: v for k, v in os.environ.items() if k not in launchers},
           "SLURM_PROCID": "0", "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "1", "SLURM_NTASKS": "8"}
    out = subprocess.run([sys.executable, "-m", "repro.cli", "selftest", "--nproc", "2"],
                         capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "repro selftest: 2 ranks" in out.stdout
    assert "31/31 checks passed" in out.stdout
    assert "FAIL" not in out.stdout


def test_sizes_cli_prints_every_size():
    out = subprocess.run([sys.executable, "-m", "repro.cli", "sizes", "--family", "gpt"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "scaling-8.3b" in out.stdout and "8.3B" in out.stdout


@pytest.mark.parametrize("installed", ["2.6.0+cu124", "2.11.0+cu130", "2.13.0+cpu", "2.6.0a0+ecf3bae40a.nv25.01", ""])
def test_tested_torch_versions_are_accepted(installed):
    """The versions the suite has passed with, an NGC container's development build of 2.6, and a
    torch without metadata (a source tree on the path: importable, its version unread)."""
    assert torch_version_problem(installed) is None


@pytest.mark.parametrize("installed", ["2.5.1+cu121", "2.4.0", "1.13.1"])
def test_older_torch_is_refused_naming_the_fix(installed):
    problem = torch_version_problem(installed)
    assert problem is not None and installed in problem and "torch>=2.6" in problem
    assert "not installed" in torch_version_problem(None)


def test_repro_refuses_an_older_torch_before_running_the_command(tmp_path):
    """End to end: a torch 2.5.1 distribution first on the path (metadata only: `repro` reads the
    installed version without importing torch) stops `repro sizes` with exit code 2 and the fix."""
    dist = tmp_path / "torch-2.5.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: torch\nVersion: 2.5.1\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-m", "repro.cli", "sizes", "--family", "gpt"], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stdout + out.stderr
    assert "torch 2.5.1 is older than 2.6" in out.stderr and "scaling-8.3b" not in out.stdout
