"""A run directory's own files, which hold a run whether MLflow is reachable or not (no MLflow here):
metrics.jsonl (every metric row), params.json and tags.json, mlflow_run_id (the MLflow run holding
them), the stop and status markers, and what a launch begun again or resumed sets aside."""

from __future__ import annotations

import json
import time
import warnings
from pathlib import Path

RUN_ID_FILE = "mlflow_run_id"  # the MLflow run that holds this run directory's metrics
STOP_MARKER = "stopped_by_signal"  # the last launch stopped for a signal (launch.sh requeues the job)
STATUS_FILE = "run_status"  # the last launch ended FAILED or KILLED (close() writes it, MLflow up or not)
RESUMED_PARAM_TAG = "resumed_with."  # + a param key: its value since a resume changed it (params are fixed)


class TrackingError(RuntimeError):
    """A run directory or tracking store that cannot be used; the message names it and the fix."""


def write_text(path: Path, text: str) -> None:
    write_bytes(path, text.encode())


def write_bytes(path: Path, data: bytes) -> None:
    from repro.provenance import write_atomic

    write_atomic(path, data)


def read_text(path: Path, fix: str) -> str:
    """A UTF-8 file's text; a TrackingError naming it and `fix` for one that cannot be read or is not UTF-8."""
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise TrackingError(f"{path} is not UTF-8 text ({err.reason} at byte {err.start}). {fix}") from None
    except OSError as err:
        raise TrackingError(f"{path} cannot be read ({err.strerror or err}). {fix}") from None


def recorded_run_id(run_dir: str | Path) -> str | None:
    """The MLflow run id named by `<run_dir>/mlflow_run_id` (written by the logger and by sync)."""
    path = Path(run_dir) / RUN_ID_FILE
    return (path.read_text().strip() or None) if path.is_file() else None


def drop_partial_line(path: Path) -> None:
    """Cut the unfinished last line a killed writer left in a JSON-lines file, so that the next append
    starts a whole line after it (metrics.jsonl on resume, zero_shot.jsonl before a new record). A last
    line that is whole JSON but lacks its newline (an editor's save) is kept, and the newline added."""
    data = path.read_bytes() if path.exists() else b""
    if not data or data.endswith(b"\n"):
        return
    cut = data.rfind(b"\n") + 1
    with open(path, "r+b") as handle:
        if _is_json(data[cut:]):
            handle.seek(len(data))
            handle.write(b"\n")
            return
        warnings.warn(f"{path}: dropped an unfinished last line ({len(data) - cut} bytes) left by a "
                      "killed writer", stacklevel=3)
        handle.truncate(cut)


def _is_json(line: bytes) -> bool:
    try:
        json.loads(line)
    except ValueError:  # (JSONDecodeError and UnicodeDecodeError both are)
        return False
    return True


def set_aside_earlier_launch(run_dir: Path) -> str | None:
    """Rename an earlier launch's metrics.jsonl and mlflow_run_id with a time suffix: a run begun
    again (killed before its first checkpoint) must not have the dead launch's rows synced into it.
    Returns the earlier launch's MLflow run id, if it had one."""
    earlier, moved = recorded_run_id(run_dir), []
    stamp = time.strftime("%Y%m%dT%H%M%S")
    for name in ("metrics.jsonl", RUN_ID_FILE):
        path = run_dir / name
        if path.is_file() and path.stat().st_size:
            path.rename(run_dir / f"{name}.before-{stamp}")
            moved.append(name)
    if moved:
        print(f"{run_dir}: this launch starts the run again (no checkpoint to resume from); the earlier "
              f"launch's {' and '.join(moved)} kept as *.before-{stamp}", flush=True)
    return earlier


def set_aside_rows_after(run_dir: Path, step: int) -> Path | None:
    """Keep metrics.jsonl's rows up to `step`; the whole earlier file goes to metrics.jsonl.before-TIME
    (returned; None if no row was after `step`). For a resume whose steps after its checkpoint are
    redone with other values (a new schedule): their rows replace the earlier launch's."""
    path = run_dir / "metrics.jsonl"
    lines = path.read_text().splitlines(keepends=True) if path.is_file() else []
    kept = [line for line in lines if _row_step(line) <= step]
    if len(kept) == len(lines):
        return None
    aside = run_dir / f"metrics.jsonl.before-{time.strftime('%Y%m%dT%H%M%S')}"
    aside.write_bytes(path.read_bytes())
    write_text(path, "".join(kept))
    return aside


def set_aside_run_id(run_dir: Path) -> str | None:
    """Rename mlflow_run_id with a time suffix, so the next launch logs into a new MLflow run (which gets
    metrics.jsonl's rows): one whose steps past the run's new end cannot be taken out of the old run
    (MLflow deletes no metric value). Returns the id set aside."""
    earlier = recorded_run_id(run_dir)
    if earlier:
        (run_dir / RUN_ID_FILE).rename(run_dir / f"{RUN_ID_FILE}.before-{time.strftime('%Y%m%dT%H%M%S')}")
    return earlier


def set_aside_run_ids(run_dir: Path) -> set[str]:
    """The MLflow run ids of the launches set aside in `run_dir` (mlflow_run_id.before-*)."""
    return {p.read_text().strip() for p in Path(run_dir).glob(f"{RUN_ID_FILE}.before-*")}


def _row_step(line: str) -> float:
    """A metrics.jsonl line's step (inf for a line that is not a whole row: it goes with the later rows)."""
    try:
        return json.loads(line)["step"]
    except (json.JSONDecodeError, KeyError, TypeError):
        return float("inf")


def resumed_launch(run_dir: Path, params: dict, tags: dict) -> tuple[dict, dict]:
    """params.json and tags.json of a resumed launch, as its MLflow run holds them: the first launch's
    values kept (MLflow never changes a logged param), a param this launch changed (another layout, a
    raised train.train_iters) in the tag resumed_with.KEY, new params added."""
    earlier, earlier_tags = _json_or_empty(run_dir / "params.json"), _json_or_empty(run_dir / "tags.json")
    changed = {RESUMED_PARAM_TAG + k: str(v) for k, v in params.items()
               if k in earlier and str(v) != str(earlier_tags.get(RESUMED_PARAM_TAG + k, earlier[k]))}
    return {**params, **earlier}, {**tags, **earlier_tags, **changed}


def _json_or_empty(path: Path) -> dict:
    """A JSON object file's content; {} for one missing or unreadable (a new run's)."""
    try:
        found = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return found if isinstance(found, dict) else {}


def read_metrics(run_dir: str | Path) -> list[dict]:
    """Every row of a run directory's metrics.jsonl ([] without one). A truncated last line (what a
    killed run leaves) is skipped with a warning; a bad line before it is a TrackingError."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    text = read_text(path, "Fix: give the run directory `repro train` wrote (its metrics.jsonl is UTF-8 JSON lines)")
    lines = [(n, line) for n, line in enumerate(text.splitlines(), 1) if line.strip()]
    rows = []
    for n, line in lines:
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            if n != lines[-1][0]:
                raise TrackingError(f"{path}:{n} is not JSON ({err}). Fix: delete or repair that line; "
                                    "every line must be one JSON object") from None
            warnings.warn(f"{path}:{n}: skipped a truncated last line (the run was killed while "
                          "writing it)", stacklevel=2)
            continue
        problem = _row_problem(row)
        if problem:
            raise TrackingError(f"{path}:{n} {problem}. Fix: delete or repair that line; every line is one "
                                'object like {"step": 10, "time": 1733300000.0, "loss": 7.1}')
        rows.append(row)
    return rows


def _row_problem(row) -> str | None:
    """What makes a metrics.jsonl row unusable (checked before any upload), or None."""
    if not isinstance(row, dict):
        return f"is a JSON {type(row).__name__}, not an object"
    number = (int, float)
    if not isinstance(row.get("step"), int) or isinstance(row.get("step"), bool):
        return f"has step {row.get('step')!r}, not an integer"
    if not isinstance(row.get("time"), number):
        return f"has time {row.get('time')!r}, not a number of seconds"
    bad = [k for k, v in row.items() if k not in ("step", "time") and not isinstance(v, number)]
    return f"has non-numeric value(s) for {', '.join(bad)}" if bad else None


def logged_metrics(rows: list[dict], first_step: int) -> dict[int, set[str]]:
    """step -> the metric names metrics.jsonl's `rows` hold at it, for the steps from first_step on."""
    logged: dict[int, set[str]] = {}
    for row in rows:
        if row.get("step", -1) >= first_step:
            logged.setdefault(row["step"], set()).update(k for k in row if k not in ("step", "time"))
    return logged


def _load_json(path: Path, what: str) -> dict:
    if not path.is_file():
        raise TrackingError(f"{path} is missing: it holds the run's {what}. Fix: give the run directory "
                            "written by `repro train` (params.json, tags.json, metrics.jsonl)")
    fix = "Fix: restore it from the run's artifacts/ or rerun `repro train` in that directory"
    try:
        return json.loads(read_text(path, fix))
    except json.JSONDecodeError as err:
        raise TrackingError(f"{path} is not valid JSON ({err}). {fix}") from None


def read_run_dir(run_dir: Path) -> tuple[dict, dict, list[dict]]:
    """params, tags and metric rows, all checked before MLflow is contacted."""
    if not run_dir.is_dir():
        raise TrackingError(f"{run_dir} is not a directory: give the run directory of `repro train`")
    params = _load_json(run_dir / "params.json", "parameters")
    tags = _load_json(run_dir / "tags.json", "experiment and run name")
    missing = [k for k in ("experiment", "run_name") if k not in tags]
    if missing:
        raise TrackingError(f"{run_dir / 'tags.json'} lacks {', '.join(missing)}. Fix: add them, e.g. "
                            '{"experiment": "scaling", "run_name": "scale_1b"}')
    if not (run_dir / "metrics.jsonl").is_file():
        raise TrackingError(f"{run_dir / 'metrics.jsonl'} is missing: there are no metrics to upload. "
                            "Fix: give a run directory whose training logged at least one step")
    rows = read_metrics(run_dir)
    if not rows:
        raise TrackingError(f"{run_dir / 'metrics.jsonl'} holds no metrics: nothing to upload")
    return params, tags, rows


def run_dir_status(run_dir: Path, rows: list[dict] = ()) -> str | None:
    """The status a run directory shows: KILLED when its last piece stopped for a signal
    (stopped_by_signal); FAILED or KILLED as its last launch's close() recorded it (run_status);
    FINISHED when its end was written (a training run's final_metrics.json from its last logged step,
    not an earlier end of a run extended since; RACE's results.json); else None: still running, or
    killed without a word (the store's status is then left as it is, but for FINISHED: see _upload)."""
    if (run_dir / STOP_MARKER).is_file():
        return "KILLED"
    try:
        recorded = (run_dir / STATUS_FILE).read_text().strip()
    except OSError:
        recorded = ""
    if recorded in ("FAILED", "KILLED"):
        return recorded
    if (run_dir / "results.json").is_file():
        return "FINISHED"
    ended = end_iteration(run_dir)
    return None if ended is None or rows_after(rows, ended) else "FINISHED"


def end_iteration(run_dir: Path) -> int | None:
    """The iteration final_metrics.json was written at, or None without a readable one."""
    try:
        return int(json.loads((run_dir / "final_metrics.json").read_text())["iteration"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def rows_after(rows: list[dict], ended: int) -> bool:
    """Whether metrics.jsonl has rows after final_metrics.json's iteration (a run extended since)."""
    return any(row.get("step", 0) > ended for row in rows)
