"""Weak scaling (Table 1, Fig. 1 and Fig. 5): TFLOP/s per device, aggregate PFLOP/s, efficiency.

Efficiency is the paper's: sustained FLOP/s per device relative to the 1-device baseline of the
same series (paper: config 1 on one V100 at 39 TFLOP/s). Two devices at 1.9x the one-device
throughput: 1.9 / 2 = 95%. Measured series are (device, precision, baseline model, FLOP count and
recipe: activation checkpointing, parameter precision, torch.compile, ZeRO stage): a run's baseline
is the preferred (_preferred_first) 1-device run with a logged throughput in its series, of config 1
(only) for the paper's scaling configs, else of the same model shape (so a tiny CPU GPT is compared
to itself), with FLOPs counted the same way (hardware FLOPs, or model FLOPs for runs that predate
that metric). Each table point takes a run with a logged throughput, then a steady one (not a
warm-up interval alone, labelled), then one with an efficiency, then its run on the baseline's
device where there is one, a full-length run before a test run cut short, then the newest
(_preferred_first). A run resumed on another layout is measured by its last launch (runs.launch_history).
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from repro.analysis import runs as R
from repro.analysis.paper import paper_value
from repro.analysis.tables import NOT_RUN, fmt, write_table

CONFIGS = ("scaling-1.2b", "scaling-2.5b", "scaling-4.2b", "scaling-8.3b")
MODES = (("TP", "tp"), ("TP+DP", "tpdp"))
HEADS = (("scaling-8.3b-16h", 16), ("scaling-8.3b-24h", 24), ("scaling-8.3b", 32))  # Appendix D Table 7
STRONG_GPUS = (1, 2, 4, 8)  # Appendix D Table 8: the 1.2B model at batch 8 on 1-8 GPUs
SCALING_ITERS = 1000  # experiments/scaling/base.yaml's train.train_iters: a shorter run is a test run


def run_throughput(uri: str, run) -> tuple[float, str, bool]:
    """Sustained TFLOP/s per device counted like the paper's 39 (recomputation included, the 96 form,
    when the run checkpointed: `hw_tflops_per_device`); runs logged before that metric: model FLOPs.
    Also which FLOPs, and whether it is steady (not a warm-up interval alone): R.sustained."""
    hardware, steady = R.sustained(uri, run, "hw_tflops_per_device")
    if hardware == hardware:  # not NaN
        return hardware, "hardware", steady
    model, steady = R.sustained(uri, run, "tflops_per_device")
    return model, "model", steady


def efficiency(per_device_tflops: float, baseline_per_device_tflops: float) -> float:
    """Weak-scaling efficiency: per-device FLOP/s over the 1-device baseline's."""
    if not baseline_per_device_tflops or baseline_per_device_tflops <= 0:
        raise ValueError(f"baseline throughput must be positive, got {baseline_per_device_tflops}")
    return per_device_tflops / baseline_per_device_tflops


def _shape(row) -> str:
    return R.shape_text(row)


def _config(row) -> str:
    """The paper config when the run's logged shape is that config's, else `custom` and the shape."""
    return R.paper_size(row) or f"custom {_shape(row)}"


def measured_points(runs: pd.DataFrame, throughput) -> pd.DataFrame:
    """One row per training run: config, gpus, tp, dp, TFLOP/s per device, label, provenance.

    `throughput(run)` returns the run's sustained TFLOP/s per device, which FLOPs it counts and
    (optionally) whether it is steady, not a warm-up interval alone (run_throughput)."""
    rows = []
    for _, run in runs.iterrows():
        config = _config(run)
        tflops, counted, *steady = throughput(run)
        steady = bool(steady[0]) if steady else True
        rows.append({"config": config, "gpus": int(R.get(run, "params.world_size", 1)),
                     "tp": int(R.get(run, "params.tp", 1)), "dp": int(R.get(run, "params.dp", 1)),
                     "device": R.get(run, "params.device_name", "n/a"),
                     "precision": R.get(run, "params.precision", "n/a"),
                     "baseline_model": "scaling-1.2b" if config.startswith("scaling-") else _shape(run),
                     "recipe": _recipe(run), "batch": _float(R.get(run, "params.train.global_batch_size")),
                     "tflops_per_device": tflops, "flops_counted": counted, "steady": steady,
                     "label": _label(run, config, warmup_only=tflops == tflops and not steady),
                     "train_iters": _float(R.get(run, "params.train.train_iters")),
                     "provenance": R.provenance(run), "run_id": run["run_id"],
                     "start_time": run.get("start_time", 0)})
    return pd.DataFrame(rows)


def _label(run, config: str, warmup_only: bool = False) -> str:
    """run_label, plus the length of a paper config's run cut short (`--set train.train_iters=100`), a
    run whose TP groups spanned hosts (their all-reduces crossed the network: not the paper's layout),
    torch.compile or a ZeRO stage (each its own efficiency series), a resume on another layout (its
    last launch measured) and a throughput of a warm-up interval only."""
    iters = _float(R.get(run, "params.train.train_iters"))
    short = config.startswith("scaling-") and iters < SCALING_ITERS
    across = R.get(run, "params.tp_groups_within_host") == "false"
    zero = str(R.get(run, "params.train.zero_stage", "0"))
    return (R.run_label(run) + (f", test run of {int(iters)} iterations" if short else "")
            + (", TP groups across hosts" if across else "")
            + (", torch.compile" if R.get(run, "params.train.compile") == "True" else "")
            + (f", ZeRO-{zero}" if zero != "0" else "")
            + (", layout changed at resume: its last launch only" if R.layout_changed(run) else "")
            + (", warm-up interval only" if warmup_only else ""))


def _float(value) -> float:
    return float(value) if value is not None else float("nan")


def at_paper_batch(runs: pd.DataFrame) -> pd.DataFrame:
    """Runs at the paper's global batch for their layout: 8 per model replica (Tables 1, 7 and 8:
    8 at TP only, 512 over 64 replicas); a run that logged no batch is kept."""
    if "batch" not in runs or not len(runs):
        return runs
    return runs[runs["batch"].isna() | (runs["batch"] == 8 * runs["dp"])]


def _recipe(run) -> str:
    """What else changes a run's FLOP count or speed per FLOP: activation checkpointing (hardware FLOPs
    count the recomputed forward), the parameters' precision, torch.compile and the ZeRO stage (runs
    that predate those two params ran without them)."""
    return (f"checkpointing {R.get(run, 'params.model.activation_checkpointing', 'n/a')}, "
            f"params {R.get(run, 'params.precision.params', 'n/a')}, "
            f"compile {R.get(run, 'params.train.compile', 'False')}, ZeRO {R.get(run, 'params.train.zero_stage', '0')}")


def add_efficiency(points: pd.DataFrame) -> pd.DataFrame:
    """Add aggregate PFLOP/s and efficiency against each series' preferred 1-device run (_preferred_first;
    NaN: no baseline)."""
    out = points.copy()
    out["aggregate_pflops"] = out["tflops_per_device"] * out["gpus"] / 1000.0
    out["efficiency"] = float("nan")
    out["baseline_run_id"] = ""
    series = ["device", "precision", "baseline_model"] + [c for c in ("flops_counted", "recipe") if c in out]
    for key, group in out.groupby(series, dropna=False):
        base = group[(group["gpus"] == 1) & group["tflops_per_device"].notna()]
        if key[2] == "scaling-1.2b":  # the paper's series: config 1 at the paper's batch 8 only, never another
            base = at_paper_batch(base[base["config"] == "scaling-1.2b"])  # config's, nor a batch-4 test run
        if base.empty:
            continue
        chosen = _preferred_first(base).iloc[0]
        out.loc[group.index, "efficiency"] = [efficiency(t, chosen["tflops_per_device"]) for t in group["tflops_per_device"]]
        out.loc[group.index, "baseline_run_id"] = chosen.get("run_id", "")
    return out


def paper_points(paper: pd.DataFrame) -> pd.DataFrame:
    """Table 1's 8 points with the paper's efficiency and the TFLOP/s and PFLOP/s it implies."""
    base = paper_value(paper, "scaling", "baseline", "tflops_per_gpu")
    rows = []
    for config in CONFIGS:
        tp = int(paper_value(paper, "scaling", config, "gpus_tp"))
        for mode, key in MODES:
            gpus = int(paper_value(paper, "scaling", config, f"gpus_{key}"))
            eff = paper_value(paper, "scaling", config, f"efficiency_{key}")
            stated = paper_value(paper, "scaling", config, f"aggregate_pflops_{key}")
            rows.append({"config": config, "mode": mode, "gpus": gpus, "tp": tp, "dp": gpus // tp,
                         "paper_efficiency": eff, "paper_tflops_per_gpu": base * eff,
                         "paper_pflops": stated if stated else base * eff * gpus / 1000.0,
                         "paper_pflops_source": "stated" if stated else "derived: 39 TFLOP/s x eff x GPUs"})
    return pd.DataFrame(rows)


def predictions() -> dict[tuple[str, int], dict[str, float]] | None:
    """Hook: repro.perf.scaling_model's predicted efficiency per (config, gpus) and cluster, or None."""
    try:
        from repro.perf.scaling_model import DGX2H, H200_CLUSTER, weak_scaling
    except ImportError:
        return None
    out: dict[tuple[str, int], dict[str, float]] = {}
    for tag, cluster in (("model_dgx2h", DGX2H), ("model_h200", H200_CLUSTER)):
        for row in weak_scaling(cluster):
            out.setdefault((row["config"], row["gpus"]), {})[tag] = row["predicted"]
    return out


def appendix_predictions() -> dict[str, dict[str, float]]:
    """repro.perf.scaling_model's Appendix D predictions per setting ("1.2B, batch 8, 2-way TP", ...):
    {"model_dgx2h": ..., "model_h200": ...}, efficiency for Table 7 and speed-up for Table 8."""
    from repro.perf.scaling_model import DGX2H, H200_CLUSTER
    from repro.perf.scaling_model import appendix_d as model_appendix_d

    out: dict[str, dict[str, float]] = {}
    for tag, cluster in (("model_dgx2h", DGX2H), ("model_h200", H200_CLUSTER)):
        for row in model_appendix_d(cluster):
            out.setdefault(row["setting"], {})[tag] = row["predicted"]
    return out


def _preferred_first(runs: pd.DataFrame, device: str | None = None) -> pd.DataFrame:
    """The runs in the order a table point takes them: a logged throughput first, then a steady one (an
    interval after warm-up logged, not a warm-up interval alone), then one with an efficiency (a
    1-device baseline of its own precision, recipe and FLOP count: a newer fp32 check does not hide the
    bf16 run the baseline measures), then (when given) runs on `device`, the table's baseline device,
    then full-length runs before test runs cut short (a newer 100-iteration check of a script does not
    replace its measurement), then the newest."""
    keys = {"_logged": runs["tflops_per_device"].notna()}
    if "steady" in runs:
        keys["_steady"] = runs["steady"].fillna(True).astype(bool)
    if "efficiency" in runs:
        keys["_efficiency"] = runs["efficiency"].notna()
    if device is not None and "device" in runs:
        keys["_device"] = runs["device"] == device
    if "train_iters" in runs:
        keys["_full"] = ~(runs["train_iters"] < SCALING_ITERS)  # a run that logged no length counts as full
    if "start_time" in runs:
        keys["_start"] = runs["start_time"]
    order = pd.DataFrame(keys, index=runs.index)
    return runs.loc[order.sort_values(list(order.columns), ascending=False, kind="stable").index]


def baseline_device(measured: pd.DataFrame) -> str | None:
    """The device of Table 1's baseline: the preferred 1-device run of config 1 at the paper's batch
    (None without one). Every other point prefers runs on it, so a store holding runs of several GPU
    types fills one table from one kind of hardware where it can (rows from another say so)."""
    if not len(measured):
        return None
    base = at_paper_batch(measured[(measured["config"] == "scaling-1.2b") & (measured["gpus"] == 1)])
    return _preferred_first(base).iloc[0]["device"] if len(base) else None


def appendix_d_run(run) -> bool:
    """A run of Appendix D's layouts: the 8.3B model with 16 or 24 heads (Table 7), or the 1.2B model
    under TP alone on 2-8 GPUs (Table 8's strong scaling)."""
    if run["config"] in ("scaling-8.3b-16h", "scaling-8.3b-24h"):
        return True
    return run["config"] == "scaling-1.2b" and run["dp"] == 1 and run["gpus"] in (2, 4, 8)


def combine(paper_pts: pd.DataFrame, measured: pd.DataFrame, predicted) -> pd.DataFrame:
    """Paper rows (each with its preferred matching measured run, _preferred_first, or none) then unmatched
    measured rows; `another_run` marks those that matched a paper point but were not chosen for it."""
    rows, used, candidates, device = [], set(), set(), baseline_device(measured)
    for _, p in paper_pts.iterrows():
        row = {**p.to_dict(), **(predicted or {}).get((p["config"], p["gpus"]), {})}
        hit = at_paper_batch(measured[(measured["config"] == p["config"]) & (measured["gpus"] == p["gpus"])
                                      & (measured["tp"] == p["tp"])] if len(measured) else measured)
        if len(hit):
            best = _preferred_first(hit, device).iloc[0]
            used.add(best.name)
            candidates.update(hit.index)
            row.update({k: best[k] for k in best.index if k not in ("config", "gpus", "tp", "dp")})
        rows.append(row)
    extra = measured.drop(index=list(used)) if len(measured) else measured
    if len(extra):  # Appendix D's runs have their own table; among Table 1's they read as weak-scaling points
        extra = extra[[not appendix_d_run(m) for _, m in extra.iterrows()]]
    for index, m in extra.sort_values(["config", "gpus"]).iterrows() if len(extra) else []:
        rows.append({**m.to_dict(), "mode": "TP+DP" if m["dp"] > 1 else "TP", "another_run": index in candidates})
    return pd.DataFrame(rows)


def _missing_efficiency(tflops) -> str:
    """Why a measured run has no efficiency."""
    return "no throughput logged" if tflops is None or tflops != tflops else "no 1-device baseline"


def _measured_cells(row) -> list[str]:
    if R.get(row, "run_id") is None:
        return [NOT_RUN, "", NOT_RUN, NOT_RUN, "", ""]
    eff = R.get(row, "efficiency")
    return [fmt(row["tflops_per_device"], 4), R.get(row, "flops_counted", "model"), fmt(row["aggregate_pflops"], 6),
            fmt(eff, 1, pct=True) if eff is not None else _missing_efficiency(R.get(row, "tflops_per_device")),
            row["label"], row["provenance"]]


def display(table: pd.DataFrame) -> pd.DataFrame:
    """The Markdown view: paper, analytic model and measured side by side, measured labelled."""
    cols = ["config", "mode", "GPUs", "TP x DP", "paper eff.", "paper TFLOP/s/GPU", "model DGX-2H",
            "model H200", "measured TFLOP/s/device", "FLOPs", "measured PFLOP/s", "measured eff.", "measured on", "provenance"]
    rows = []
    for _, r in table.iterrows():
        paper = R.get(r, "paper_efficiency")
        cells = _measured_cells(r)
        rows.append([r["config"], r["mode"], int(r["gpus"]), f"{int(r['tp'])} x {int(r['dp'])}",
                     fmt(paper, 0, pct=True) if paper is not None else
                     "— (paper point, another run)" if R.get(r, "another_run") else "— (not a paper point)",
                     fmt(R.get(r, "paper_tflops_per_gpu"), 1),
                     fmt(R.get(r, "model_dgx2h"), 1, pct=True), fmt(R.get(r, "model_h200"), 1, pct=True),
                     *cells])
    return pd.DataFrame(rows, columns=cols)


def _preferred(measured: pd.DataFrame, device: str | None, **match):
    """The preferred measured run (_preferred_first) at the paper's batch with these column values, or None."""
    hit = at_paper_batch(measured)
    for key, value in match.items():
        hit = hit[hit[key] == value] if len(hit) else hit
    return _preferred_first(hit, device).iloc[0] if len(hit) else None


def appendix_d(paper: pd.DataFrame, measured: pd.DataFrame) -> pd.DataFrame:
    """Appendix D: Table 7 (8.3B at 8-way TP with 16/24/32 heads: weak-scaling efficiency against config
    1 on one device) and Table 8 (1.2B at batch 8 on 1/2/4/8 devices: speed-up = efficiency x devices)."""
    rows, device = [], baseline_device(measured)
    for size, heads in HEADS:
        run = _preferred(measured, device, config=size, gpus=8, tp=8)
        rows.append({"table": "Table 7", "setting": f"8.3B, {heads} heads, 8-way TP", "gpus": 8,
                     "metric": "efficiency", "paper": paper_value(paper, "appendix_d", size, "efficiency_tp"),
                     "measured": R.get(run, "efficiency") if run is not None else None, "run": run})
    for gpus in STRONG_GPUS:
        run = _preferred(measured, device, config="scaling-1.2b", gpus=gpus, tp=gpus)
        eff = R.get(run, "efficiency") if run is not None else None
        rows.append({"table": "Table 8", "setting": f"1.2B, batch 8, {gpus}-way TP", "gpus": gpus,
                     "metric": "speed-up", "paper": paper_value(paper, "appendix_d", f"strong-{gpus}gpu", "speedup"),
                     "measured": eff * gpus if eff is not None else None, "run": run})
    predicted = appendix_predictions()
    for row in rows:
        run = row.pop("run")
        row.update(predicted.get(row["setting"], {}))
        row.update(run_id=R.get(run, "run_id", "") if run is not None else "",
                   tflops_per_device=R.get(run, "tflops_per_device") if run is not None else None,
                   label=R.get(run, "label", "") if run is not None else "",
                   provenance=R.get(run, "provenance", "") if run is not None else "")
    return pd.DataFrame(rows)


def appendix_display(table: pd.DataFrame) -> pd.DataFrame:
    """The Markdown view of appendix_d(): paper beside measured, 'not run' where no run matches."""
    def cell(value, metric, run_id, tflops=0.0):
        if not run_id:
            return NOT_RUN
        if value is None or value != value:
            return _missing_efficiency(tflops)
        return fmt(value, 1, pct=True) if metric == "efficiency" else f"{value:.2f}x"

    rows = [[r["table"], r["setting"], int(r["gpus"]), r["metric"], cell(r["paper"], r["metric"], "paper"),
             cell(R.get(r, "model_dgx2h"), r["metric"], "model"), cell(R.get(r, "model_h200"), r["metric"], "model"),
             cell(r["measured"], r["metric"], r["run_id"], R.get(r, "tflops_per_device")),
             r["label"], r["provenance"]] for _, r in table.iterrows()]
    return pd.DataFrame(rows, columns=["table", "setting", "GPUs", "metric", "paper", "model DGX-2H", "model H200",
                                       "measured", "measured on", "provenance"])


def measured_runs(tracking_uri: str, experiment: str = "scaling") -> pd.DataFrame:
    """One row per run of `experiment`: throughput, aggregate PFLOP/s and efficiency."""
    runs = R.load_runs(tracking_uri, experiment)
    measured = measured_points(runs, lambda run: run_throughput(tracking_uri, run))
    return add_efficiency(measured) if len(measured) else measured


def build(tracking_uri: str, experiment: str = "scaling", predicted="auto") -> pd.DataFrame:
    """The combined scaling table from the runs of `experiment` in the store ("auto": predictions())."""
    from repro.analysis.paper import paper_values

    measured = measured_runs(tracking_uri, experiment)
    return combine(paper_points(paper_values()), measured, predictions() if predicted == "auto" else predicted)


def report(tracking_uri: str, out_dir: str | Path, experiment: str = "scaling",
           bench_dir: str | Path | None = None) -> str:
    """Write scaling_table, scaling_appendix_d and scaling_baseline (.csv, .md) and fig_scaling.png;
    return the Markdown."""
    from repro.analysis.baseline import check_benchmarks, write_baseline
    from repro.analysis.figures import plot_scaling
    from repro.analysis.paper import paper_values
    from repro.tracking.store import project_root

    bench_dir = Path(bench_dir) if bench_dir else project_root() / "results" / "bench"
    check_benchmarks(bench_dir)  # a broken file fails before any table is written, not after two
    out_dir, predicted, paper = Path(out_dir), predictions(), paper_values()
    measured = measured_runs(tracking_uri, experiment)
    table = combine(paper_points(paper), measured, predicted)
    notes = ["Efficiency = sustained FLOP/s per device / the 1-device baseline's (paper: config 1 on one V100). "
             "Measured TFLOP/s per device: median of the logged intervals (the first interval of every launch, "
             "resumes included, dropped as warm-up; a run that logged nothing else is labelled 'warm-up interval "
             "only' and ranks after steady runs; a run resumed on another layout: its last launch only) of "
             "`hw_tflops_per_device`, which counts FLOPs as the paper's 39 TFLOP/s and the analytic model do "
             "(96 B s l h^2 (1 + s/6h + V/16lh) with activation recomputation when the run checkpointed, the 72 "
             "form without; the trainer's `hw_flop_formula` param), or of the model FLOPs `tflops_per_device` "
             "for runs that predate it ('FLOPs' column). Efficiency is a ratio of the same count. "
             "'model' columns: the analytic prediction of repro/perf/scaling_model.py (see results/scaling_model/) "
             + ("" if predicted is not None else "— NOT AVAILABLE (module missing) "),
             "Each point takes a run with a logged throughput, then a steady one, then one with an efficiency, then "
             "a run on the device "
             "of the config-1 baseline where one exists, a full-length run "
             f"({SCALING_ITERS} iterations, experiments/scaling/base.yaml) before a test run cut short (labelled), "
             "then the newest; 'measured on' names each row's device. The other runs of a paper point follow "
             "the paper rows as '— (paper point, another run)', and are not drawn in the figure. "
             "Rows marked CPU or reduced size are plumbing checks of this code on small models, "
             "not measurements of the paper's configurations; their efficiency is against their own 1-device run."]
    text = write_table(display(table), table, out_dir, "scaling_table", "Weak scaling (Table 1, Fig. 1 and Fig. 5)",
                       notes, tracking_uri)
    plot_scaling(table, out_dir / "fig_scaling.png")
    appendix = appendix_d(paper, measured)
    text += "\n" + write_table(appendix_display(appendix), appendix, out_dir, "scaling_appendix_d",
                               "Appendix D: attention heads (Table 7) and strong scaling (Table 8)",
                               ["Table 7: weak-scaling efficiency of 8.3B at 8-way TP against config 1 on one device "
                                "(slurm/heads_8b_{16,24}.sh, scale_8b.sh; `repro slurm sweep table7`). Table 8: "
                                "speed-up of 1.2B at batch 8 over its one-device run = efficiency x devices "
                                "(slurm/scale_1b.sh, strong_1b_tp{2,4,8}.sh; `repro slurm sweep table8`). 'model' columns: "
                                "repro/perf/scaling_model.py with the Table 1 calibration, nothing refitted "
                                "(results/scaling_model/). Measured: "
                                "the preferred run of experiment `scaling` with that model and layout (a logged "
                                "throughput, an efficiency, the baseline's device, full length, then the newest)."],
                               tracking_uri)
    if bench_dir.is_dir():
        baseline = write_baseline(bench_dir, out_dir, paper, tracking_uri)
        if baseline:
            text += "\n" + baseline
    return text
