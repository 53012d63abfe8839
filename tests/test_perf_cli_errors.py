"""Bad input to the perf tools, run as a user runs them: a cluster YAML with a syntax error, a duplicate
key or no memory above the plan's headroom; a --device this machine lacks; the full optimizer benchmark
with no GPU. Each is one line naming the problem and the fix, exit 2, no traceback."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest
import yaml

from repro.perf.scaling_model import H200_CLUSTER

ROOT = Path(__file__).resolve().parents[1]
PLAN = ["plan", str(ROOT / "experiments/gpt2/gpt2_355m.yaml"), "--gpus", "8"]


def _limit_memory() -> None:
    """At most 6 GB of address space: a tool that builds the 1.2B model dies instead of filling the machine."""
    resource.setrlimit(resource.RLIMIT_AS, (6 * 2**30, 6 * 2**30))


def _run(tmp_path: Path, *argv: str, module: str = "repro.cli", timeout: float = 60) -> subprocess.CompletedProcess:
    """`python -m module argv` from tmp_path (so PYTHONPATH, not the checkout, decides what is imported), with
    every GPU hidden: the refusals are a CPU-only machine's, wherever the tests run."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    return subprocess.run([sys.executable, "-m", module, *argv], cwd=tmp_path, capture_output=True, text=True,
                          timeout=timeout, preexec_fn=_limit_memory, env=env)


def _refused(proc: subprocess.CompletedProcess, *parts: str) -> None:
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert all(part in proc.stderr for part in parts), proc.stderr


@pytest.mark.parametrize("command", [PLAN, ["plan", "--paper", "--out", "paper"],
                                     ["scaling-model", "--out", "tables"]])
def test_a_cluster_file_with_a_yaml_syntax_error_names_line_and_column(tmp_path, command):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: mine\npeak_tflops: [989\n")
    _refused(_run(tmp_path, *command, "--cluster", str(bad)),
             f"error: {bad}: not valid YAML (line 3, column 1: did not find expected ',' or ']')")


def test_a_cluster_file_with_a_duplicate_key_names_it(tmp_path):
    dup = tmp_path / "dup.yaml"
    dup.write_text(yaml.safe_dump(asdict(H200_CLUSTER), sort_keys=False) + "gpus_per_node: 4\n")
    line = len(dup.read_text().splitlines())
    _refused(_run(tmp_path, *PLAN, "--cluster", str(dup)),
             f"error: {dup}: not valid YAML (line {line}, column 1: found duplicate key gpus_per_node)")


def test_a_cluster_with_no_memory_above_the_headroom_is_refused(tmp_path):
    """memory_gib 3 left -0 GiB usable: every plan printed DOES NOT FIT and suggested halving the batch."""
    small = tmp_path / "small.yaml"
    small.write_text(yaml.safe_dump({**asdict(H200_CLUSTER), "memory_gib": 3.0}, sort_keys=False))
    _refused(_run(tmp_path, *PLAN, "--cluster", str(small)),
             "memory_gib=3 must be more than the 3 GiB the plan keeps")


@pytest.mark.parametrize("device, message", [("bogus", "--device bogus: not a device this runs on; choose cpu"),
                                             ("cuda", "--device cuda: CUDA is not available here")])
def test_gpu_bench_refuses_a_device_this_machine_lacks(tmp_path, device, message):
    proc = _run(tmp_path, "--tiny", "--out", "b", "--dtypes", "bf16", "--device", device,
                module="repro.perf.gpu_bench")
    _refused(proc, message)
    assert not (tmp_path / "b").exists()


def test_optimizer_bench_without_cuda_refuses_the_full_config(tmp_path):
    """It built the 1.2B model on the CPU (tens of GB) where gpu_bench and gpu_profile refuse."""
    try:
        proc = _run(tmp_path, "--out", "o", "--reps", "1", module="repro.perf.optimizer_bench", timeout=30)
    except subprocess.TimeoutExpired:
        pytest.fail("optimizer_bench did not refuse: it went on to build the full model on the CPU")
    _refused(proc, "no CUDA device", "pass --tiny")
    assert not (tmp_path / "o").exists()
