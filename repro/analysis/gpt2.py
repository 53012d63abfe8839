"""Table 2: GPT-2 training time per epoch, from the logged GPT-2 runs (experiment "gpt2").

One epoch is 68,507 iterations of 512 x 1024 tokens (PAPER.md §3). A run's days per epoch are its
median logged `ms_per_iter` (the first interval of every launch dropped as warm-up, as for Table 1) times
the iterations the epoch's tokens take at its global batch and sequence length (68,507 at 512 x 1024),
plus the evaluation and checkpoint time an epoch carries at the run's intervals (mean logged
`eval_seconds` x those iterations / eval_interval, the same for `save_seconds`). Runs take weeks, so
unfinished runs count, with their status in the label; per paper model the run at the paper's GPU
count and global batch that logged an interval after warm-up, FINISHED or RUNNING before FAILED or
KILLED, then the newest (_rank).
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from repro.analysis import runs as R
from repro.analysis.paper import paper_items, paper_value, paper_values
from repro.analysis.tables import NOT_RUN, fmt, write_table
from repro.data.summary import PAPER_ITERS_PER_EPOCH
from repro.perf.plan import GPT2_RUNS


PAPER_BATCH, PAPER_SEQ = 512, 1024  # the sequences of one iteration and their length (PAPER.md §3)


def epoch_iterations(run) -> float:
    """Iterations a run takes for the paper's epoch of 68,507 x 512 x 1024 tokens at its logged global
    batch and sequence length (the paper's where it logged none)."""
    batch = float(R.get(run, "params.train.global_batch_size", PAPER_BATCH))
    seq = R.logged_shape(run)["seq_length"] or PAPER_SEQ
    return PAPER_ITERS_PER_EPOCH * PAPER_BATCH * PAPER_SEQ / (batch * seq)


def _paper_batch(run) -> bool:
    """The run's global batch is the paper's 512 (or was not logged)."""
    return float(R.get(run, "params.train.global_batch_size", PAPER_BATCH)) == PAPER_BATCH


def _mean(history: pd.DataFrame) -> float:
    return float(history["value"].mean()) if len(history) else 0.0


def epoch_days(uri: str, run) -> dict:
    """A run's iteration time and days per epoch (training steps alone, and with its evaluations and
    saves at its own intervals); NaN days when it logged no interval yet. `steady`: it logged an
    interval after warm-up (else its time is a warm-up interval's). A run resumed on another layout:
    its last launch only (R.launch_history), the layout its row shows."""
    hist, warmup = R.launch_history(uri, run, "ms_per_iter")
    ms, iterations = R.median_after_warmup(hist, warmup), epoch_iterations(run)
    steps_days = ms * iterations / 86_400_000
    overhead_s = 0.0
    for metric, interval in (("eval_seconds", "train.eval_interval"), ("save_seconds", "train.save_interval")):
        every = float(R.get(run, f"params.{interval}", 0) or 0)
        if every > 0:
            overhead_s += _mean(R.launch_history(uri, run, metric)[0]) * iterations / every
    return {"ms_per_iter": ms, "days_steps": steps_days, "days_per_epoch": steps_days + overhead_s / 86_400,
            "steady": bool(len(R.after_warmup(hist, warmup)))}


def _label(run, days: dict) -> str:
    status = R.get(run, "status", "FINISHED")
    batch = "" if _paper_batch(run) else f", global batch {int(float(run['params.train.global_batch_size']))}"
    warm = ", warm-up interval only" if pd.notna(days["days_per_epoch"]) and not days["steady"] else ""
    resumed = ", layout changed at resume: its last launch only" if R.layout_changed(run) else ""
    return (R.run_label(run) + batch + ("" if status == "FINISHED" else f", {status.lower()} (unfinished run)")
            + resumed + warm)


def _measured_row(uri: str, run) -> dict:
    days = epoch_days(uri, run)
    return {"gpus": int(R.get(run, "params.world_size", 0) or 0), **days, "label": _label(run, days),
            "provenance": R.provenance(run), "run_id": run["run_id"], "status": R.get(run, "status", "FINISHED")}


def _rank(row: dict) -> tuple[bool, bool, bool]:
    """How a paper row ranks its candidate runs: an interval logged after warm-up, then a FINISHED or
    RUNNING run before a FAILED or KILLED one, then any interval logged (warm-up only)."""
    return row["steady"], row["status"] in ("FINISHED", "RUNNING"), pd.notna(row["days_per_epoch"])


def build(tracking_uri: str, experiment: str = "gpt2") -> pd.DataFrame:
    """Paper rows (each with its run of that size at the paper's GPU count and global batch that ranks
    first by _rank, the newest among equals, or not run), then the other GPT-2 runs (other GPU counts,
    reduced shapes, attempts not shown in a paper row) with their own days per epoch."""
    paper, runs = paper_values(), R.load_runs(tracking_uri, experiment, finished_only=False)
    rows, used = [], set()
    for item in paper_items(paper, "gpt2"):
        row = {"model": item, "paper_gpus": GPT2_RUNS[item],
               "paper_days_per_epoch": paper_value(paper, "gpt2", item, "days_per_epoch")}
        matching = [(index, _measured_row(tracking_uri, run)) for index, run in runs.iterrows()  # newest first
                    if R.paper_size(run) == item and int(R.get(run, "params.world_size", 0) or 0) == GPT2_RUNS[item]
                    and _paper_batch(run)]
        # a newer attempt that failed at start, or in its warm-up interval, does not hide a measurement
        if matching:
            index, best = max(matching, key=lambda m: _rank(m[1]))  # the first of equals: the newest
            row.update(best)
            used.add(index)
        rows.append(row)
    for index, run in runs.iterrows():
        if index not in used:
            rows.append({"model": R.paper_size(run) or f"custom {R.shape_text(run)}", **_measured_row(tracking_uri, run)})
    return pd.DataFrame(rows)


def display(table: pd.DataFrame) -> pd.DataFrame:
    """Paper and measured days per epoch side by side."""
    rows = []
    for _, r in table.iterrows():
        ran = R.get(r, "run_id") is not None
        days = R.get(r, "days_per_epoch")
        measured = fmt(days) if days is not None else "no interval logged yet"
        rows.append([r["model"], fmt(R.get(r, "paper_gpus"), 0) if R.get(r, "paper_gpus") else "—",
                     fmt(R.get(r, "paper_days_per_epoch")) if R.get(r, "paper_days_per_epoch") else "—",
                     fmt(R.get(r, "gpus"), 0) if ran else NOT_RUN, measured if ran else NOT_RUN,
                     fmt(R.get(r, "days_steps")) if ran and days is not None else "",
                     fmt(R.get(r, "ms_per_iter"), 0) if ran and days is not None else "",
                     R.get(r, "label", ""), R.get(r, "provenance", "")])
    return pd.DataFrame(rows, columns=["model", "paper GPUs", "paper days/epoch", "measured GPUs",
                                       "measured days/epoch", "of which training steps", "ms/iter",
                                       "measured on", "provenance"])


def report(tracking_uri: str, out_dir: str | Path, experiment: str = "gpt2") -> str:
    """Write gpt2_table2.{csv,md}; return the Markdown."""
    table = build(tracking_uri, experiment)
    notes = [f"Measured days/epoch: median logged ms/iter (the first interval of every launch dropped; a run "
             f"resumed on another GPU count or batch: its last launch only) x {PAPER_ITERS_PER_EPOCH:,} "
             f"iterations (the paper's epoch of {PAPER_ITERS_PER_EPOCH:,} x {PAPER_BATCH} x {PAPER_SEQ:,} tokens; "
             "a run at another global batch or sequence length: the iterations those tokens take it), plus the "
             "mean logged evaluation and checkpoint seconds x the evaluations and saves an epoch holds at the "
             "run's eval_interval and save_interval. The paper does not say what its days include.",
             "Per paper model, the run of that size at the paper's GPU count and global batch (512) that logged "
             "an interval after warm-up, FINISHED or RUNNING before FAILED or KILLED, then the newest; "
             "unfinished runs count (weeks long), labelled with their status. Other GPT-2 runs follow with their "
             "own GPU count and batch."]
    return write_table(display(table), table, Path(out_dir), "gpt2_table2", "GPT-2 training time (Table 2)",
                       notes, tracking_uri)
