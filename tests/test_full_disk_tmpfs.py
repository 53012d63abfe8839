"""A real full disk: each command runs in its own mount namespace (`unshare --mount`) on a tmpfs of a few
MiB more than one checkpoint, so the second checkpoint fails part way through a tensor, as on a cluster's
filled scratch disk. (tests/test_crash_safety.py writes to /dev/full, which refuses the first write:
torch's zip writer then raised an OSError. Here the write fails inside the archive, where torch raises
RuntimeError "unexpected pos ..." over it, and DeepSpeed's C++ writer raises one with no OSError at all:
both ended in a traceback with exit 1.) Every case: exit 2, one line naming the disk and the fix, and
`latest` still on the last complete checkpoint."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import require
from test_train_resume import TINY
from train_fixtures import corpus, data_dir, data_mirror, tiny_overrides  # noqa: F401

MiB = 2**20


def _on_small_tmpfs(folder: Path, size_mib: int, *commands: list[str]) -> list[subprocess.CompletedProcess]:
    """Run `commands` one after another on a tmpfs of `size_mib` mounted at `folder` in a private mount
    namespace (gone, with the tmpfs, when the last command ends); each command's exit code and output."""
    require(os.geteuid() == 0 and shutil.which("unshare") is not None, "root and `unshare` (util-linux)")
    folder.mkdir(parents=True, exist_ok=True)
    steps = [f"mount -t tmpfs -o size={size_mib}m tmpfs {shlex.quote(str(folder))}"]
    for n, command in enumerate(commands):
        steps.append(f"{shlex.join(command)} > {folder.parent}/out{n} 2> {folder.parent}/err{n}; "
                     f"echo $? > {folder.parent}/rc{n}")
    script = " && ".join(steps[:1]) + "; " + "; ".join(steps[1:])
    done = subprocess.run(["unshare", "--mount", "--propagation", "private", "--", "bash", "-c", script],
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and (folder.parent / "rc0").exists(), done.stderr
    return [subprocess.CompletedProcess(command, int((folder.parent / f"rc{n}").read_text()),
                                        (folder.parent / f"out{n}").read_text(), (folder.parent / f"err{n}").read_text())
            for n, command in enumerate(commands)]


def _train(corpus: dict, run: Path, **settings) -> list[str]:
    over = tiny_overrides(corpus, run, **{"train.train_iters": 4, "train.save_interval": 2, **settings})
    return [sys.executable, "-m", "repro.cli", "train", TINY, "--nproc", "2", *sum((["--set", o] for o in over), [])]


def _one_clear_line(done: subprocess.CompletedProcess, *named: str) -> None:
    errors = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
    assert done.returncode == 2 and len(errors) == 1, done.stderr[-3000:]
    assert "Traceback" not in done.stderr and "No space left on device" in errors[0], done.stderr[-3000:]
    assert "Fix: free space" in errors[0] and all(n in errors[0] for n in named), done.stderr[-3000:]


@pytest.mark.parametrize("layout, size_mib", [({"parallel.tp": 2}, 60), ({"train.zero_stage": 1}, 96)],
                         ids=["tp2", "zero1-dp2"])
def test_a_checkpoint_that_fills_the_disk_part_way_is_a_clear_error(corpus, tmp_path, layout, size_mib):
    """The checkpoint at iteration 2 fits (39 MiB at TP=2, 64 MiB under ZeRO-1), the one at 4 does not. A
    second launch on the full disk (what a user reruns) fails on the run's first file, params.json, in a
    rank spawned by --nproc: the same one line (it was a rank's traceback, exit 1)."""
    run = tmp_path / "disk" / "run"
    first, again, latest = _on_small_tmpfs(tmp_path / "disk", size_mib, _train(corpus, run, **layout),
                                           _train(corpus, run, **layout), ["cat", str(run / "checkpoints/latest")])
    _one_clear_line(first, "checkpoint iter_0000004 did not fit", "still points to the last good checkpoint, "
                    "iter_0000002", str(run / "checkpoints"))
    _one_clear_line(again, str(run))  # the file it could not write (params.json, or the run's lock)
    assert latest.stdout.strip() == "iter_0000002"


def test_a_reshard_onto_a_full_disk_is_a_clear_error(corpus, tmp_path):
    """`repro checkpoint reshard` writing more than the disk holds: exit 2 naming the shard and the fix, and
    no partial output directory (it ended in torch's RuntimeError traceback)."""
    from repro.cli import main

    run = tmp_path / "run"
    assert main(["train", TINY, *sum((["--set", o] for o in tiny_overrides(
        corpus, run, **{"train.train_iters": 1, "train.save_interval": 1})), [])]) == 0
    out = tmp_path / "disk" / "merged"
    reshard = [sys.executable, "-m", "repro.cli", "checkpoint", "reshard", str(run / "checkpoints" / "latest"),
               "--tp", "2", "--out", str(out)]
    done, listing = _on_small_tmpfs(tmp_path / "disk", 2, reshard, ["ls", "-A", str(out.parent)])
    _one_clear_line(done, f"{out.parent}/.{out.name}.", "model_tp00.pt")  # in the temporary sibling
    assert listing.returncode == 0 and listing.stdout.strip() == "", listing.stdout
