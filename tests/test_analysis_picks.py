"""Which run a table row or a figure shows, from real MLflow stores: a RACE row's MLM perplexity is its
tagged pretraining run's whatever that run's status, Table 2 keeps a measurement over a newer attempt
that logged only its warm-up interval, a compiled run is not the baseline of uncompiled ones, the other
runs of a paper point are labelled and not drawn, Fig. 6 draws unfinished GPT-2 runs, and
`repro report --out FILE` is refused before any notebook runs."""

from __future__ import annotations

import time

import pytest

from repro.analysis import bert, figures, gpt2, scaling, zeroshot
from test_analysis import _shape

GPU = {"device_type": "cuda", "device_name": "Synthetic GPU", "precision": "bf16", "git_sha": "abc123"}


def _run(uri: str, experiment: str, name: str, params: dict, history: dict[str, list[float]],
         status: str = "FINISHED", tags: dict | None = None) -> str:
    """A run logged as repro/tracking does (params, metrics per step 5, 10, ...), left in `status`."""
    from mlflow import MlflowClient
    from mlflow.entities import Metric, Param

    client = MlflowClient(uri)
    exp = client.get_experiment_by_name(experiment)
    run_id = client.create_run(exp.experiment_id if exp else client.create_experiment(experiment),
                               run_name=name, tags=tags or {}).info.run_id
    now = int(time.time() * 1000)
    client.log_batch(run_id, params=[Param(k, str(v)) for k, v in params.items()],
                     metrics=[Metric(k, float(v), now, 5 * (i + 1)) for k, vs in history.items()
                              for i, v in enumerate(vs)])
    if status != "RUNNING":
        client.set_terminated(run_id, status)
    time.sleep(0.01)  # distinct start times: newest first is well defined
    return run_id


def _bert_pretraining(uri: str, ppl: float, status: str = "FINISHED") -> str:
    return _run(uri, "bert", "bert-336m", {**GPU, **_shape("bert-336m"), "model_size": "bert-336m"},
                {"valid_mlm_ppl": [ppl + 1.0, ppl]}, status)


def _race(uri: str, training_run_id: str | None) -> str:
    tags = {"task": "race", **({"training_run_id": training_run_id} if training_run_id else {})}
    params = {**GPU, "task": "race", "size": "bert-336m", "seeds": "1 2 3 4 5", "checkpoint": "/runs/bert",
              **{k.removeprefix("model."): v for k, v in _shape("bert-336m").items()}, "seq_length": 512}
    return _run(uri, "bert", "race-bert-336m", params, {"test/acc_total": [80.0]}, tags=tags)


@pytest.mark.parametrize("status", ["RUNNING", "KILLED", "FAILED"])
def test_a_race_row_takes_its_tagged_pretraining_runs_mlm_perplexity_whatever_its_status(tmp_path, status):
    """The RACE run fine-tuned a pretraining run still RUNNING (weeks), or KILLED between requeues: its
    MLM perplexity is that run's, labelled with the status; it was the newest FINISHED run of the size,
    another model's, unlabelled."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    _bert_pretraining(uri, 2.5)
    tagged = _bert_pretraining(uri, 1.7, status)
    _race(uri, tagged)
    row = bert.build(uri).iloc[0]
    assert (row["mlm_valid_ppl"], row["mlm_run_id"]) == (1.7, tagged)
    assert bert.display(bert.build(uri)).loc[0, "measured MLM val ppl"] == f"1.70 (pretraining run {status})"


def test_a_race_rows_mlm_perplexity_falls_back_to_its_size_only_without_the_tag(tmp_path):
    """A tag naming a run this store lacks shows no perplexity (not another run's, said why); a RACE run
    from before the tag takes the newest pretraining run of its size, labelled so."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    older = _bert_pretraining(uri, 2.5)
    _race(uri, "0123456789abcdef0123456789abcdef")
    shown = bert.display(bert.build(uri)).loc[0, "measured MLM val ppl"]
    assert shown == "its pretraining run 01234567 is not in this store"
    _race(uri, None)  # newer, and with the most seeds too: it fills the row
    row = bert.build(uri).iloc[0]
    assert (row["mlm_valid_ppl"], row["mlm_run_id"]) == (2.5, older)
    assert "newest pretraining run of this size; the RACE run names none" in row["provenance"]


def _gpt2(uri: str, ms: list[float], warmup: list[float], status: str) -> str:
    params = {**GPU, "model_size": "gpt2-355m", **_shape("gpt2-355m"), "world_size": 64,
              "train.global_batch_size": 512}
    return _run(uri, "gpt2", "gpt2-355m", params, {"ms_per_iter": ms, "warmup_interval": warmup}, status)


def test_table2_keeps_a_measurement_over_a_newer_attempt_that_logged_only_its_warm_up(tmp_path):
    """A newer attempt that died after its first (warm-up) interval at 9,000 ms used to replace the
    finished run's 1,085 ms (7.14 days for 0.86); a FINISHED or RUNNING run also ranks above a newer
    KILLED or FAILED one; the newest still wins among equals."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    finished = _gpt2(uri, [3000, 1085, 1085, 1085], [1, 0, 0, 0], "FINISHED")
    _gpt2(uri, [9000], [1], "FAILED")
    row = gpt2.build(uri).iloc[0]
    assert (row["run_id"], row["ms_per_iter"]) == (finished, 1085.0) and row["label"] == "Synthetic GPU, paper size"
    _gpt2(uri, [3000, 1200, 1200], [1, 0, 0], "KILLED")
    assert gpt2.build(uri).iloc[0]["run_id"] == finished
    running = _gpt2(uri, [3000, 1100], [1, 0], "RUNNING")
    assert gpt2.build(uri).iloc[0]["run_id"] == running
    alone = f"sqlite:///{tmp_path / 'alone.db'}"
    _gpt2(alone, [9000], [1], "FAILED")  # alone, it is shown, and says what it measured
    assert gpt2.build(alone).iloc[0]["label"].endswith("failed (unfinished run), warm-up interval only")


def _scaling(uri: str, size: str, tp: int, tflops: float, name: str, iters: int = 1000, **train) -> str:
    params = {**GPU, **_shape(size), "model_size": size, "tp": tp, "dp": 1, "world_size": tp,
              "train.global_batch_size": 8, "train.train_iters": iters, "model.activation_checkpointing": "True",
              "precision.params": "half", **{f"train.{k}": v for k, v in train.items()}}
    return _run(uri, "scaling", name, params, {"hw_tflops_per_device": [1.0, tflops, tflops, tflops]})


def test_a_compiled_config_1_run_is_not_the_baseline_of_uncompiled_tp_runs(tmp_path):
    """A later torch.compile trial of config 1 at 130 TFLOP/s made config 2's uncompiled 95 read 73%
    (95 / 130), not 95%; a compiled or ZeRO run is its own series, and says so."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    plain = _scaling(uri, "scaling-1.2b", 1, 100.0, "c1", compile="False", zero_stage=0)
    _scaling(uri, "scaling-2.5b", 2, 95.0, "c2", compile="False", zero_stage=0)
    compiled = _scaling(uri, "scaling-1.2b", 1, 130.0, "c1-compiled", compile="True", zero_stage=0)
    _scaling(uri, "scaling-2.5b", 2, 50.0, "c2-zero", compile="False", zero_stage=1)
    measured = scaling.measured_runs(uri).set_index("run_id", drop=False)
    two = measured[measured["config"] == "scaling-2.5b"].set_index("tflops_per_device")
    assert two.loc[95.0, "efficiency"] == pytest.approx(0.95) and two.loc[95.0, "baseline_run_id"] == plain
    assert two.loc[50.0, "efficiency"] != two.loc[50.0, "efficiency"]  # no 1-device ZeRO-1 run: no baseline
    assert two.loc[50.0, "label"].endswith(", ZeRO-1")
    assert measured.loc[compiled, "baseline_run_id"] == compiled
    assert measured.loc[compiled, "label"] == "Synthetic GPU, paper size, torch.compile"


def test_the_other_runs_of_a_paper_point_are_labelled_and_not_drawn(tmp_path):
    """Config 2 at TP=2 measured three times: the row shows the full-length rerun, and the first
    attempt and a 100-iteration test follow as '— (paper point, another run)', not '— (not a paper
    point)', and are not extra stars in Figs. 1/5; an odd-batch run is still not a paper point."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    _scaling(uri, "scaling-1.2b", 1, 100.0, "c1")
    _scaling(uri, "scaling-2.5b", 2, 80.0, "c2-first-attempt")
    rerun = _scaling(uri, "scaling-2.5b", 2, 95.0, "c2-rerun")
    _scaling(uri, "scaling-2.5b", 2, 60.0, "c2-test", iters=100)
    table = scaling.build(uri, predicted=None)
    shown = scaling.display(table)
    assert table.loc[shown["config"].eq("scaling-2.5b") & shown["mode"].eq("TP")].iloc[0]["run_id"] == rerun
    assert shown["paper eff."].tolist().count("— (paper point, another run)") == 2
    assert "— (not a paper point)" not in shown["paper eff."].tolist()
    assert sorted(figures._measured(table)["tflops_per_device"]) == [95.0, 100.0]
    figures.plot_scaling(table, tmp_path / "fig.png")
    assert (tmp_path / "fig.png").stat().st_size > 10_000


def test_fig6_draws_an_unfinished_gpt2_run_with_its_status(tmp_path):
    """Table 2 counts a GPT-2 run KILLED between two Slurm jobs of its requeue (or still RUNNING);
    Fig. 6 drew no curve for it."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    params = {**GPU, "model_size": "gpt2-8.3b", **_shape("gpt2-8.3b"), "world_size": 512}
    killed = _run(uri, "gpt2", "gpt2-8.3b", params, {"ms_per_iter": [3000, 1500], "valid_loss": [3.0, 2.4]},
                  "KILLED")
    curves = zeroshot.valid_curves(uri)
    assert list(curves) == [f"gpt2-8.3b [Synthetic GPU, paper size; killed (unfinished run); run {killed[:8]}]"]
    assert curves[next(iter(curves))]["step"].tolist() == [5, 10]


def test_report_refuses_an_out_that_is_a_file_before_running_a_notebook(tmp_path, capsys):
    """`repro report --out FILE` ran every notebook, then failed with NotADirectoryError writing the
    failed copy; it is a user error naming the file and the fix, before any notebook runs."""
    from repro.cli import main

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    _scaling(uri, "scaling-1.2b", 1, 100.0, "c1")
    (tmp_path / "afile").write_text("")
    assert main(["report", "--tracking-uri", uri, "--out", str(tmp_path / "afile" / "out")]) == 2
    captured = capsys.readouterr()
    assert f"{tmp_path / 'afile'} is a file, not a directory" in captured.err and "Fix:" in captured.err
    assert "executing" not in captured.out


def test_a_failed_notebooks_copy_that_cannot_be_written_keeps_the_cells_error(tmp_path):
    """The executed copy of a failed notebook goes under --out/failed: when that cannot be written the
    error is still the cell's (it was an OSError traceback), saying where the copy could not go."""
    import nbformat

    from repro.analysis.notebook import NotebookError, execute

    path = tmp_path / "broken.ipynb"
    nbformat.write(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("1 / 0")]), path)
    (tmp_path / "out").write_text("")
    with pytest.raises(NotebookError, match="(?s)could not be written to .*ZeroDivisionError"):
        execute(path, {}, failed_copy=tmp_path / "out" / "failed" / "broken.ipynb")



def test_the_notebook_kernel_talks_over_encrypted_sockets(tmp_path, capfd):
    """The report's kernel gets CurveZMQ keys from its manager, so cells and outputs do not cross TCP in
    plain text; without them ipykernel warns "running over TCP without encryption" in every report."""
    import nbformat
    import zmq

    from repro.analysis.notebook import execute

    assert zmq.has("curve"), "this pyzmq's libzmq lacks CurveZMQ (libsodium): reinstall pyzmq from its wheel"
    path = tmp_path / "kernel.ipynb"
    nbformat.write(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("print(6 * 7)")]), path)
    nb = execute(path, {})
    assert nb.cells[-1].outputs[0]["text"] == "42\n"
    err = capfd.readouterr().err
    assert "without encryption" not in err, err
