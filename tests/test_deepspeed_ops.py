"""DeepSpeed on CPU builds no JIT op, so a build lock left by a killed process cannot hang later runs."""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
from pathlib import Path

from conftest import require
from repro.parallel.spawn import free_port
from train_fixtures import corpus, data_dir, data_mirror, tiny_overrides  # noqa: F401

TINY = str(Path(__file__).resolve().parents[1] / "experiments/tiny/gpt_tiny.yaml")


def _shm_op_lock(extensions_dir: Path) -> Path:
    """Where torch's JIT build of DeepSpeed's shared-memory comm op keeps its lock under extensions_dir."""
    probe = "from torch.utils.cpp_extension import _get_build_directory as d; print(d('deepspeed_shm_comm', False))"
    out = subprocess.run([sys.executable, "-c", probe], env={**os.environ, "TORCH_EXTENSIONS_DIR": str(extensions_dir)},
                         capture_output=True, text=True, check=True)
    return Path(out.stdout.strip()) / "lock"


def test_a_zero_run_finishes_past_a_build_lock_a_killed_run_left(corpus, tmp_path):
    """A process killed while torch JIT-built DeepSpeed's CPU shm comm op (or a full disk) leaves the
    build's lock file, and torch waits for it to vanish. Before, every later ZeRO launch on CPU waited at
    deepspeed.initialize forever with no message (CI: 16 tests at their 300 s timeout). Training never
    uses that op (it serves DeepSpeed inference's all-reduce), so the trainer no longer builds it: a ZeRO-1
    run at DP=2 finishes with the stale lock in place, and no build directory gains a library."""
    require(importlib.util.find_spec("deepspeed") is not None, "DeepSpeed")
    extensions = tmp_path / "torch_extensions"
    lock = _shm_op_lock(extensions)
    lock.touch()  # what a killed build leaves
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "SLURM_PROCID")}
    env.update(TORCH_EXTENSIONS_DIR=str(extensions), MASTER_PORT=str(free_port()), OMP_NUM_THREADS="1")
    over = tiny_overrides(corpus, tmp_path / "run", **{"train.zero_stage": 1, "train.train_iters": 2,
                                                        "data.valid_prefix": ""})
    cmd = [sys.executable, "-m", "repro.cli", "train", TINY, "--nproc", "2", *sum((["--set", o] for o in over), [])]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=150)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the launcher and its ranks
        proc.communicate()
        raise AssertionError(f"the ZeRO run still waited after 150 s (on {lock}?)") from None
    assert proc.returncode == 0, stdout[-2000:] + stderr[-3000:]
    assert "iteration      2/2" in stdout
    assert lock.exists() and not list(extensions.rglob("*.so"))
