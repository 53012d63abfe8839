"""Issue 8, library level: efficiency arithmetic on synthetic runs with known numbers, 'not run' rows
for missing experiments, a clear error for an empty store, the paper values and thin notebooks."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pandas as pd
import pytest

from repro.analysis import bert, scaling, zeroshot
from repro.analysis import runs as R
from repro.analysis.paper import paper_value, paper_values
from repro.analysis.tables import NOT_RUN, fmt, to_markdown

ROOT = Path(__file__).resolve().parents[1]


def test_two_devices_at_1p9x_the_one_device_throughput_is_95_percent():
    """Aggregate 190 TFLOP/s on 2 devices vs 100 on 1: 95 per device, efficiency 95% (exact arithmetic)."""
    assert scaling.efficiency(190.0 / 2, 100.0) == pytest.approx(0.95, abs=1e-12)
    points = pd.DataFrame([
        {"config": "x", "gpus": 1, "tp": 1, "dp": 1, "device": "d", "precision": "bf16", "baseline_model": "m",
         "tflops_per_device": 100.0, "run_id": "a", "start_time": 1},
        {"config": "x", "gpus": 2, "tp": 2, "dp": 1, "device": "d", "precision": "bf16", "baseline_model": "m",
         "tflops_per_device": 95.0, "run_id": "b", "start_time": 2},
        {"config": "x", "gpus": 2, "tp": 2, "dp": 1, "device": "other", "precision": "bf16", "baseline_model": "m",
         "tflops_per_device": 95.0, "run_id": "c", "start_time": 3}])
    out = scaling.add_efficiency(points)
    assert out["efficiency"].tolist()[:2] == pytest.approx([1.0, 0.95])
    assert math.isnan(out["efficiency"].iloc[2])  # no 1-device run on that device: no efficiency
    assert out["aggregate_pflops"].tolist() == pytest.approx([0.1, 0.19, 0.19])
    with pytest.raises(ValueError, match="positive"):
        scaling.efficiency(1.0, 0.0)


def test_efficiency_never_mixes_hardware_and_model_flops():
    # an old run that logged only model FLOPs is not compared with a hardware-FLOP baseline
    points = pd.DataFrame([
        {"config": "scaling-1.2b", "gpus": 1, "tp": 1, "dp": 1, "device": "G", "precision": "bf16",
         "baseline_model": "scaling-1.2b", "tflops_per_device": 100.0, "flops_counted": "hardware",
         "run_id": "a", "start_time": 1},
        {"config": "scaling-2.5b", "gpus": 2, "tp": 2, "dp": 1, "device": "G", "precision": "bf16",
         "baseline_model": "scaling-1.2b", "tflops_per_device": 75.0, "flops_counted": "model",
         "run_id": "b", "start_time": 2}])
    out = scaling.add_efficiency(points)
    assert out.loc[0, "efficiency"] == pytest.approx(1.0) and out.loc[1, "efficiency"] != out.loc[1, "efficiency"]


def test_sustained_throughput_drops_the_warm_up_interval_of_every_launch():
    hist = pd.DataFrame({"step": [5, 10, 15, 20], "value": [1.0, 10.0, 12.0, 11.0]})
    assert R.median_after_warmup(hist) == 11.0  # a run that predates the flag: its first interval
    resumed = pd.DataFrame({"step": [5, 10, 15, 20, 25, 30], "value": [1.0, 10.0, 12.0, 2.0, 11.0, 11.0]})
    flags = pd.DataFrame({"step": [5, 10, 15, 20, 25, 30], "value": [1.0, 0.0, 0.0, 1.0, 0.0, 0.0]})
    assert R.median_after_warmup(resumed, flags) == 11.0  # the resume's slow interval at step 20 is dropped too
    assert R.median_after_warmup(resumed) == 11.0 and R.median_after_warmup(resumed.iloc[:4]) == 10.0
    assert R.median_after_warmup(hist.iloc[:1], flags.iloc[:1]) == 1.0  # nothing but warm-up: kept
    crossing = pd.DataFrame({"step": [20, 25, 30], "value": [1.0, 0.0, 0.0]})  # resumed at 15 by newer code
    assert R.median_after_warmup(resumed, crossing) == 11.0  # the old launch's first (step 5) goes too
    assert math.isnan(R.median_after_warmup(hist.iloc[:0]))


def _shape(size: str) -> dict:
    """The `model.*` shape params a trainer run of a named size logs (repro.train.config.flat_params)."""
    from repro.models.sizes import SIZES

    return {f"model.{k}": getattr(SIZES[size], k) for k in ("num_layers", "hidden_size", "num_attention_heads",
                                                            "seq_length")}


def _log_run(mlflow, experiment: str, name: str, params: dict, history: dict[str, list[float]]) -> str:
    mlflow.set_experiment(experiment)
    with mlflow.start_run(run_name=name) as run:
        mlflow.log_params(params)
        for key, values in history.items():
            for i, v in enumerate(values):
                mlflow.log_metric(key, v, step=5 * (i + 1))
    return run.info.run_id


@pytest.fixture(scope="module")
def synthetic_store(tmp_path_factory):
    """Two 'GPU' scaling runs with known throughput: config 1 on 1 device at 100 TFLOP/s, config 2 at
    TP=2 at 95 per device (1.9x aggregate), counted in hardware FLOPs (recomputation included; their
    model FLOPs are 3/4 of that). No zero-shot or BERT experiment at all."""
    import mlflow

    uri = f"sqlite:///{tmp_path_factory.mktemp('synth') / 'mlflow.db'}"
    mlflow.set_tracking_uri(uri)
    common = {"device_type": "cuda", "device_name": "Synthetic GPU", "precision": "bf16", "git_sha": "abc123"}
    ids = {}
    for size, tp, tflops in (("scaling-1.2b", 1, 100.0), ("scaling-2.5b", 2, 95.0)):
        ids[size] = _log_run(mlflow, "scaling", f"{size}-tp{tp}",
                             {**common, **_shape(size), "model_size": size, "tp": tp, "dp": 1, "world_size": tp},
                             {"tflops_per_device": [3.0] + [0.75 * tflops] * 3,
                              "hw_tflops_per_device": [4.0, tflops, tflops, tflops]})
    yield uri, ids
    mlflow.set_tracking_uri(None)


def test_scaling_table_from_a_synthetic_store(synthetic_store):
    uri, ids = synthetic_store
    table = scaling.build(uri, "scaling").set_index(["config", "gpus"])
    two = table.loc[("scaling-2.5b", 2)]
    assert two["efficiency"] == pytest.approx(0.95) and two["paper_efficiency"] == 0.95
    assert two["aggregate_pflops"] == pytest.approx(0.19) and two["run_id"] == ids["scaling-2.5b"]
    assert two["tflops_per_device"] == pytest.approx(95.0) and two["flops_counted"] == "hardware"
    assert table.loc[("scaling-1.2b", 1), "efficiency"] == pytest.approx(1.0)
    shown = scaling.display(scaling.build(uri, "scaling"))
    assert len(shown) == 8  # every Table 1 point, measured or not
    assert (shown["measured eff."] == NOT_RUN).sum() == 6
    assert shown.loc[2, "measured eff."] == "95.0%" and "Synthetic GPU" in shown.loc[2, "measured on"]
    assert "git=abc123" in shown.loc[2, "provenance"] and ids["scaling-2.5b"][:8] in shown.loc[2, "provenance"]


def test_appendix_d_heads_and_strong_scaling_from_runs(tmp_path):
    """Table 7 (heads) and Table 8 (strong scaling) read from runs of the appendix configs."""
    import mlflow

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    mlflow.set_tracking_uri(uri)
    common = {"device_type": "cuda", "device_name": "Synthetic GPU", "precision": "fp16", "git_sha": "abc123"}
    for size, gpus, tflops in (("scaling-1.2b", 1, 100.0), ("scaling-1.2b", 2, 80.0), ("scaling-8.3b-16h", 8, 82.0)):
        _log_run(mlflow, "scaling", f"{size}-{gpus}", {**common, **_shape(size), "model_size": size, "tp": gpus,
                                                        "dp": 1, "world_size": gpus},
                 {"hw_tflops_per_device": [1.0, tflops, tflops]})
    mlflow.set_tracking_uri(None)
    table = scaling.appendix_d(paper_values(), scaling.measured_runs(uri)).set_index("setting")
    assert table.loc["8.3B, 16 heads, 8-way TP", "measured"] == pytest.approx(0.82)
    assert table.loc["8.3B, 16 heads, 8-way TP", "paper"] == 0.82
    assert table.loc["1.2B, batch 8, 2-way TP", "measured"] == pytest.approx(1.6)  # 2 x 80 / 100
    assert table.loc["1.2B, batch 8, 2-way TP", "paper"] == 1.64
    assert table.loc["1.2B, batch 8, 1-way TP", "measured"] == pytest.approx(1.0)
    shown = scaling.appendix_display(table.reset_index()).set_index("setting")
    assert shown.loc["8.3B, 24 heads, 8-way TP", "measured"] == NOT_RUN
    assert shown.loc["1.2B, batch 8, 2-way TP", "measured"] == "1.60x"
    assert shown.loc["8.3B, 16 heads, 8-way TP", "measured"] == "82.0%"
    # the analytic model beside them, as in Table 1 (same calibration; results/scaling_model/appendix_d.csv)
    assert shown.loc["1.2B, batch 8, 8-way TP", "model DGX-2H"] == "4.99x"
    assert shown.loc["8.3B, 16 heads, 8-way TP", "model DGX-2H"] == "88.1%"
    assert shown.loc["1.2B, batch 8, 2-way TP", "model H200"] == "1.67x"
    scaling.report(uri, tmp_path / "out", bench_dir=tmp_path / "no-bench")
    text = (tmp_path / "out" / "scaling_appendix_d.md").read_text()
    assert "Table 7" in text and "2.98x" in text and "1.60x" in text


def test_missing_experiments_give_not_run_rows(synthetic_store, tmp_path):
    """No 'zero-shot' and no 'bert' experiment in the store: every paper row says 'not run'."""
    uri, _ = synthetic_store
    zs = zeroshot.display(zeroshot.build(uri))
    assert list(zs["model"]) == ["gpt2-355m", "gpt2-2.5b", "gpt2-8.3b", "previous-best"]
    assert list(zs["measured word ppl"][:3]) == [NOT_RUN] * 3
    bt = bert.display(bert.build(uri))
    assert list(bt["model"]) == ["bert-336m", "bert-1.3b", "bert-3.9b", "bert-3.9b-ensemble"]
    assert list(bt["measured total"]) == [NOT_RUN] * 4
    text = zeroshot.report(uri, tmp_path) + bert.report(uri, tmp_path)
    assert "not run" in text
    assert (tmp_path / "fig6_valid_ppl.png").stat().st_size > 5000
    assert (tmp_path / "fig7_layernorm_order.png").stat().st_size > 5000


def test_empty_store_is_a_clear_error(tmp_path, capsys):
    """`repro report` on a store without runs: exit 2, the URI and how to make runs; no store created."""
    from repro.cli import main

    db = tmp_path / "empty.db"
    uri = f"sqlite:///{db}"
    assert main(["report", "--tracking-uri", uri, "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert uri in err and "repro train" in err and "--tracking-uri" in err
    assert not db.exists() and not (tmp_path / "out").exists()


def test_paper_values_have_sources_and_match_the_paper():
    paper = paper_values()
    assert paper["source"].str.len().min() > 5
    assert not paper.duplicated(["table", "item", "metric"]).any()
    assert paper_value(paper, "scaling", "baseline", "tflops_per_gpu") == 39
    assert paper_value(paper, "scaling", "scaling-8.3b", "aggregate_pflops_tpdp") == 15.1
    assert paper_value(paper, "zero_shot", "gpt2-8.3b", "wikitext103_ppl") == 10.81
    assert paper_value(paper, "zero_shot", "gpt2-355m", "lambada_acc") == 45.18
    assert paper_value(paper, "bert", "bert-3.9b", "race_total") == 89.5
    assert paper_value(paper, "bert", "bert-336m", "mlm_valid_ppl") == 1.58
    from repro.perf.scaling_model import paper_appendix_d, paper_table1  # the performance model reads the file

    assert paper_table1() == [("scaling-1.2b", 1, 1.00, 64, 0.96), ("scaling-2.5b", 2, 0.95, 128, 0.83),
                              ("scaling-4.2b", 4, 0.82, 256, 0.79), ("scaling-8.3b", 8, 0.77, 512, 0.74)]
    assert paper_appendix_d() == ([("scaling-8.3b-16h", 0.82), ("scaling-8.3b-24h", 0.80), ("scaling-8.3b", 0.77)],
                                  [(1, 1.0), (2, 1.64), (4, 2.34), (8, 2.98)])


def test_markdown_cells():
    assert fmt(0.95, 1, pct=True) == "95.0%" and fmt(float("nan")) == "—" and fmt(1.5e-6, 4) == "1.5e-06"
    md = to_markdown(pd.DataFrame({"a": ["x|y"], "b": ["1"]}))
    assert md.splitlines() == ["| a | b |", "|---|---|", "| x/y | 1 |"]


@pytest.mark.parametrize("name", ["scaling", "zero_shot", "bert"])
def test_notebooks_are_thin_with_parameters_first(name):
    nb = json.loads((ROOT / "analysis" / f"{name}.ipynb").read_text())
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    assert "parameters" in code[0]["metadata"]["tags"]
    first = "".join(code[0]["source"])
    assert "tracking_uri" in first and "out_dir" in first and "experiment" in first
    assert sum(len("".join(c["source"]).splitlines()) for c in code[1:]) < 15
    assert all(not c.get("outputs") for c in code)  # committed without outputs


def test_lambada_protocol_label_names_a_subset():
    """A LAMBADA run over the first N passages (`repro eval lambada --max-examples N`) is not labelled
    as the paper's protocol."""
    import pandas as pd

    from repro.analysis.zeroshot import _protocol

    full = pd.Series({"tags.task": "lambada", "params.strict": "True", "params.max_examples": "all"})
    old = pd.Series({"tags.task": "lambada", "params.strict": "True"})
    subset = pd.Series({"tags.task": "lambada", "params.strict": "True", "params.max_examples": "64"})
    assert _protocol(full) == _protocol(old) == "lambada: strict (paper)"
    assert _protocol(subset) == "lambada: strict, first 64 passages only"


REDUCED = ["model.num_layers=2", "model.hidden_size=64"]


def _gpt2_run(uri: str, sets=(), status: str = "FINISHED") -> str:
    """A 'GPU' gpt2-355m training run as the trainer logs it (run name `gpt2-355m`, the config's name;
    params from flat_params with `--set` overrides `sets`); returns its id."""
    from mlflow import MlflowClient

    from repro.train.config import flat_params, load_config

    client = MlflowClient(uri)
    exp = client.get_experiment_by_name("gpt2")
    run_id = client.create_run(exp.experiment_id if exp else client.create_experiment("gpt2"),
                               run_name="gpt2-355m").info.run_id
    params = {**flat_params(load_config(ROOT / "experiments/gpt2/gpt2_355m.yaml", list(sets))),
              "device_type": "cuda", "device_name": "Synthetic GPU", "precision": "fp16", "git_sha": "abc123"}
    for key, value in params.items():
        client.log_param(run_id, key, value)
    client.set_terminated(run_id, status)
    return run_id


def _zero_shot_store(tmp_path) -> tuple[str, dict[str, str]]:
    """Two gpt2-355m training runs (one at the paper's shape, one with --set model.num_layers=2
    model.hidden_size=64) in a fresh store; returns the URI and their ids."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    return uri, {"paper": _gpt2_run(uri), "reduced": _gpt2_run(uri, REDUCED)}


def _log_eval(uri: str, run_id: str, task: str, age: float, metrics: dict, **params) -> None:
    import time

    from repro.eval.report import EvalRecord, log_to_mlflow

    base = dict(window=1024, stride=32, max_lines="all", file="wiki.test.tokens") if task == "wikitext" else \
        dict(strict=True, megatron_split=False, max_examples="all")
    log_to_mlflow(EvalRecord(task, metrics, {**base, "tp": 1, "dp": 1, **params}, training_run_id=run_id,
                             time=time.time() - age), uri)


def test_zero_shot_table_prefers_the_paper_protocol_on_the_papers_file(tmp_path):
    """WikiText-103's wiki.test.tokens (T = 270,329) at window 1024 / stride 32 is the paper protocol
    and the WikiText-2 tokens file is not; a newer quick check (40 lines, 64 passages) does not hide
    the paper-protocol result; a model without one shows the eval that scored the most of the test set."""
    uri, ids = _zero_shot_store(tmp_path)
    paper, reduced = ids["paper"], ids["reduced"]
    _log_eval(uri, paper, "wikitext", 300, {"word_ppl": 19.5, "num_bpe_tokens": 270329}, checkpoint_iteration="300000")
    # a newer eval of an earlier checkpoint (mid-training, or an older iter_* folder) does not replace it
    _log_eval(uri, paper, "wikitext", 50, {"word_ppl": 40.0, "num_bpe_tokens": 270329}, checkpoint_iteration="1000")
    _log_eval(uri, paper, "wikitext", 200, {"word_ppl": 55.0, "num_bpe_tokens": 3000}, max_lines=40,
              file="wikitext-2.test.tokens")
    _log_eval(uri, paper, "lambada", 300, {"accuracy": 0.45})
    _log_eval(uri, paper, "lambada", 100, {"accuracy": 0.10}, max_examples=64)
    _log_eval(uri, reduced, "wikitext", 300, {"word_ppl": 900.0, "num_bpe_tokens": 3001, "num_targets": 3000},
              max_lines=40)
    _log_eval(uri, reduced, "wikitext", 200, {"word_ppl": 800.0, "num_bpe_tokens": 278365, "num_targets": 278364},
              file="wikitext-2.test.tokens")
    # newer quick checks do not replace a model's fuller non-paper evals (they used to: the newest won)
    _log_eval(uri, reduced, "wikitext", 100, {"word_ppl": 700.0, "num_bpe_tokens": 3001, "num_targets": 3000},
              max_lines=40, file="wikitext-2.test.tokens")
    _log_eval(uri, reduced, "lambada", 300, {"accuracy": 0.02, "num_examples": 5153}, strict=False)
    _log_eval(uri, reduced, "lambada", 100, {"accuracy": 0.50, "num_examples": 64}, strict=False, max_examples=64)
    table = zeroshot.build(uri).set_index("model")
    row = table.loc["gpt2-355m"]
    assert (row["wikitext_word_ppl"], row["lambada_acc"]) == (19.5, 45.0) and row["training_run_id"] == paper
    assert row["protocol"] == "wikitext: paper protocol; lambada: strict (paper)"
    other = table.loc["custom L2-h64-a16-s1024"]  # a paper name on a 2-layer model: not the paper row
    assert (other["wikitext_word_ppl"], other["lambada_acc"]) == (800.0, 2.0) and not other["paper_size"]
    assert other["protocol"] == ("wikitext: reduced: window=1024, stride=32, max_lines=all, "
                                 "file=WikiText-2 tokens file (not like-for-like); lambada: NOT strict")
    shown = zeroshot.display(zeroshot.build(uri)).set_index("model")
    assert shown.loc["gpt2-355m", "measured on"] == "Synthetic GPU, paper size"
    assert shown.loc["custom L2-h64-a16-s1024", "measured on"] == "Synthetic GPU, reduced size (not a paper config)"
    # WikiText-2's zip holds a wiki.test.tokens too: its BPE count tells it from the paper's
    ev = pd.Series({"tags.task": "wikitext", "params.window": "1024", "params.stride": "32", "params.max_lines": "all",
                    "params.file": "wiki.test.tokens", "metrics.wikitext/num_bpe_tokens": 278365.0})
    assert not zeroshot.follows_paper(ev) and "T=278,365, not the paper's 270,329" in zeroshot._protocol(ev)


def test_paper_size_only_for_the_named_sizes_shape():
    """A run is labelled "paper size" (and put in the paper's row) only when the shape it logged is the
    named size's: a `--set model.num_layers=2` override of gpt2-355m, or a RACE run of a tiny BERT
    logged as bert-336m (runs before --size was inferred), is a custom model."""
    from repro.analysis import runs as R
    from repro.train.config import flat_params, load_config

    def trainer_row(*sets):
        params = flat_params(load_config(ROOT / "experiments/gpt2/gpt2_355m.yaml", list(sets)))
        return pd.Series({"params.device_type": "cuda", "params.device_name": "G",
                          **{f"params.{k}": v for k, v in params.items()}})

    full, small = trainer_row(), trainer_row("model.num_layers=2", "model.hidden_size=64")
    assert R.paper_size(full) == "gpt2-355m" and R.run_label(full) == "G, paper size"
    assert R.paper_size(small) is None and R.run_label(small) == "G, reduced size (not a paper config)"
    assert scaling._config(small) == "custom L2-h64-a16-s1024" and scaling._config(full) == "gpt2-355m"
    race = {"run_id": "r1", "params.task": "race", "params.device_type": "cpu", "params.checkpoint": "tiny.pt",
            "metrics.test/acc_total": 40.0}
    tiny = dict(race, **{"params.size": "bert-336m", "params.num_layers": "2", "params.hidden_size": "64",
                         "params.seq_length": "64"})
    real = dict(race, run_id="r2", **{"params.size": "bert-336m", "params.num_layers": "24",
                                      "params.hidden_size": "1024", "params.num_attention_heads": "16",
                                      "params.seq_length": "512"})
    rows = bert.race_runs(pd.DataFrame([tiny, real]))
    assert [(r["model"], r["label"]) for r in rows] == [("custom L2-h64-a?-s64", "CPU, reduced size (not a paper config)"),
                                                        ("bert-336m", "CPU, paper size")]


def test_race_row_prefers_the_run_with_the_most_seeds():
    """A newer one-seed check does not replace the five-seed run (the paper's median of 5) in its row."""
    shape = {"params.task": "race", "params.device_type": "cuda", "params.device_name": "G",
             "params.size": "bert-336m", "params.num_layers": "24", "params.hidden_size": "1024",
             "params.num_attention_heads": "16", "params.seq_length": "512"}
    newer = dict(shape, run_id="one", **{"params.seeds": "1", "metrics.test/acc_total": 50.0})
    older = dict(shape, run_id="five", **{"params.seeds": "1 2 3 4 5", "metrics.test/acc_total": 83.0})
    rows = bert.race_runs(pd.DataFrame([newer, older]))  # newest first, as load_runs orders them
    assert [(r["model"], r["run_id"], r["race_total"]) for r in rows] == [("bert-336m", "five", 83.0)]
    assert bert.race_runs(pd.DataFrame([newer]))[0]["run_id"] == "one"


def test_fig7_curves_come_from_the_trainers_runs(tmp_path):
    """Fig. 7 reads trainer runs (params model.layernorm_order / num_layers / hidden_size, per-step
    metric mlm_loss): the newest of each order among runs whose paper_ref names Fig. 7, so a newer
    plain BERT run is not taken; runs of the earlier standalone loop (layernorm_order, loss/mlm) too."""
    import mlflow

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    mlflow.set_tracking_uri(uri)
    mlflow.set_experiment("bert")

    def log(name, params, ref, metric, values):
        with mlflow.start_run(run_name=name, tags={"paper_ref": ref}) as run:
            mlflow.log_params({"device_type": "cpu", **params})
            for step, v in enumerate(values, 1):
                mlflow.log_metric(metric, v, step=step)
        return run.info.run_id

    fig7, size = "Fig. 7 (CPU size)", {"model.num_layers": 4, "model.hidden_size": 128}
    try:
        old = log("fig7-post-cpu", {"layernorm_order": "post", "num_layers": 4, "hidden_size": 128}, fig7,
                  "loss/mlm", [9.0, 8.0])
        assert [c["value"].tolist() for c in bert.layernorm_curves(uri).values()] == [[9.0, 8.0]]
        ids = {o: log(f"fig7-{o}-cpu", {"model.layernorm_order": o, **size}, fig7, "mlm_loss", [10.0, v])
               for o, v in (("pre", 7.0), ("post", 7.5))}
        log("bert-tiny-cpu", {"model.layernorm_order": "pre", **size}, "CPU test config", "mlm_loss", [1.0])
        curves = bert.layernorm_curves(uri)
        assert len(curves) == 2 and old[:8] not in "".join(curves)
        for (label, curve), order in zip(curves.items(), ("pre", "post")):
            assert ids[order][:8] in label and bert.ORDER_NAMES[order] in label and "4 layers, h=128" in label
            assert curve["value"].tolist() == [10.0, {"pre": 7.0, "post": 7.5}[order]]
        # a larger size (the paper's instability beyond 336M) is drawn beside the smaller one, not instead
        # of it, whichever was logged last
        big = log("fig7-post-big", {"model.layernorm_order": "post", "model.num_layers": 12,
                                    "model.hidden_size": 256}, fig7, "mlm_loss", [10.0, 11.0])
        log("fig7-pre-cpu-again", {"model.layernorm_order": "pre", **size}, fig7, "mlm_loss", [10.0, 6.5])
    finally:
        mlflow.set_tracking_uri(None)
    curves = bert.layernorm_curves(uri)
    labels = list(curves)
    assert len(labels) == 3 and ids["post"][:8] in labels[1] and big[:8] in labels[2], labels
    assert "4 layers, h=128" in labels[0] and "12 layers, h=256" in labels[2]
    assert [c["value"].tolist()[-1] for c in curves.values()] == [6.5, 7.5, 11.0]


def test_zero_shot_paper_row_needs_the_paper_shape_not_the_run_name(tmp_path):
    """`repro train gpt2_355m.yaml --set model.num_layers=2` makes a run named gpt2-355m: its eval is a
    custom model's row, and the paper's gpt2-355m row stays 'not run'."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    reduced = _gpt2_run(uri, REDUCED)
    _log_eval(uri, reduced, "wikitext", 100, {"word_ppl": 900.0, "num_bpe_tokens": 270329})
    shown = zeroshot.display(zeroshot.build(uri))
    assert shown.loc[0, "model"] == "gpt2-355m" and shown.loc[0, "measured word ppl"] == NOT_RUN
    custom = shown[shown["model"] == "custom L2-h64-a16-s1024"]
    assert list(custom["measured word ppl"]) == ["900.00"]
    assert list(custom["paper WikiText-103 ppl"]) == ["— (not a paper model)"]


def test_zero_shot_paper_row_prefers_the_run_evaluated_by_the_papers_protocol(tmp_path):
    """Two gpt2-355m runs: the older one's full paper-protocol evals fill the paper row, not the newer
    run's quick check, which is labelled another run of the paper size."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    full, quick = _gpt2_run(uri), _gpt2_run(uri)
    _log_eval(uri, full, "wikitext", 300, {"word_ppl": 19.4, "num_bpe_tokens": 270329})
    _log_eval(uri, full, "lambada", 300, {"accuracy": 0.45})
    _log_eval(uri, quick, "wikitext", 100, {"word_ppl": 60.0, "num_bpe_tokens": 3000}, max_lines=40)
    table = zeroshot.build(uri)
    assert table.loc[0, "training_run_id"] == full and table.loc[0, "wikitext_word_ppl"] == 19.4
    shown = zeroshot.display(table)
    assert shown.loc[0, "paper WikiText-103 ppl"] == "19.31" and shown.loc[0, "measured word ppl"] == "19.40"
    extra = shown[shown["measured word ppl"] == "60.00"]
    assert list(extra["model"]) == ["gpt2-355m"]
    assert list(extra["paper WikiText-103 ppl"]) == ["— (paper size, another run)"]


def test_zero_shot_untracked_checkpoints_are_kept_apart(tmp_path):
    """Evals without a training run are keyed by their checkpoint: model A's WikiText and model B's
    LAMBADA are two rows, not one 'unknown' row."""
    import time

    from repro.eval.report import EvalRecord, log_to_mlflow

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    for task, metrics, ckpt in (("wikitext", {"word_ppl": 25.0}, "/runs/modelA"),
                                ("lambada", {"accuracy": 0.6}, "/runs/modelB")):
        log_to_mlflow(EvalRecord(task, metrics, {"checkpoint": ckpt}, time=time.time()), uri)
    table = zeroshot.build(uri).set_index("model")
    assert table.loc["checkpoint:/runs/modelA", "wikitext_word_ppl"] == 25.0
    assert table.loc["checkpoint:/runs/modelB", "lambada_acc"] == pytest.approx(60.0)
    assert pd.isna(table.loc["checkpoint:/runs/modelA", "lambada_acc"])
    assert "/runs/modelB" in table.loc["checkpoint:/runs/modelB", "provenance"]


@pytest.mark.parametrize("status", ["KILLED", "FAILED", "deleted"])
def test_zero_shot_label_names_an_unfinished_training_run(tmp_path, status):
    """An eval of a preempted, failed or deleted training run's checkpoint says so in its label."""
    from mlflow import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    train = _gpt2_run(uri, status="FINISHED" if status == "deleted" else status)
    if status == "deleted":
        MlflowClient(uri).delete_run(train)
    _log_eval(uri, train, "wikitext", 100, {"word_ppl": 35.0, "num_bpe_tokens": 270329})
    shown = zeroshot.display(zeroshot.build(uri))
    assert shown.loc[0, "measured word ppl"] == "35.00"
    assert shown.loc[0, "measured on"] == f"Synthetic GPU, paper size, training run {status}"


def _points(*rows) -> pd.DataFrame:
    """Scaling points (config, gpus, TFLOP/s per device, start time) on one synthetic GPU in bf16."""
    return pd.DataFrame([{"config": c, "gpus": g, "tp": g, "dp": 1, "device": "G", "precision": "bf16",
                          "baseline_model": "scaling-1.2b", "tflops_per_device": t, "flops_counted": "hardware",
                          "label": "G, paper size", "provenance": f"run={c}-{g}-{t}", "run_id": f"{c}-{g}-{t}",
                          "start_time": start} for c, g, t, start in rows])


def test_weak_scaling_baseline_is_config_1_only():
    """No scaling-1.2b one-device run: a one-device 2.5B run is not the baseline of the paper's series."""
    nan = float("nan")
    out = scaling.add_efficiency(_points(("scaling-2.5b", 1, 300.0, 1), ("scaling-2.5b", 2, 285.0, 2),
                                         ("scaling-8.3b", 8, 240.0, 3)))
    assert out["efficiency"].isna().all() and (out["baseline_run_id"] == "").all()
    shown = scaling.display(scaling.combine(scaling.paper_points(paper_values()), out, None))
    assert set(shown.loc[shown["measured on"] != "", "measured eff."]) == {"no 1-device baseline"}
    ok = scaling.add_efficiency(_points(("scaling-2.5b", 1, 300.0, 3), ("scaling-1.2b", 1, 100.0, 1),
                                        ("scaling-2.5b", 2, 95.0, 2), ("scaling-1.2b", 1, nan, 4)))
    assert ok["efficiency"].tolist()[:3] == pytest.approx([3.0, 1.0, 0.95])  # against the 1.2B run at 100


def test_efficiency_series_keep_checkpointing_and_parameter_precision_apart():
    """A one-device run without activation checkpointing is not the baseline of checkpointed TP runs:
    hardware FLOPs count the recomputed forward only with checkpointing, so the ratio would not be a
    throughput ratio (Table 8's speed-up 1.64x for a wall-clock 1.25x, in the review's example)."""
    base, tp2 = _points(("scaling-1.2b", 1, 100.0, 1)), _points(("scaling-1.2b", 2, 95.0, 2))
    base["recipe"], tp2["recipe"] = "checkpointing False, params fp32", "checkpointing True, params fp32"
    out = scaling.add_efficiency(pd.concat([base, tp2], ignore_index=True))
    assert out.loc[0, "efficiency"] == pytest.approx(1.0) and math.isnan(out.loc[1, "efficiency"])
    tp2["recipe"] = base["recipe"].iloc[0]
    out = scaling.add_efficiency(pd.concat([base, tp2], ignore_index=True))
    assert out["efficiency"].tolist() == pytest.approx([1.0, 0.95])


def test_paper_points_take_only_runs_at_the_papers_batch():
    """Table 8 is the 1.2B model at batch 8: a TP=2 run at batch 16 is not its 2-GPU point (it is
    listed as an extra run); a run that logged no batch still matches."""
    paper = paper_values()
    runs = _points(("scaling-1.2b", 1, 100.0, 1), ("scaling-1.2b", 2, 95.0, 2))
    runs["batch"] = [8.0, 16.0]
    table = scaling.appendix_display(scaling.appendix_d(paper, scaling.add_efficiency(runs))).set_index("setting")
    assert table.loc["1.2B, batch 8, 1-way TP", "measured"] == "1.00x"
    assert table.loc["1.2B, batch 8, 2-way TP", "measured"] == "not run"
    runs["batch"] = [8.0, float("nan")]
    table = scaling.appendix_display(scaling.appendix_d(paper, scaling.add_efficiency(runs))).set_index("setting")
    assert table.loc["1.2B, batch 8, 2-way TP", "measured"] == "1.90x"


def test_the_baseline_is_at_the_papers_batch_and_appendix_d_runs_stay_out_of_table_1():
    """A newer 1-GPU config-1 run at batch 4 (a test) does not rescale every efficiency (it made config 1
    read 125%); the 1.2B strong-scaling runs and the 16/24-head 8.3B runs are Appendix D's, not extra
    Table 1 (Fig. 5) points."""
    runs = _points(("scaling-1.2b", 1, 100.0, 1), ("scaling-1.2b", 1, 80.0, 5), ("scaling-1.2b", 2, 95.0, 2),
                   ("scaling-8.3b-16h", 8, 90.0, 3), ("scaling-2.5b", 2, 97.0, 4))
    runs["batch"] = [8.0, 4.0, 8.0, 8.0, 8.0]
    out = scaling.add_efficiency(runs)
    assert out["baseline_run_id"].eq("scaling-1.2b-1-100.0").all()
    table = scaling.combine(scaling.paper_points(paper_values()), out, None)
    extras = table[table["paper_efficiency"].isna()] if "paper_efficiency" in table else table.iloc[0:0]
    assert set(extras["config"]) == {"scaling-1.2b"} and extras["batch"].tolist() == [4.0]  # only the odd batch
    assert table.loc[table["config"] == "scaling-1.2b", "efficiency"].iloc[0] == pytest.approx(1.0)


def test_scaling_shows_the_newest_run_with_a_throughput():
    """A newer run that logged no throughput (shorter than log_interval) does not hide an older one;
    shown alone it says 'no throughput logged', not 'no 1-device baseline'."""
    nan = float("nan")
    paper = scaling.paper_points(paper_values())
    both = scaling.add_efficiency(_points(("scaling-1.2b", 1, 100.0, 1), ("scaling-1.2b", 1, nan, 2)))
    shown = scaling.display(scaling.combine(paper, both, None))
    assert shown.loc[0, "measured TFLOP/s/device"] == "100.0000" and shown.loc[0, "measured eff."] == "100.0%"
    alone = scaling.add_efficiency(_points(("scaling-1.2b", 1, nan, 2)))
    assert scaling.display(scaling.combine(paper, alone, None)).loc[0, "measured eff."] == "no throughput logged"
    appendix = scaling.appendix_display(scaling.appendix_d(paper_values(), alone)).set_index("setting")
    assert appendix.loc["1.2B, batch 8, 1-way TP", "measured"] == "no throughput logged"


def test_a_newer_short_test_run_does_not_replace_the_measurement():
    """slurm/README's `--set train.train_iters=100` check of a script, run after the real 1000-iteration
    measurement, neither becomes the point nor the baseline; alone, it is shown and labelled."""
    runs = _points(("scaling-1.2b", 1, 100.0, 1), ("scaling-1.2b", 1, 70.0, 3), ("scaling-2.5b", 2, 95.0, 2),
                   ("scaling-2.5b", 2, 60.0, 4))
    runs["train_iters"] = [1000.0, 100.0, 1000.0, 100.0]
    out = scaling.add_efficiency(runs)
    assert out["baseline_run_id"].eq("scaling-1.2b-1-100.0").all()
    table = scaling.combine(scaling.paper_points(paper_values()), out, None)
    paper_rows = table[table["paper_efficiency"].notna()].set_index(["config", "gpus"])
    assert paper_rows.loc[("scaling-1.2b", 1), "tflops_per_device"] == 100.0
    assert paper_rows.loc[("scaling-2.5b", 2), "efficiency"] == pytest.approx(0.95)
    assert sorted(table.loc[table["paper_efficiency"].isna(), "train_iters"]) == [100.0, 100.0]  # listed below
    logged = {"run_id": "r", "params.model_size": "scaling-2.5b", "params.world_size": "2",
              **{f"params.{k}": v for k, v in _shape("scaling-2.5b").items()}}
    for iters, label in (("100", ", test run of 100 iterations"), ("1000", ""), (None, "")):
        run = {**logged, "params.train.train_iters": iters} if iters else logged
        shown = scaling.measured_points(pd.DataFrame([run]), lambda _: (60.0, "hardware"))
        assert shown.loc[0, "config"] == "scaling-2.5b" and shown.loc[0, "label"] == R.run_label(run) + label
    for within, label in (("false", ", TP groups across hosts"), ("true", ""), (None, "")):  # placement params
        run = {**logged, "params.train.train_iters": "1000", **({"params.tp_groups_within_host": within} if within else {})}
        shown = scaling.measured_points(pd.DataFrame([run]), lambda _: (60.0, "hardware"))
        assert shown.loc[0, "label"] == R.run_label(run) + label


def test_table_points_prefer_the_baselines_device():
    """A store with H100 and A100 runs: the baseline is the preferred config-1 run (the newest, an H100),
    and every point takes its H100 run even where an A100 run is newer; a point measured only on the
    A100 still shows, on its own A100 baseline."""
    runs = _points(("scaling-1.2b", 1, 100.0, 5), ("scaling-1.2b", 1, 40.0, 1), ("scaling-2.5b", 2, 95.0, 2),
                   ("scaling-2.5b", 2, 38.0, 6), ("scaling-4.2b", 4, 36.0, 3))
    runs["device"] = ["H100", "A100", "H100", "A100", "A100"]
    out = scaling.add_efficiency(runs)
    assert scaling.baseline_device(out) == "H100"
    table = scaling.combine(scaling.paper_points(paper_values()), out, None)
    table = table[table["paper_efficiency"].notna()].set_index(["config", "gpus"])
    assert table.loc[("scaling-2.5b", 2), "device"] == "H100"
    assert table.loc[("scaling-2.5b", 2), "efficiency"] == pytest.approx(0.95)
    assert table.loc[("scaling-4.2b", 4), "device"] == "A100"
    assert table.loc[("scaling-4.2b", 4), "efficiency"] == pytest.approx(0.9)


def test_one_device_baseline_counts_hardware_flops_like_the_papers_39(tmp_path):
    """The bench JSONs' hardware TFLOP/s and HFU (recomputation counted, as the paper's 39 TFLOP/s and
    30%) fill the compared columns; model TFLOP/s and MFU are extra columns."""
    from repro.analysis import baseline

    result = {"spec": {"dtype": "bf16", "checkpointing": True, "compile": False, "batch": 8}, "status": "ok",
              "model_tflops": 251.0, "hardware_tflops": 330.0, "mfu": 0.254, "hfu": 0.334}
    (tmp_path / "eager.json").write_text(json.dumps({"model": "scaling-1.2b", "provenance": {"device": "NVIDIA H200"},
                                                     "results": [result]}))
    shown = baseline.baseline_display(baseline.bench_baseline(tmp_path), paper_values())
    assert shown.loc[0, "TFLOP/s per device"] == "39" and shown.loc[0, "fraction of peak"] == "30%"
    assert shown.loc[1, "TFLOP/s per device"] == "330" and shown.loc[1, "fraction of peak"] == "33.4%"
    assert shown.loc[1, "model TFLOP/s"] == "251" and shown.loc[1, "MFU"] == "25.4%"
    assert shown.loc[1, "params"] == "fp32, autocast"  # a report from before `params` existed


def test_one_device_baseline_reads_every_gpu_session_folder_and_names_the_recipe(tmp_path):
    """A GPU session's output (results/bench/gpu_h200_<date>/headline/bench.json, ...) joins the table
    without copying, with its parameter precision, compile scope and the options of an A/B (the flat
    AdamW, half gradients, CUDA graphs); CPU smoke runs and other
    benchmarks' JSON are left out; the note names the highest MFU."""
    from repro.analysis import baseline

    def report(device, specs):
        results = [{"spec": {"dtype": "bf16", "checkpointing": False, "batch": 8, **spec}, "status": "ok",
                    "model_tflops": 400.0 + i, "hardware_tflops": 400.0 + i, "mfu": mfu, "hfu": mfu}
                   for i, (spec, mfu) in enumerate(specs)]
        return json.dumps({"model": "scaling-1.2b", "provenance": {"device": device, "git_sha": "abc"},
                           "results": results})

    session = tmp_path / "gpu_h200_2026-12-02"
    (session / "headline").mkdir(parents=True)
    (session / "headline" / "bench.json").write_text(report("NVIDIA H200", [({"compile": True, "params": "half"}, 0.47)]))
    (session / "compile_blocks").mkdir()
    (session / "compile_blocks" / "bench.json").write_text(
        report("NVIDIA H200", [({"compile": True, "params": "half", "compile_scope": "blocks"}, 0.44)]))
    (session / "ab").mkdir()
    (session / "ab" / "bench.json").write_text(report("NVIDIA H200", [
        ({"compile": True, "params": "half", "optimizer": "flat"}, 0.45),
        ({"compile": True, "params": "half", "main_grads": "param", "compile_mode": "reduce-overhead"}, 0.46)]))
    (tmp_path / "gpu_cpu_smoke").mkdir()
    (tmp_path / "gpu_cpu_smoke" / "bench.json").write_text(report("cpu (x86_64)", [({"compile": False}, 0.9)]))
    (tmp_path / "hf_compare.json").write_text(json.dumps({"provenance": {"device": "cpu"}, "hf_compare": {}}))
    text = baseline.write_baseline(tmp_path, tmp_path / "out", paper_values(), "sqlite:///x.db")
    shown = baseline.baseline_display(baseline.bench_baseline(tmp_path), paper_values())
    assert list(shown["source"][1:]) == ["measured: gpu_h200_2026-12-02/ab/bench.json"] * 2 + [
        "measured: gpu_h200_2026-12-02/compile_blocks/bench.json", "measured: gpu_h200_2026-12-02/headline/bench.json"]
    assert list(shown["params"][1:]) == ["half, fp32 masters, flat AdamW",
                                         "half, fp32 masters, half grads cast after backward"] + ["half, fp32 masters"] * 2
    assert list(shown["compile"][1:]) == ["whole step", "whole step, CUDA graphs", "per layer", "whole step"]
    assert "Highest MFU measured: 47.0% (gpu_h200_2026-12-02/headline/bench.json" in text
    assert (tmp_path / "out" / "scaling_baseline.csv").exists()
    assert baseline.write_baseline(tmp_path / "gpu_cpu_smoke", tmp_path / "none", paper_values(), "x") == ""


def test_report_prints_the_appendix_d_table():
    from repro.analysis import notebook

    assert "scaling_appendix_d.md" in notebook.TABLES["scaling"]


def test_bert_mlm_perplexity_is_not_taken_from_a_fig7_ablation_run(tmp_path):
    """bert-336m's MLM perplexity comes from its pre-LN pretraining run, not from the newer Fig. 7 runs
    (experiments/bert/fig7_336m_{pre,post}.yaml: same shape, 5% of training); its run id is in the row."""
    from mlflow import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    exp = client.create_experiment("bert")
    ids = {}
    for name, order, ref, ppl in (("bert-336m", "pre", "BERT results", 1.60), ("fig7-pre", "pre", "Fig. 7", 2.20),
                                  ("fig7-post", "post", "Fig. 7", 2.40)):
        run_id = client.create_run(exp, run_name=name, tags={"paper_ref": ref}).info.run_id
        for key, value in {**_shape("bert-336m"), "model_size": "bert-336m", "model.layernorm_order": order,
                           "device_type": "cuda", "device_name": "Synthetic GPU"}.items():
            client.log_param(run_id, key, value)
        client.log_metric(run_id, "valid_mlm_ppl", ppl)
        client.set_terminated(run_id)
        ids[name] = run_id
    table = bert.build(uri).set_index("model")
    assert table.loc["bert-336m", "mlm_valid_ppl"] == 1.60
    assert ids["bert-336m"][:8] in table.loc["bert-336m", "provenance"]
    assert bert.display(bert.build(uri)).loc[0, "measured MLM val ppl"] == "1.60"


def test_race_rows_take_the_mlm_perplexity_of_the_run_they_fine_tuned(tmp_path):
    """A RACE run tagged with its pretraining run (repro finetune race --checkpoint RUN_DIR logs it)
    shows that run's MLM perplexity, not the newest pretraining run of its size."""
    from mlflow import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    exp = client.create_experiment("bert")
    pretraining = {}
    for name, ppl in (("older", 1.50), ("newer", 1.70)):
        run_id = client.create_run(exp, run_name=name).info.run_id
        for key, value in {**_shape("bert-336m"), "model_size": "bert-336m", "device_type": "cuda",
                           "device_name": "Synthetic GPU"}.items():
            client.log_param(run_id, key, value)
        client.log_metric(run_id, "valid_mlm_ppl", ppl)
        client.set_terminated(run_id)
        pretraining[name] = run_id
    race = client.create_run(exp, run_name="race-bert-336m",
                             tags={"task": "race", "training_run_id": pretraining["older"]}).info.run_id
    for key, value in {"task": "race", "size": "bert-336m", "seeds": "1 2 3 4 5", "num_layers": 24,
                       "hidden_size": 1024, "num_attention_heads": 16, "seq_length": 512, "device_type": "cuda",
                       "device_name": "Synthetic GPU", "checkpoint": "/runs/bert_336m-1"}.items():
        client.log_param(race, key, value)
    client.log_metric(race, "test/acc_total", 80.0)
    client.set_terminated(race)
    row = bert.build(uri).set_index("model").loc["bert-336m"]
    assert row["race_total"] == 80.0 and row["mlm_valid_ppl"] == 1.50 and row["mlm_run_id"] == pretraining["older"]


def test_smoke_jobs_evaluations_and_fine_tunes_stay_out_of_the_tables(tmp_path):
    """zeroshot_eval.sh --smoke scores a model that a --smoke job trained (experiment slurm-smoke), and
    race_finetune.sh --smoke logs size `smoke`: pipeline checks, not rows of Table 3 or 5."""
    from mlflow import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    smoke = client.create_run(client.create_experiment("slurm-smoke"), run_name="smoke-scale_8b").info.run_id
    client.set_terminated(smoke)
    _log_eval(uri, smoke, "wikitext", 10, {"word_ppl": 900.0, "num_bpe_tokens": 3001}, max_lines=40)
    kept = _gpt2_run(uri)
    _log_eval(uri, kept, "wikitext", 10, {"word_ppl": 30.0, "num_bpe_tokens": 3001}, max_lines=40)
    assert set(zeroshot.build(uri)["training_run_id"].dropna()) == {kept}
    race = client.create_run(client.create_experiment("bert"), run_name="race-smoke").info.run_id
    for key, value in {"task": "race", "size": "smoke", "seeds": "1234 1235", "num_layers": 2}.items():
        client.log_param(race, key, value)
    client.log_metric(race, "test/acc_total", 30.0)
    client.set_terminated(race)
    assert "smoke" not in set(bert.build(uri)["model"])


def test_table2_days_per_epoch_from_a_gpt2_runs_logged_intervals(tmp_path):
    """Table 2 is rebuilt from the GPT-2 runs: median ms/iter (warm-up interval dropped) x 68,507, plus
    the epoch's evaluations and saves at the run's intervals (1000 each in experiments/gpt2/base.yaml);
    an unfinished run counts, labelled; a run at another GPU count is an extra row."""
    from mlflow import MlflowClient

    from repro.analysis import gpt2

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    paper_run = _gpt2_run(uri, status="RUNNING")
    client.log_param(paper_run, "world_size", 64)
    for step, ms in ((100, 900.0), (200, 1000.0), (300, 1000.0), (400, 1100.0)):
        client.log_metric(paper_run, "ms_per_iter", ms, step=step)
    client.log_metric(paper_run, "eval_seconds", 30.0, step=1000)
    client.log_metric(paper_run, "save_seconds", 60.0, step=1000)
    small = _gpt2_run(uri, REDUCED)
    client.log_param(small, "world_size", 8)
    client.log_metric(small, "ms_per_iter", 50.0, step=100)
    table = gpt2.build(uri).set_index("model")
    row = table.loc["gpt2-355m"]
    assert row["ms_per_iter"] == 1000.0 and row["days_steps"] == pytest.approx(68507 / 86400)
    assert row["days_per_epoch"] == pytest.approx((68507 + 90 * 68.507) / 86400)
    assert row["paper_days_per_epoch"] == 0.86 and "running (unfinished run)" in row["label"]
    assert table.loc["custom L2-h64-a16-s1024", "gpus"] == 8
    shown = gpt2.display(gpt2.build(uri)).set_index("model")
    assert shown.loc["gpt2-2.5b", "measured days/epoch"] == "not run"
    failed = _gpt2_run(uri, status="FAILED")  # a newer attempt that failed before its first interval
    client.log_param(failed, "world_size", 64)
    table = gpt2.build(uri)
    rows = table[table["model"] == "gpt2-355m"]
    assert list(rows["run_id"]) == [paper_run, failed]  # the paper row keeps the measured run; the failed
    assert rows.iloc[0]["paper_days_per_epoch"] == 0.86  # one is listed after, as an extra row
    assert "gpt2_table2.md" in __import__("repro.analysis.notebook", fromlist=["TABLES"]).TABLES["zero_shot"]


def test_table2_counts_the_papers_epoch_in_tokens_at_a_runs_own_batch(tmp_path):
    """One epoch is 68,507 iterations of 512 x 1024 tokens: a run at global batch 64 takes 8x the
    iterations for it (not 68,507 of its own smaller ones), and does not fill the paper's row."""
    from mlflow import MlflowClient

    from repro.analysis import gpt2

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    small_batch = _gpt2_run(uri, ["train.global_batch_size=64"])
    client.log_param(small_batch, "world_size", 64)
    for step in (100, 200, 300):
        client.log_metric(small_batch, "ms_per_iter", 200.0, step=step)
    table = gpt2.build(uri)
    paper_row, extra = table.iloc[0], table.iloc[3]
    assert paper_row["model"] == "gpt2-355m" and pd.isna(paper_row.get("run_id"))  # not the paper's batch
    assert extra["run_id"] == small_batch and "global batch 64" in extra["label"]
    assert extra["days_steps"] == pytest.approx(200.0 * 68507 * 8 / 86_400_000)
    assert gpt2.display(table).iloc[0]["measured days/epoch"] == NOT_RUN


def test_a_relative_sqlite_uri_reaches_the_notebooks(synthetic_store, tmp_path, monkeypatch, capsys):
    """`repro report --tracking-uri sqlite:///mlruns/mlflow.db` from the directory holding it: the
    notebooks run in analysis/, where that relative path named no store, so every row said 'not run'
    (exit 0). The URI is made absolute first."""
    import shutil

    from repro.cli import main

    (tmp_path / "mlruns").mkdir()
    shutil.copy(R._sqlite_file(synthetic_store[0]), tmp_path / "mlruns" / "mlflow.db")
    monkeypatch.chdir(tmp_path)
    assert R.resolve_uri("sqlite:///mlruns/mlflow.db") == f"sqlite:///{tmp_path}/mlruns/mlflow.db"
    assert main(["report", "--tracking-uri", "sqlite:///mlruns/mlflow.db", "--out", "out", "--only", "scaling"]) == 0
    assert "| 95.0% |" in (tmp_path / "out" / "scaling_table.md").read_text()


def test_report_refuses_a_sqlite_uri_that_is_not_an_mlflow_store(tmp_path, capsys):
    """A text file, a directory, or another program's sqlite database: a clear error, exit 2 (were
    tracebacks; the last one silently got MLflow's tables written into it)."""
    import sqlite3

    from repro.cli import main

    (tmp_path / "notes.txt").write_text("not a database\n")
    (tmp_path / "dir.db").mkdir()
    with sqlite3.connect(tmp_path / "other.db") as db:
        db.execute("CREATE TABLE t (x)")
    for name, needle in (("notes.txt", "which is not a sqlite database"), ("dir.db", "which is not a file"),
                         ("other.db", "a sqlite database of other tables (t), not an MLflow store")):
        assert main(["report", "--tracking-uri", f"sqlite:///{tmp_path / name}", "--out", str(tmp_path / "out")]) == 2
        err = capsys.readouterr().err
        assert needle in err and "Fix:" in err, err
    with sqlite3.connect(tmp_path / "other.db") as db:
        assert [r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type='table'")] == ["t"]
    assert not (tmp_path / "out").exists()


def test_a_point_prefers_a_run_with_an_efficiency_over_a_newer_one_without():
    """Config 2 measured in bf16 (95% of the bf16 baseline) and, later, checked in fp32 with no fp32
    baseline: the row shows the bf16 run's 95%, not the newer run's 'no 1-device baseline'."""
    runs = _points(("scaling-1.2b", 1, 100.0, 1), ("scaling-2.5b", 2, 95.0, 2), ("scaling-2.5b", 2, 40.0, 3))
    runs.loc[2, "precision"] = "fp32"
    table = scaling.combine(scaling.paper_points(paper_values()), scaling.add_efficiency(runs), None)
    point = table[table["paper_efficiency"].notna()].set_index(["config", "gpus"]).loc[("scaling-2.5b", 2)]
    assert point["efficiency"] == pytest.approx(0.95) and point["run_id"] == "scaling-2.5b-2-95.0"
    assert "scaling-2.5b-2-40.0" in set(table.loc[table["paper_efficiency"].isna(), "run_id"])  # listed below
