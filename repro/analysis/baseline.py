"""The one-device baseline of Table 1 config 1: the paper's V100 beside every GPU measurement of
`repro.perf.gpu_bench` committed under results/bench (JSON files, not MLflow runs).

Any folder below the benchmark folder counts, so the output of a new GPU session
(`OUT=results/bench/gpu_h200_<date> bash scripts/gpu_session.sh`, one subfolder per step) joins the
table at the next `repro report` without copying. CPU smoke runs of the same script are left out:
they time a tiny model, not config 1.
"""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd

from repro.analysis.paper import paper_value
from repro.analysis.tables import fmt, write_table

PARAMS = {"fp32": "fp32, autocast", "half": "half, fp32 masters"}
COLUMNS = ["source", "config", "device", "dtype", "params", "act. ckpt", "compile", "batch", "TFLOP/s per device",
           "fraction of peak", "model TFLOP/s", "MFU", "provenance"]


class BenchError(ValueError):
    """A benchmark JSON under the bench folder that cannot be read; the message names it and the fix."""


def _read_json(path: Path, bench_dir: Path):
    """A benchmark file's JSON; a BenchError naming it for one cut short or unreadable."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as err:  # JSONDecodeError, UnicodeDecodeError
        raise BenchError(f"{path} is not readable JSON ({err}): a benchmark report cut short or still being "
                         f"written. {_fix(bench_dir)}") from None


def _fix(bench_dir: Path) -> str:
    return (f"Fix: move it out of {bench_dir} (or remove it), or rerun the benchmark that wrote it; no table "
            "was written")


def check_benchmarks(bench_dir: str | Path | None) -> None:
    """Read every benchmark report below `bench_dir` (when it is a folder) before any table is written:
    a BenchError for one that cannot be read (bench_baseline)."""
    if bench_dir is not None and Path(bench_dir).is_dir():
        bench_baseline(Path(bench_dir))


def _benchmark_files(bench_dir: Path) -> list[tuple[Path, dict]]:
    """Every gpu_bench report below `bench_dir` measured on a GPU, in path order."""
    found = []
    for path in sorted(Path(bench_dir).rglob("*.json")):
        data = _read_json(path, bench_dir)
        if not isinstance(data, dict) or not isinstance(data.get("results"), list):
            continue  # another benchmark's JSON (repro bench, data benchmarks)
        if str(data.get("provenance", {}).get("device", "cpu")).startswith("cpu"):
            continue
        found.append((path, data))
    return found


def _compiled(spec: dict) -> str:
    if not spec["compile"]:
        return "no"
    scope = "per layer" if spec.get("compile_scope") == "blocks" else "whole step"
    mode = spec.get("compile_mode", "default")
    return scope + {"default": "", "reduce-overhead": ", CUDA graphs"}.get(mode, f", {mode}")


def _params(spec: dict) -> str:
    """The precision recipe, with the gpu_bench options that change the step beyond it."""
    params = spec.get("params", "fp32")
    label = PARAMS.get(params, params)
    if params == "half" and spec.get("main_grads", "fp32") == "param":
        label += ", half grads cast after backward"
    if spec.get("optimizer", "torch") == "flat":
        label += ", flat AdamW"
    return label


def bench_baseline(bench_dir: Path) -> pd.DataFrame:
    """One row per successful configuration of every GPU benchmark report below `bench_dir`; a BenchError
    naming a report that cannot be read."""
    rows = []
    for path, data in _benchmark_files(bench_dir):
        try:
            rows += _rows(path.relative_to(bench_dir).as_posix(), data)
        except (KeyError, TypeError, AttributeError) as err:
            raise BenchError(f"{path} holds a result that is not a gpu_bench result ({type(err).__name__}: "
                             f"{err}). {_fix(bench_dir)}") from None
    return pd.DataFrame(rows)


def _rows(source: str, data: dict) -> list[dict]:
    """The rows of one gpu_bench report: its successful configurations."""
    prov, rows = data.get("provenance", {}), []
    for res in data["results"]:
        if res.get("status") != "ok":
            continue
        spec = res["spec"]
        rows.append({"source": source, "model": data.get("model", "?"),
                     "device": prov.get("device", "?"), "dtype": spec["dtype"],
                     "params": _params(spec), "checkpointing": spec["checkpointing"],
                     "compile": _compiled(spec), "batch": spec["batch"],
                     "hardware_tflops": res["hardware_tflops"], "hfu": res["hfu"],
                     "model_tflops": res["model_tflops"], "mfu": res["mfu"], "torch": prov.get("torch", "?"),
                     "date_utc": prov.get("date_utc", "?"), "git_sha": prov.get("git_sha", "?"),
                     "flops_formula": data.get("flops_formula", "?")})
    return rows


def baseline_display(bench: pd.DataFrame, paper: pd.DataFrame) -> pd.DataFrame:
    """The paper's one-V100 baseline beside the measured one-device numbers, both counted in hardware FLOPs
    (recomputation included, as the paper's 39 TFLOP/s); model FLOP/s and MFU beside them."""
    base = paper_value(paper, "scaling", "baseline", "tflops_per_gpu")
    frac = paper_value(paper, "scaling", "baseline", "fraction_of_peak")
    rows = [["paper (Section 5.1)", "scaling-1.2b", "V100 SXM3", "fp16", "half, fp32 masters", "on", "no", 8,
             fmt(base, 0), fmt(frac, 0, pct=True), "—", "—", "paper value"]]
    for _, b in bench.iterrows():
        rows.append([f"measured: {b['source']}", b["model"], b["device"], b["dtype"], b["params"],
                     "on" if b["checkpointing"] else "off", b["compile"], b["batch"], fmt(b["hardware_tflops"], 0),
                     fmt(b["hfu"], 1, pct=True), fmt(b["model_tflops"], 0), fmt(b["mfu"], 1, pct=True),
                     f"torch {b['torch']}, {b['date_utc']}, git {b['git_sha']}"])
    return pd.DataFrame(rows, columns=COLUMNS)


def write_baseline(bench_dir: Path, out_dir: Path, paper: pd.DataFrame, tracking_uri: str) -> str:
    """Write scaling_baseline.{csv,md}; return the Markdown ('' when `bench_dir` holds no GPU benchmark)."""
    bench = bench_baseline(bench_dir)
    if bench.empty:
        return ""
    best = bench.loc[bench["mfu"].fillna(-1.0).idxmax()]  # (NaN: a GPU without a known peak)
    notes = [f"Measured rows: every `repro.perf.gpu_bench` JSON measured on a GPU below {_shown(bench_dir)} (benchmarks, "
             "not MLflow runs; results/README.md says what each folder holds). TFLOP/s per device and fraction of peak count hardware "
             "FLOPs, as the paper's 39 TFLOP/s (30%) does: 96 B s l h^2 (1 + s/6h + V/16lh) with activation "
             "recomputation (act. ckpt on), the 72 form without. Model TFLOP/s and MFU: 72 B s l h^2 (1 + s/6h + "
             "V/12lh), no recomputation. params: fp32 weights under autocast, or Megatron's half-precision model "
             "with fp32 master weights in the optimizer (`precision.params: half`).",
             f"Highest MFU measured: {best['mfu']:.1%} ({best['source']}: {best['dtype']}, params {best['params']}, "
             f"compile {best['compile']}, act. ckpt {'on' if best['checkpointing'] else 'off'}); this project's goal "
             "on an H100/H200 is 45%."]
    return write_table(baseline_display(bench, paper), bench, out_dir, "scaling_baseline",
                       "One-device baseline of Table 1 config 1: paper V100 vs measured", notes, tracking_uri)


def _shown(path: Path) -> str:
    """`path` relative to the checkout when it lies inside it (no machine-specific prefix in results/)."""
    from repro.tracking.store import project_root

    try:
        return Path(path).resolve().relative_to(project_root().resolve()).as_posix()
    except ValueError:
        return str(path)
