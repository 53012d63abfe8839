"""Crash safety: stop signals to the `repro train --nproc` launcher alone, a killed launcher or rank,
a full disk while saving, preparing or evaluating, a half-swapped dataset, a killed `repro report`."""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from repro.parallel.spawn import run_ranks
from repro.train import checkpoint as ck
from test_train_resume import _HOLD_IN_STEP_3, TINY, _children  # (each rank writes its pid to HOLD_DIR/rank<r>)
from train_fixtures import corpus, data_dir, data_mirror, tiny_overrides  # noqa: F401


def _with_site(site: Path, code: str, **env) -> dict[str, str]:
    """Environment variables that make every Python process load `code` as its sitecustomize.py."""
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(code)
    return {"PYTHONPATH": os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH")) if p), **env}


def _held_train(corpus, tmp_path: Path) -> tuple[subprocess.Popen, Path, list[int]]:
    """`repro train --nproc 2` (tp=2) held in step 3: (process, run dir, rank pids)."""
    hold, run = tmp_path / "hold", tmp_path / "run"
    over = tiny_overrides(corpus, run, **{"parallel.tp": 2, "train.train_iters": 40})
    env = {**os.environ, "OMP_NUM_THREADS": "1", **_with_site(hold, _HOLD_IN_STEP_3, HOLD_DIR=str(hold))}
    with open(tmp_path / "out.log", "w") as log:  # a file, not a pipe: orphaned ranks would hold a pipe open
        proc = subprocess.Popen([sys.executable, "-m", "repro.cli", "train", TINY, "--nproc", "2",
                                 *sum((["--set", o] for o in over), [])], env=env, stdout=log,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
    deadline = time.time() + 240
    while not all((hold / f"rank{r}").exists() for r in (0, 1)) and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    assert proc.poll() is None and time.time() < deadline, "the ranks never reached step 3"
    return proc, run, [int((hold / f"rank{r}").read_text()) for r in (0, 1)]


def _alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _kill_all(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


# ---- 1: a stop signal to the launcher alone; a SIGKILLed launcher -------------------------------

@pytest.mark.parametrize("signame", ["SIGTERM", "SIGUSR1"])
def test_a_stop_signal_to_the_launcher_alone_checkpoints_every_rank(corpus, tmp_path, signame):
    """`kill PID` of `repro train --nproc 2` (a supervisor signals the main process only): the ranks
    get it, checkpoint at step 3 and exit; the launcher exits 0 with their result, no orphans."""
    proc, run, ranks = _held_train(corpus, tmp_path)
    everyone = _children(proc.pid)
    try:
        proc.send_signal(getattr(signal, signame))
        log = tmp_path / "out.log"
        while "passed on to the ranks" not in log.read_text() and proc.poll() is None:
            time.sleep(0.05)  # the launcher forwarded the signal (or died of it) before the ranks go on
        (tmp_path / "hold" / "go").touch()
        proc.wait(timeout=120)
        out = log.read_text()
        assert proc.returncode == 0, out[-3000:]
        assert "passed on to the ranks" in out
        assert ck.latest_checkpoint(run / "checkpoints").name == "iter_0000003", out[-3000:]
        assert (run / "stopped_by_signal").read_text() == "3"
        assert not [pid for pid in ranks if _alive(pid)]
    finally:
        _kill_all(everyone)


def test_ctrl_c_in_a_terminal_checkpoints_every_rank_and_exits_130(corpus, tmp_path):
    """A terminal's Ctrl-C: SIGINT to every process of the group, the ranks included. The ranks leave it
    to the launcher, which passes it on as SIGTERM: they checkpoint at step 3 and exit; the command
    says it was interrupted, in one line, exit 130. (Each rank took it as a KeyboardInterrupt wherever
    it stood, inside torch.save or a barrier: tracebacks, exit 1, run FAILED and no checkpoint.)"""
    proc, run, ranks = _held_train(corpus, tmp_path)
    everyone = _children(proc.pid)
    try:
        os.killpg(proc.pid, signal.SIGINT)  # the launcher leads its own group (start_new_session)
        log = tmp_path / "out.log"
        while "passed on to the ranks" not in log.read_text() and proc.poll() is None:
            time.sleep(0.05)
        (tmp_path / "hold" / "go").touch()
        proc.wait(timeout=120)
        out = log.read_text()
        assert proc.returncode == 130 and "Traceback" not in out, out[-3000:]
        assert out.rstrip().endswith("interrupted (Ctrl-C)"), out[-3000:]
        assert ck.latest_checkpoint(run / "checkpoints").name == "iter_0000003", out[-3000:]
        assert (run / "stopped_by_signal").read_text() == "3"
        assert not [pid for pid in ranks if _alive(pid)]
    finally:
        _kill_all(everyone)


def _stop_handlers() -> tuple[bool, bool]:
    from repro.train.signals import PendingStop

    return (signal.getsignal(signal.SIGINT) is signal.SIG_IGN,
            all(isinstance(signal.getsignal(s), PendingStop) for s in (signal.SIGTERM, signal.SIGUSR1)))


def test_ranks_of_a_forwarding_launch_take_stop_signals_from_their_first_line():
    """With forward_signals (`repro train --nproc N`) a rank ignores SIGINT and records SIGTERM and SIGUSR1
    from before it joins its group: a stop forwarded in the first seconds killed ranks still starting
    ("ended without a result (exit code -15)"). Without forwarding, ranks keep the default handlers."""
    assert run_ranks(_stop_handlers, 2, timeout=60, forward_signals=True) == [(True, True)] * 2
    with _sigint(signal.default_int_handler):
        assert run_ranks(_stop_handlers, 2, timeout=60) == [(False, False)] * 2


@contextlib.contextmanager
def _sigint(handler):
    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def test_ranks_ignore_sigint_as_their_launcher_does_at_each_launch():
    """A job started in the background of a script ignores SIGINT (the tests under `nohup ... &`): its
    ranks ignore it too, and a later launch that does not ignore it gets ranks that do not, whichever
    the fork server saw at the first launch (one test failed in such a run: ranks ignored SIGINT)."""
    with _sigint(signal.SIG_IGN):
        assert run_ranks(_stop_handlers, 2, timeout=60) == [(True, False)] * 2
    with _sigint(signal.default_int_handler):
        assert run_ranks(_stop_handlers, 2, timeout=60) == [(False, False)] * 2


def test_the_ranks_die_with_a_sigkilled_launcher(corpus, tmp_path):
    """A SIGKILLed launcher (the OOM killer, kill -9) takes its ranks with it: none trains on."""
    proc, _run, ranks = _held_train(corpus, tmp_path)
    everyone = _children(proc.pid)
    try:
        proc.kill()
        proc.wait(timeout=30)
        deadline = time.time() + 20
        while any(_alive(pid) for pid in ranks) and time.time() < deadline:
            time.sleep(0.1)
        assert not [pid for pid in ranks if _alive(pid)], "ranks outlived their launcher"
    finally:
        _kill_all(everyone)


# ---- 2: a rank killed by a signal is the one named -----------------------------------------------

def _one_rank_dies() -> int:
    """Rank 1 is SIGKILLed; rank 0 waits for it in a barrier (and fails there)."""
    if dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()
    return 0


def test_a_killed_rank_is_named_not_the_survivor_that_lost_it():
    with pytest.raises(RuntimeError) as err:
        run_ranks(_one_rank_dies, 2, timeout=60)
    assert str(err.value).startswith("rank 1 of _one_rank_dies ended without a result (exit code -9)"), err.value


# ---- 3: a full disk while saving a checkpoint ----------------------------------------------------

# Every process: torch.save of the file named by FULL_AT writes to /dev/full (each write: ENOSPC).
_FULL_DISK_AT = """
import os

if os.environ.get("FULL_AT"):
    import torch

    real, target = torch.save, os.environ["FULL_AT"]

    def save(obj, f, *args, **kwargs):
        if target not in str(f if isinstance(f, (str, os.PathLike)) else getattr(f, "name", "")):
            return real(obj, f, *args, **kwargs)
        if isinstance(f, (str, os.PathLike)):
            return real(obj, "/dev/full", *args, **kwargs)
        with open("/dev/full", "wb") as full:
            return real(obj, full, *args, **kwargs)

    torch.save = save
"""


def test_a_full_disk_during_a_checkpoint_is_a_clear_error(corpus, tmp_path):
    run = tmp_path / "run"
    over = tiny_overrides(corpus, run, **{"parallel.tp": 2, "train.train_iters": 4, "train.save_interval": 2})
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           **_with_site(tmp_path / "site", _FULL_DISK_AT, FULL_AT="iter_0000004.tmp/optim_tp01")}
    done = subprocess.run([sys.executable, "-m", "repro.cli", "train", TINY, "--nproc", "2",
                           *sum((["--set", o] for o in over), [])], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 2, done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    assert "No space left on device" in done.stderr and str(run / "checkpoints") in done.stderr
    assert "still points to the last good checkpoint, iter_0000002" in done.stderr
    assert ck.latest_checkpoint(run / "checkpoints").name == "iter_0000002"


# ---- 4: a full disk while preparing data or appending an evaluation record ----------------------

class _FullDisk:
    """A file on a disk with `room` bytes left: a write past them writes what fits, then fails with
    ENOSPC, and so does close (a real full disk's flush)."""

    def __init__(self, handle, room: int) -> None:
        self.handle, self.room, self.failed = handle, room, False

    def write(self, data) -> int:
        size = len(memoryview(data).cast("B")) if not isinstance(data, str) else len(data)
        if size > self.room:
            self.handle.write(data[:self.room] if isinstance(data, str) else bytes(memoryview(data).cast("B"))[:self.room])
            self.room, self.failed = 0, True
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.room -= size
        return self.handle.write(data)

    def close(self) -> None:
        self.handle.close()
        if self.failed:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __getattr__(self, name):
        return getattr(self.handle, name)


def _full_open(match: str, room: int):
    """builtins.open, but a file whose name contains `match`, opened to write, has `room` bytes left."""
    import builtins

    real = builtins.open

    def fake(file, mode="r", *args, **kwargs):
        handle = real(file, mode, *args, **kwargs)
        return _FullDisk(handle, room) if match in str(file) and set(mode) & set("wa") else handle
    return fake


def test_a_full_disk_during_prepare_is_a_data_error_and_leaves_no_temporary_file(data_dir, tmp_path, monkeypatch):
    from repro.data import indexed_dataset
    from repro.data.errors import DataError
    from repro.data.filters import FilterOptions
    from repro.data.preprocess import PrepareOptions, prepare

    monkeypatch.setattr(indexed_dataset, "open", _full_open(".bin.tmp", 4096), raising=False)
    with pytest.raises(DataError, match="No space left on device") as err:
        prepare(PrepareOptions(input=data_dir / "wikitext" / "wikitext-2.valid.tokens", output_prefix=str(tmp_path / "a"),
                               data_dir=data_dir, workers=1, progress=False,
                               filters=FilterOptions(min_tokens=0, dedup=False, eval_overlap=False)))
    assert str(tmp_path) in str(err.value) and "Fix:" in str(err.value)
    assert not [p.name for p in tmp_path.iterdir() if "tmp" in p.name]


def test_a_full_disk_while_appending_an_eval_record_keeps_the_earlier_ones(tmp_path, monkeypatch):
    import builtins

    from repro.cli import UserError
    from repro.eval.report import EvalRecord, read_records, write_json

    out = tmp_path / "zs.jsonl"
    record = EvalRecord(task="wikitext", metrics={"word_ppl": 30.5}, params={"window": 64})
    write_json(record, out)
    monkeypatch.setattr(builtins, "open", _full_open("zs.jsonl", 10))
    with pytest.raises(UserError, match="No space left on device"):
        write_json(record, out)
    monkeypatch.undo()
    assert out.read_text().count("\n") == 1 and len(read_records(out)) == 1


# ---- 5: a dataset left half swapped by a killed `prepare --overwrite` ---------------------------

def test_a_split_that_disagrees_with_its_prepare_record_is_refused(corpus, tmp_path):
    import json
    import shutil

    from repro.data.errors import DataError
    from repro.data.gpt_dataset import GPTDataset

    prefix = Path(corpus["train"]).with_name("wiki")
    for path in Path(prefix).parent.glob("wiki_*"):
        shutil.copy(path, tmp_path / path.name)
    record_path = tmp_path / "wiki_prepare.json"
    record = json.loads(record_path.read_text())
    key = next(k for k in record["report"]["outputs"] if k.endswith("_train"))
    record["report"]["outputs"][key] += 7  # the record of another prepare than the split's
    record_path.write_text(json.dumps(record))
    with pytest.raises(DataError, match=r"repro data verify .*--overwrite"):
        GPTDataset(tmp_path / "wiki_train", 64, cache_dir=tmp_path)
    GPTDataset(tmp_path / "wiki_valid", 64, cache_dir=tmp_path)  # a split that agrees opens


# ---- 6: staging folders of killed `repro report`s ------------------------------------------------

def test_a_killed_reports_staging_folder_is_removed_a_running_ones_kept(tmp_path, capsys):
    from repro.analysis.commands import remove_stale_staging

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (tmp_path / f".report-{dead.pid}-abc").mkdir()
    (tmp_path / ".report-xyz").mkdir()  # an older report's name
    (tmp_path / f".report-{os.getpid()}-def").mkdir()
    remove_stale_staging(tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == [f".report-{os.getpid()}-def"]
    assert capsys.readouterr().out.count("note: removed") == 2
    ignore = (Path(__file__).resolve().parents[1] / ".gitignore").read_text().splitlines()
    assert ".report-*/" in ignore


def test_a_full_disk_in_any_command_is_one_line_with_the_fix(capsys):
    """An ENOSPC no command translated itself (here a real one: /dev/full) ends the command with exit 2
    and one line naming it and the fix, not a traceback."""
    import argparse

    from repro.cli import _run_command

    def write_to_full_disk(_args):
        Path("/dev/full").write_bytes(b"x" * 4096)

    assert _run_command(argparse.Namespace(func=write_to_full_disk)) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: No space left on device") and "Fix: free space" in err and len(err.splitlines()) == 1


# ---- 7: a stop signal while `repro report` runs a notebook ---------------------------------------

_REPORT = """
import sys
from pathlib import Path
import nbformat
from repro.analysis import commands, notebook

root, out = Path(sys.argv[1]), Path(sys.argv[2])
cells = [nbformat.v4.new_code_cell("tracking_uri = out_dir = bench_dir = None", metadata={"tags": ["parameters"]}),
         nbformat.v4.new_code_cell(f"import os, time\\nfrom pathlib import Path\\n"
                                   f"Path({str(root / 'kernel.pid')!r}).write_text(str(os.getpid()))\\ntime.sleep(120)")]
nb = nbformat.v4.new_notebook(cells=cells)
nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
(root / "analysis").mkdir(parents=True)
nbformat.write(nb, root / "analysis" / "scaling.ipynb")
notebook.project_root = lambda: root
commands._stoppable_report("sqlite:///unused.db", out, ("scaling",))
"""


@pytest.mark.parametrize("signame, kernel_too", [("SIGTERM", False), ("SIGUSR1", False), ("SIGTERM", True)],
                         ids=["TERM-to-the-report", "USR1-to-the-report", "TERM-to-the-report-and-its-kernel"])
def test_a_stop_signal_during_a_notebook_ends_the_report_in_one_line(tmp_path, signame, kernel_too):
    """A real kernel running a cell: the report exits 128 + signal with its one "stopped" line, the
    last report's tables untouched, no staging folder, no kernel left. The kernel runs in its own
    session, so `kernel_too` signals it as well, as scancel does every process of a step. TERM used
    to exit 1 after three tracebacks (nbclient's own TERM handler shut the kernel down under the cell,
    then its cleanup failed), USR1 to leave the kernel printing a zmq traceback."""
    root, out = tmp_path / "checkout", tmp_path / "out"
    out.mkdir()
    (out / "scaling_table.md").write_text("the last report's")
    report = subprocess.Popen([sys.executable, "-c", _REPORT, str(root), str(out)], stderr=subprocess.PIPE, text=True,
                              start_new_session=True)
    deadline = time.monotonic() + 120
    while not (root / "kernel.pid").exists() or not (root / "kernel.pid").read_text():
        assert report.poll() is None and time.monotonic() < deadline, report.stderr.read()
        time.sleep(0.1)
    kernel, sig = int((root / "kernel.pid").read_text()), getattr(signal, signame)
    for pid in (report.pid, kernel) if kernel_too else (report.pid,):
        os.kill(pid, sig)
    err = report.communicate(timeout=60)[1]
    assert report.returncode == 128 + sig, err
    assert f"repro report stopped by {signame}" in err and "Traceback" not in err and "Error" not in err, err
    assert [p.name for p in out.iterdir()] == ["scaling_table.md"]
    assert (out / "scaling_table.md").read_text() == "the last report's"
    deadline = time.monotonic() + 10  # (the kernel is its report's child: gone once the report reaped it)
    while Path(f"/proc/{kernel}").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not Path(f"/proc/{kernel}").exists(), f"kernel {kernel} outlived its report"


def test_a_notebook_run_leaves_the_callers_stop_handlers_in_place(tmp_path):
    """nbclient sets SIGTERM back to its default action when a notebook ends: a TERM between two
    notebooks then killed the report without removing its staging folder."""
    import nbformat

    from repro.analysis.notebook import execute

    path = tmp_path / "n.ipynb"
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("x = 1")])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, path)

    def handler(signum, frame):
        raise AssertionError("not called")

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGUSR1)}
    try:
        execute(path, {})
        assert signal.getsignal(signal.SIGTERM) is handler and signal.getsignal(signal.SIGUSR1) is handler
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def test_a_ctrl_c_while_a_dataset_or_report_is_published_waits_for_the_last_rename():
    """SIGINT inside `stop_signals_deferred` (the renames that publish a dataset or a report's tables)
    is raised as the block ends: a KeyboardInterrupt between two renames left new and old files mixed."""
    from repro.train.signals import stop_signals_deferred

    renamed = []
    with _sigint(signal.default_int_handler):  # (a suite started in the background ignores SIGINT)
        with pytest.raises(KeyboardInterrupt):
            with stop_signals_deferred():
                signal.raise_signal(signal.SIGINT)
                renamed.append("the last one")
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    assert renamed == ["the last one"]


def _interrupted(_args):
    raise KeyboardInterrupt


def _cleanup_fails_after_an_interrupt(_args):
    try:
        raise KeyboardInterrupt
    except KeyboardInterrupt:
        raise AssertionError("assert self.km is not None")  # nbclient's cleanup after a Ctrl-C in `repro report`


@pytest.mark.parametrize("handler", [_interrupted, _cleanup_fails_after_an_interrupt])
def test_a_command_stopped_by_ctrl_c_says_so_in_one_line_and_exits_130(handler, capsys):
    """Ctrl-C ended every command in a traceback (20 to 200 lines; `repro report` in nbclient's
    AssertionError), with exit 1 or killed by the signal; now one line, exit 130."""
    import argparse

    from repro.cli import _run_command

    assert _run_command(argparse.Namespace(func=handler)) == 130
    assert capsys.readouterr().err.strip() == "interrupted (Ctrl-C)"
