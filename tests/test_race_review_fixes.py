"""`repro finetune race` after a review: a restart of a stopped seed with other settings, shuffle orders
shared by consecutive seeds, the batch/lr missing from the params, a second stop that lowered the
logged step, repeated or out-of-range --seeds and a --run-dir under a file."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pandas as pd
import pytest

from repro.cli import main
from test_race import write_fixture_vocab
from test_race_inputs_review import TINY_YAML, _argv, _refused

MAX_SEED = 2**63 - 1


@pytest.fixture(scope="module")
def vocab(tmp_path_factory) -> Path:
    return write_fixture_vocab(tmp_path_factory.mktemp("vocab") / "vocab.txt")


def _tiny(vocab: Path, run_dir: Path, *extra: str) -> list[str]:
    return _argv(vocab, run_dir, "--model-config", str(TINY_YAML), *extra)


def _stopped_run(argv: list[str]) -> None:
    """`argv` run with Slurm's warning (SIGUSR1) already received: it stops after its first step, exit 0."""
    from repro.train.signals import recording_stop_signals

    with recording_stop_signals() as pending:
        signal.raise_signal(signal.SIGUSR1)
        assert pending.received == signal.SIGUSR1
        assert main(argv) == 0


def _files(run_dir: Path) -> dict[str, bytes]:
    return {str(p.relative_to(run_dir)): p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}


def _stopped_json(run_dir: Path) -> dict:
    return json.loads((run_dir / "seeds" / "stopped.json").read_text())


def test_a_restart_of_a_stopped_seed_with_other_settings_is_refused(tmp_path, vocab, capsys):
    """stopped.json held only {seed, step}: a restart at another --lr redid the seed, mixing two
    configurations in its curve and MLflow run. Now refused as for a finished seed."""
    run = tmp_path / "run"
    argv = _tiny(vocab, run, "--seeds", "1", "--lr", "1e-3")
    _stopped_run(argv)
    stopped = _stopped_json(run)
    assert stopped["seed"] == 1 and stopped["step"] == 1
    before = _files(run)
    err = _refused(_tiny(vocab, run, "--seeds", "1", "--lr", "2e-3"), capsys, "other settings (lr differ)",
                   "stopped.json", "--run-dir")
    assert "seed 1 (stopped at step 1)" in err
    assert _files(run) == before  # nothing run, nothing logged
    assert stopped["settings"]["lr"] == 1e-3
    assert main(argv) == 0 and (run / "results.json").is_file()  # the same settings go on


def test_consecutive_seeds_shuffle_each_epoch_differently():
    """The order was randperm(seed + epoch): seed s's epoch e+1 was seed s+1's epoch e, so the default
    seeds 1234..1238 shared 2 of their 3 epoch orders."""
    from repro.eval.race_finetune import epoch_order

    orders = {(s, e): epoch_order(200, s, e).tolist() for s in range(1234, 1239) for e in range(3)}
    assert orders[(1234, 1)] != orders[(1235, 0)] and orders[(1234, 2)] != orders[(1236, 0)]
    assert len({tuple(o) for o in orders.values()}) == len(orders)
    assert all(sorted(o) == list(range(200)) for o in orders.values())
    assert epoch_order(200, 1235, 2).tolist() == orders[(1235, 2)]  # a resume draws the same order
    assert epoch_order(200, MAX_SEED, 0).tolist() != epoch_order(200, MAX_SEED - 1, 1).tolist()


def test_the_batch_size_lr_and_qa_tokens_are_run_params(tmp_path, vocab):
    """params.json (and MLflow's params) lacked them: a run at another lr could not be told apart."""
    run = tmp_path / "run"
    assert main(_tiny(vocab, run, "--seeds", "1", "--lr", "1e-3", "--max-qa-tokens", "16")) == 0
    params = json.loads((run / "params.json").read_text())
    assert {k: params.get(k) for k in ("batch_size", "lr", "max_qa_tokens", "warmup_fraction", "weight_decay")} \
        == {"batch_size": 5, "lr": 1e-3, "max_qa_tokens": 16, "warmup_fraction": 0.06, "weight_decay": 0.1}


def test_the_bert_table_prefers_a_run_at_the_papers_batch_and_lr():
    """A newer five-seed run at lr 1e-4 took bert-336m's row from the one at the paper's 32 / 2e-5."""
    from repro.analysis import bert

    shape = {"params.task": "race", "params.device_type": "cuda", "params.device_name": "G",
             "params.size": "bert-336m", "params.num_layers": "24", "params.hidden_size": "1024",
             "params.num_attention_heads": "16", "params.seq_length": "512", "params.seeds": "1 2 3 4 5"}
    tuned = dict(shape, run_id="tuned", **{"params.batch_size": "64", "params.lr": "0.0001",
                                           "metrics.test/acc_total": 90.0})
    paper = dict(shape, run_id="paper", **{"params.batch_size": "32", "params.lr": "2e-05",
                                           "metrics.test/acc_total": 83.0})
    rows = bert.race_runs(pd.DataFrame([tuned, paper]))  # newest first, as load_runs orders them
    assert [(r["run_id"], r["race_total"]) for r in rows] == [("paper", 83.0)]
    assert "batch" not in rows[0]["label"]
    alone = bert.race_runs(pd.DataFrame([tuned]))[0]
    assert alone["run_id"] == "tuned" and "batch 64, lr 0.0001 (not the paper's 32, 2e-05)" in alone["label"]


def test_a_second_stop_earlier_than_the_first_keeps_the_logged_step(tmp_path, vocab):
    """An earlier launch stopped seed 1 at step 50 (steps 10..50 logged); this one stops at step 1:
    stopped.json said 1, and the next launch logged steps 10..50 a second time."""
    run = tmp_path / "run"
    argv = _tiny(vocab, run, "--seeds", "1", "--epochs", "30")  # 10 questions / batch 5: 60 steps
    (run / "seeds").mkdir(parents=True)
    (run / "seeds" / "stopped.json").write_text(json.dumps({"seed": 1, "step": 50}))
    _stopped_run(argv)
    assert _stopped_json(run)["step"] == 50
    assert main(argv) == 0
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "seed1/train/loss" in r] == [60]


def test_repeated_seeds_are_refused(tmp_path, vocab, capsys):
    """--seeds 7 7 7 ran seed 7 three times and reported the median of 3 seeds."""
    run = tmp_path / "run"
    _refused(_tiny(vocab, run, "--seeds", "7", "8", "7", "7"), capsys, "--seeds repeats 7:", "each seed once")
    assert not run.exists()


@pytest.mark.parametrize("seed", ["99999999999999999999", str(MAX_SEED + 1), "-1"])
def test_a_seed_out_of_range_is_refused_before_any_work(tmp_path, vocab, capsys, seed):
    """99999999999999999999 was an OverflowError traceback after the data was loaded (a missing
    --race-dir here shows the check comes first)."""
    run = tmp_path / "run"
    argv = _tiny(vocab, run, "--seeds", "1", seed) + ["--race-dir", str(tmp_path / "missing")]
    err = _refused(argv, capsys, f"--seeds {seed} is out of range", str(MAX_SEED))
    assert "missing" not in err and not run.exists()


def test_the_largest_seed_runs(tmp_path, vocab):
    """2**63-1 is accepted and runs to the end: its seed file, results.json and metrics name that seed
    exactly (JSON keeps the integer; a float would round it to 2**63), with its 2 steps' losses."""
    import math

    run = tmp_path / "run"
    assert main(_tiny(vocab, run, "--seeds", str(MAX_SEED))) == 0
    saved = json.loads((run / "seeds" / f"seed_{MAX_SEED}.json").read_text())
    assert saved["seed"] == MAX_SEED and isinstance(saved["seed"], int)
    assert len(saved["losses"]) == 2 and all(math.isfinite(x) and x > 0 for x in saved["losses"])
    results = json.loads((run / "results.json").read_text())
    assert results["median_seed"] == MAX_SEED and [r["seed"] for r in results["seeds"]] == [MAX_SEED]
    assert results["median"] == saved["accuracy"] and results["seeds"][0]["final_loss"] == saved["losses"][-1]
    assert set(saved["accuracy"]) == {"dev", "test"}
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert any(f"seed{MAX_SEED}/dev/acc_total" in r for r in rows)
    assert not (run / "seeds" / "stopped.json").exists()


@pytest.mark.parametrize("under", ["", "sub/run"], ids=["is-a-file", "under-a-file"])
def test_a_run_dir_at_or_under_a_file_is_refused_before_any_work(tmp_path, vocab, capsys, under):
    """A NotADirectoryError traceback after the data was loaded."""
    blocking = tmp_path / "file"
    blocking.write_text("x")
    run = blocking / under if under else blocking
    argv = _tiny(vocab, run, "--seeds", "1") + ["--race-dir", str(tmp_path / "missing")]
    err = _refused(argv, capsys, f"--run-dir {run}", f"{blocking} is not a directory")
    assert "missing" not in err and blocking.read_text() == "x"
