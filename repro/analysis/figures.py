"""The paper's figures redrawn from runs: paper values in black, analytic model in grey/blue, measured in red."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from repro.analysis import runs as R


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: Path) -> Path:
    """PNG written atomically: a reader never sees half a figure."""
    import io

    from repro.provenance import write_atomic

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=120)
    _plt().close(fig)
    write_atomic(path, buf.getvalue())
    return path


def _measured(table: pd.DataFrame) -> pd.DataFrame:
    """The measured rows a figure draws: not the other runs of a paper point (`another_run`), which
    the table lists below the one its row shows."""
    if "run_id" not in table:
        return table.iloc[0:0]
    drawn = table["run_id"].notna() & (table["run_id"].astype(str) != "")
    return table[drawn & ~_other_runs(table)]


def _other_runs(table: pd.DataFrame) -> pd.Series:
    return table["another_run"].eq(True) if "another_run" in table else pd.Series(False, index=table.index)


def _other_runs_note(table: pd.DataFrame) -> str:
    count = int(_other_runs(table).sum())
    return f"{count} other run(s) of paper points not drawn (see table)" if count else ""


def _gpu_ticks(ax) -> None:
    ax.set_xscale("log", base=2)
    ticks = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]
    ax.set_xticks(ticks, [str(t) for t in ticks])


def _efficiency_panel(ax, table: pd.DataFrame) -> None:
    paper = table[table["paper_efficiency"].notna()] if "paper_efficiency" in table else table.iloc[0:0]
    for mode, style in (("TP", "s-"), ("TP+DP", "o--")):
        part = paper[paper["mode"] == mode]
        ax.plot(part["gpus"], 100 * part["paper_efficiency"], style, color="black", label=f"paper, {mode} (V100)")
    for col, color, name in (("model_dgx2h", "grey", "analytic model, DGX-2H"), ("model_h200", "tab:blue", "analytic model, H200 cluster")):
        if col in paper and paper[col].notna().any():
            ax.plot(paper["gpus"], 100 * paper[col], "x", color=color, markersize=8, label=name)
    meas = _measured(table)
    meas = meas[meas["efficiency"].notna()] if len(meas) else meas
    keys = []
    for i, (_, m) in enumerate(meas.iterrows(), start=1):
        ax.plot(m["gpus"], 100 * m["efficiency"], "*", color="red", markersize=12,
                label="measured (key at lower right)" if i == 1 else None)
        ax.annotate(str(i), (m["gpus"], 100 * m["efficiency"]), fontsize=7, color="red", textcoords="offset points",
                    xytext=(7, 3))
        keys.append(f"{i}: {m['label'].split(',')[0]}: {m['config']}, TP {int(m['tp'])} x DP {int(m['dp'])}")
    keys += [note for note in (_other_runs_note(table),) if note]
    if keys:  # a key in the empty lower right, not labels over the points and the paper's curve
        ax.text(0.98, 0.03, "\n".join(keys), transform=ax.transAxes, fontsize=6, color="red", ha="right", va="bottom",
                bbox=dict(facecolor="white", edgecolor="red", alpha=0.8, linewidth=0.5))
    _gpu_ticks(ax)
    ax.set(xlabel="number of devices (GPUs; CPU ranks for CPU runs)", ylabel="weak-scaling efficiency (%)",
           title="Fig. 5: scaling efficiency vs 1-device baseline", ylim=(0, 115))
    ax.legend(fontsize=7, loc="lower left")
    ax.grid(alpha=0.3)


def _aggregate_panel(ax, table: pd.DataFrame) -> None:
    paper = table[table["paper_efficiency"].notna()] if "paper_efficiency" in table else table.iloc[0:0]
    for mode, style in (("TP", "s-"), ("TP+DP", "o--")):
        part = paper[paper["mode"] == mode]
        ax.plot(part["gpus"], part["paper_pflops"], style, color="black", label=f"paper, {mode} (39 TFLOP/s x eff x GPUs)")
    meas = _measured(table)
    gpu = meas[~meas["label"].str.startswith("CPU")] if len(meas) else meas
    if len(gpu):
        ax.plot(gpu["gpus"], gpu["aggregate_pflops"], "*", color="red", markersize=12, label="measured (GPU)")
    cpu = len(meas) - len(gpu)
    notes = [f"{cpu} CPU run(s) not drawn here\n(~1e-5 PFLOP/s; see table)"] * bool(cpu) + [_other_runs_note(table)]
    if any(notes):
        ax.text(0.02, 0.97, "\n".join(n for n in notes if n), transform=ax.transAxes, fontsize=7, va="top",
                color="red")
    _gpu_ticks(ax)
    ax.set_yscale("log")
    ax.set(xlabel="number of GPUs", ylabel="aggregate PFLOP/s", title="Fig. 1: aggregate throughput")
    ax.legend(fontsize=7, loc="lower right")
    ax.grid(alpha=0.3, which="both")


def plot_scaling(table: pd.DataFrame, path: Path) -> Path:
    """Fig. 5 (efficiency) and Fig. 1 (aggregate PFLOP/s): paper, analytic model and measured."""
    fig, axes = _plt().subplots(1, 2, figsize=(12, 4.8))
    _efficiency_panel(axes[0], table)
    _aggregate_panel(axes[1], table)
    return _save(fig, path)


def plot_curves(curves: dict[str, pd.DataFrame], path: Path, ylabel: str, title: str, log_y: bool = False,
                reference: tuple[float, str] | None = None, empty_note: str = "no measured runs") -> Path:
    """Measured curves (step, value) per label; an optional horizontal paper reference in black."""
    import textwrap

    fig, ax = _plt().subplots(figsize=(7.5, 5))
    for label, frame in curves.items():
        ax.plot(frame["step"], frame["value"], marker="." if len(frame) < 30 else None,
                label=textwrap.fill(f"measured: {label}", 80))
    if reference:
        ax.axhline(reference[0], color="black", linestyle="--", label=reference[1])
    if not curves:
        ax.text(0.5, 0.5, empty_note, transform=ax.transAxes, ha="center", va="center", color="red")
    if log_y:
        ax.set_yscale("log")
    ax.set(xlabel="iteration", ylabel=ylabel, title=title)
    ax.title.set_fontsize(9)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)
    ax.grid(alpha=0.3, which="both")
    return _save(fig, path)


def short_label(row) -> str:
    """Run name, label, status when not FINISHED and short run id for a legend entry."""
    status = R.get(row, "status", "FINISHED")
    unfinished = "" if status == "FINISHED" else f"; {status.lower()} (unfinished run)"
    return f"{R.get(row, 'run_name', '?')} [{R.run_label(row)}{unfinished}; run {str(row['run_id'])[:8]}]"
