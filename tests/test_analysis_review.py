"""Review fixes of the analysis layer, on synthetic MLflow stores: a run resumed on another layout
measured at that layout only, a zero-shot row's two evals of one checkpoint (or the mismatch shown), a
warm-up-only throughput labelled and ranked after steady runs, and a broken benchmark JSON refused
before any table is written (`repro report` writes its tables all at once)."""

from __future__ import annotations

import pandas as pd
import pytest

from repro.analysis import gpt2, scaling, zeroshot
from repro.analysis import runs as R
from repro.analysis.paper import paper_values

GPU = {"device_type": "cuda", "device_name": "Synthetic GPU", "precision": "bf16", "git_sha": "abc123",
       "train.train_iters": 1000}


def _shape(size: str) -> dict:
    from repro.models.sizes import SIZES

    return {f"model.{k}": getattr(SIZES[size], k) for k in ("num_layers", "hidden_size", "num_attention_heads",
                                                            "seq_length")}


def _run(uri: str, experiment: str, params: dict, history: dict | None = None, metrics: dict | None = None,
         tags: dict | None = None, start: int = 1000) -> str:
    """A FINISHED run as repro/tracking logs it: params, per-interval metrics at steps 5, 10, ...,
    single metrics at step 0, tags (resumed_with.* as a resume writes them); `start` orders runs."""
    from mlflow import MlflowClient
    from mlflow.entities import Metric, Param

    client = MlflowClient(uri)
    exp = client.get_experiment_by_name(experiment)
    run_id = client.create_run(exp.experiment_id if exp else client.create_experiment(experiment),
                               tags=tags or {}, start_time=start).info.run_id
    rows = [Metric(k, float(v), start + i, 5 * (i + 1)) for k, vs in (history or {}).items() for i, v in enumerate(vs)]
    rows += [Metric(k, float(v), start, 0) for k, v in (metrics or {}).items()]
    client.log_batch(run_id, params=[Param(k, str(v)) for k, v in params.items()], metrics=rows)
    client.set_terminated(run_id, "FINISHED")
    return run_id


def _scaling(uri: str, experiment: str, size: str, tp: int, dp: int, tflops: list, warmup: list, **kw) -> str:
    params = {**GPU, **_shape(size), "model_size": size, "tp": tp, "dp": dp, "world_size": tp * dp,
              "train.global_batch_size": 8 * dp}
    return _run(uri, experiment, params, {"hw_tflops_per_device": tflops, "warmup_interval": warmup}, **kw)


@pytest.fixture(scope="module")
def uri(tmp_path_factory):
    """One store for the module (each scenario its own experiment): creating one takes seconds."""
    return f"sqlite:///{tmp_path_factory.mktemp('review') / 'mlflow.db'}"


# 1. a run resumed on another layout

def test_a_run_resumed_on_another_layout_is_measured_by_its_last_launch(uri):
    """Launched on 1 device at 100 TFLOP/s, resumed at dp=2 at 50 per device: the row shows 2 GPUs and
    showed 100 TFLOP/s (the median over both launches), efficiency 100%; it is 50, 50%, and says so.
    A resume that changed only the run's length still counts every launch."""
    _scaling(uri, "resume", "scaling-1.2b", 1, 1, [20, 100, 100, 100], [1, 0, 0, 0], start=1000)
    resumed = _scaling(uri, "resume", "scaling-1.2b", 1, 1, [20, 100, 100, 100, 100, 20, 50, 50],
                       [1, 0, 0, 0, 0, 1, 0, 0], start=2000,
                       tags={"resumed_with.world_size": "2", "resumed_with.dp": "2",
                             "resumed_with.train.global_batch_size": "16"})
    longer = _scaling(uri, "resume", "scaling-2.5b", 2, 1, [20, 100, 100, 20, 80, 80], [1, 0, 0, 1, 0, 0],
                      start=3000, tags={"resumed_with.train.train_iters": "2000"})
    measured = scaling.measured_runs(uri, "resume").set_index("run_id")
    row = measured.loc[resumed]
    assert (row["gpus"], row["dp"], row["batch"]) == (2, 2, 16.0)
    assert row["tflops_per_device"] == pytest.approx(50.0) and row["efficiency"] == pytest.approx(0.5)
    assert "layout changed at resume" in row["label"]
    assert measured.loc[longer, "tflops_per_device"] == pytest.approx(90.0)  # both launches' steady intervals
    assert "layout changed" not in measured.loc[longer, "label"]


def test_table2_times_a_resumed_run_at_the_gpu_count_it_shows(uri):
    """Started on 32 GPUs at 2,000 ms/iter, resumed on the paper's 64 at 1,000: the 64-GPU row took the
    32-GPU median (2,000 ms, 1.59 days); it is 1,000 ms."""
    params = {**GPU, **_shape("gpt2-355m"), "model_size": "gpt2-355m", "train.global_batch_size": 512,
              "world_size": 32, "dp": 32}
    run = _run(uri, "resume-gpt2", params, {"ms_per_iter": [3000, 2000, 2000, 2000, 2000, 1500, 1000, 1000],
                                            "warmup_interval": [1, 0, 0, 0, 0, 1, 0, 0]},
               tags={"resumed_with.world_size": "64", "resumed_with.dp": "64"})
    row = gpt2.build(uri, "resume-gpt2").iloc[0]
    assert (row["run_id"], row["gpus"], row["ms_per_iter"]) == (run, 64, 1000.0)
    assert "layout changed at resume" in row["label"]


def test_launches_without_warm_up_flags_are_not_told_apart():
    """No flag, no known last launch: nothing is taken rather than every layout's intervals."""
    history = pd.DataFrame({"step": [5, 10, 15], "value": [1.0, 2.0, 3.0]})
    no_flags = pd.DataFrame({"step": [5, 10, 15], "value": [0.0, 0.0, 0.0]})
    assert R.last_launch(history, no_flags).empty
    flags = pd.DataFrame({"step": [5, 10, 15], "value": [1.0, 1.0, 0.0]})
    assert R.last_launch(history, flags)["value"].tolist() == [2.0, 3.0]


# 2. zero-shot evals of one checkpoint

def _gpt2_trained(uri: str) -> str:
    return _run(uri, "zs-train", {**GPU, **_shape("gpt2-355m"), "model_size": "gpt2-355m"})


def _eval(uri: str, experiment: str, train: str, task: str, iteration: int, value: float, start: int) -> str:
    params = {"checkpoint": "runs/x", "tp": 1, "dp": 1, "checkpoint_iteration": iteration}
    if task == "wikitext":
        params.update(window=1024, stride=32, max_lines="all", file="wiki.test.tokens")
        metrics = {"wikitext/word_ppl": value, "wikitext/num_targets": 270000, "wikitext/num_bpe_tokens": 270329}
    else:
        params.update(strict=True, max_examples="all")
        metrics = {"lambada/accuracy": value, "lambada/num_examples": 5153}
    return _run(uri, experiment, params, metrics=metrics, tags={"task": task, "training_run_id": train}, start=start)


def test_a_zero_shot_row_takes_both_tasks_of_one_checkpoint(uri):
    """WikiText of the final checkpoint (300k) and of 200k, LAMBADA of 200k and of a mid-training 1k: the
    row paired 300k's perplexity with 200k's accuracy; it takes both of 200k, the latest with both."""
    train = _gpt2_trained(uri)
    _eval(uri, "zs-pair", train, "wikitext", 300000, 19.0, 1000)
    _eval(uri, "zs-pair", train, "wikitext", 200000, 25.0, 2000)
    _eval(uri, "zs-pair", train, "lambada", 200000, 0.40, 3000)
    _eval(uri, "zs-pair", train, "lambada", 1000, 0.05, 4000)
    row = zeroshot.build(uri, "zs-pair").iloc[0]
    assert (row["training_run_id"], row["wikitext_word_ppl"], row["lambada_acc"]) == (train, 25.0, 40.0)
    assert row["protocol"] == "wikitext: paper protocol; lambada: strict (paper)"


def test_a_zero_shot_row_of_two_checkpoints_says_so(uri):
    """WikiText only of the final checkpoint, LAMBADA only of a mid-training one: the row shows both,
    and its protocol column names each eval's checkpoint."""
    train = _gpt2_trained(uri)
    _eval(uri, "zs-mismatch", train, "wikitext", 300000, 19.0, 1000)
    _eval(uri, "zs-mismatch", train, "lambada", 1000, 0.05, 2000)
    shown = zeroshot.display(zeroshot.build(uri, "zs-mismatch")).iloc[0]
    assert (shown["measured word ppl"], shown["measured LAMBADA %"]) == ("19.00", "5.00")
    assert "wikitext of iteration 300000, lambada of iteration 1000" in shown["eval protocol"]


# 3. a warm-up interval alone

def test_a_warm_up_only_throughput_is_labelled_and_ranks_after_a_steady_one(uri):
    """Config 2 at TP=2: an older run with steady intervals at 95 and a newer one that logged only its
    warm-up interval (40): the point took the newer one, unlabelled; it takes the steady run, and the
    other row, like Appendix D's warm-up-only 2-way TP run, says 'warm-up interval only'."""
    _scaling(uri, "warm", "scaling-1.2b", 1, 1, [20, 100, 100, 100], [1, 0, 0, 0], start=1000)
    steady = _scaling(uri, "warm", "scaling-2.5b", 2, 1, [20, 95, 95, 95], [1, 0, 0, 0], start=2000)
    warm = _scaling(uri, "warm", "scaling-2.5b", 2, 1, [40], [1], start=3000)
    _scaling(uri, "warm", "scaling-1.2b", 2, 1, [30], [1], start=4000)
    table = scaling.build(uri, "warm", predicted=None)
    point = table[(table["config"] == "scaling-2.5b") & (table["gpus"] == 2)]
    assert point.iloc[0]["run_id"] == steady and point.iloc[0]["efficiency"] == pytest.approx(0.95)
    other = point[point["run_id"] == warm].iloc[0]
    assert other["label"].endswith(", warm-up interval only") and other["another_run"]
    assert not point.iloc[0]["label"].endswith("warm-up interval only")
    appendix = scaling.appendix_d(paper_values(), scaling.measured_runs(uri, "warm")).set_index("setting")
    assert appendix.loc["1.2B, batch 8, 2-way TP", "label"].endswith(", warm-up interval only")


# 4. a broken benchmark JSON

def _broken_bench(root) -> str:
    bench = root / "results" / "bench"
    (bench / "gpu_h200_new" / "headline").mkdir(parents=True)
    path = bench / "gpu_h200_new" / "headline" / "bench.json"
    path.write_text('{"results": [{"status": "ok", ')
    return str(path)


def test_a_broken_bench_json_fails_the_scaling_report_before_any_table(uri, tmp_path):
    from repro.analysis.baseline import BenchError

    _scaling(uri, "bench", "scaling-1.2b", 1, 1, [20, 100, 100], [1, 0, 0])
    path = _broken_bench(tmp_path)
    with pytest.raises(BenchError, match="Fix: move it out of") as err:
        scaling.report(uri, tmp_path / "out", "bench", tmp_path / "results" / "bench")
    assert path in str(err.value)
    assert not (tmp_path / "out").exists()  # not one table of this report beside the last one's


def test_repro_report_refuses_a_broken_bench_json_with_exit_2(uri, tmp_path, monkeypatch, capsys):
    from repro.cli import main

    _scaling(uri, "scaling", "scaling-1.2b", 1, 1, [20, 100, 100], [1, 0, 0])
    path = _broken_bench(tmp_path)
    # modules that bind project_root by name at import must bind the real one: main() imports every
    # command module, and one first imported under the patch (repro.launch.scripts) kept tmp_path as the
    # checkout for the rest of the process (a later module's `slurm sweep` found no slurm/ scripts)
    import repro.analysis.notebook, repro.analysis.runs, repro.demo, repro.launch.scripts, repro.provenance  # noqa: E401,F401
    monkeypatch.setattr("repro.tracking.store.project_root", lambda: tmp_path)
    assert main(["report", "--tracking-uri", uri, "--out", str(tmp_path / "out")]) == 2
    captured = capsys.readouterr()
    assert path in captured.err and "Fix: move it out of" in captured.err
    assert "executing" not in captured.out and not (tmp_path / "out").exists()


def _notebook(path, *sources: str) -> None:
    """A notebook whose first cell is tagged `parameters` (as analysis/*.ipynb), then `sources`."""
    import nbformat

    cells = [nbformat.v4.new_code_cell("tracking_uri = out_dir = bench_dir = None", metadata={"tags": ["parameters"]})]
    nb = nbformat.v4.new_notebook(cells=cells + [nbformat.v4.new_code_cell(src) for src in sources])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    path.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, path)


def test_a_failing_notebook_leaves_the_report_folder_as_it_was(tmp_path, monkeypatch):
    """The notebooks write into a staging folder moved into --out at the end: the scaling tables of a
    report whose zero-shot notebook failed do not replace the last report's. Real executions (nbclient,
    a kernel) of two small notebooks in place of analysis/'s, which take ~15 s each here (the scaling
    one would run twice): each writes its table into the injected out_dir, the zero-shot one then
    raises in a cell."""
    from repro.analysis import commands, notebook

    root = tmp_path / "checkout"
    write = "from pathlib import Path\nPath(out_dir, {table!r}).write_text({text!r})"
    _notebook(root / "analysis" / "scaling.ipynb", write.format(table="scaling_table.md", text="new scaling"))
    _notebook(root / "analysis" / "zero_shot.ipynb", write.format(table="zero_shot_table.md", text="new zero_shot"),
              "raise ValueError('no zero-shot runs (injected)')")
    monkeypatch.setattr(notebook, "project_root", lambda: root)
    out = tmp_path / "out"
    out.mkdir()
    (out / "scaling_table.md").write_text("old")
    with pytest.raises(notebook.NotebookError, match=r"(?s)zero_shot.ipynb failed.*no zero-shot runs \(injected\)"):
        commands.run_report("sqlite:///x.db", out, ("scaling", "zero_shot"))
    assert sorted(p.name for p in out.iterdir()) == ["failed", "scaling_table.md"]  # no new table, no staging
    assert (out / "scaling_table.md").read_text() == "old"
    assert [p.name for p in (out / "failed").iterdir()] == ["zero_shot.ipynb"]  # its executed copy, kept
    assert "no zero-shot runs (injected)" in (out / "failed" / "zero_shot.ipynb").read_text()
    assert commands.run_report("sqlite:///x.db", out, ("scaling",)) == [out / "scaling_table.md"]
    assert (out / "scaling_table.md").read_text() == "new scaling"
    assert sorted(p.name for p in out.iterdir()) == ["failed", "scaling_table.md"]  # no staging folder left
