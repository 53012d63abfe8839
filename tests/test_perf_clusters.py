"""Your own cluster for `repro plan` and `repro scaling-model` (repro/perf/clusters.py): the shipped
cluster files are the built-in clusters, the model scales as its rates do, and a file that cannot
describe a cluster is an error naming the field and the fix."""

from __future__ import annotations

import json
from dataclasses import asdict, replace
from pathlib import Path

import pytest
import yaml

from repro.cli import main
from repro.perf.clusters import BUILT_IN, ClusterSpecError, load_cluster

ROOT = Path(__file__).resolve().parents[1]
CLUSTER_FILES = ROOT / "slurm" / "clusters"
CONFIG = str(ROOT / "experiments/gpt2/gpt2_8.3b.yaml")


def _write(path: Path, **fields) -> Path:
    path.write_text(yaml.safe_dump(fields, sort_keys=False))
    return path


def _plan_json(capsys, *args: str) -> dict:
    assert main(["plan", CONFIG, "--json", *args]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("name", sorted(BUILT_IN))
def test_the_shipped_cluster_files_are_the_built_in_clusters(name, capsys):
    assert load_cluster(CLUSTER_FILES / f"{name}.yaml") == BUILT_IN[name]
    by_file = _plan_json(capsys, "--cluster", str(CLUSTER_FILES / f"{name}.yaml"))
    assert by_file == _plan_json(capsys, "--cluster", name)


def test_a_cluster_twice_as_fast_in_every_rate_halves_the_iteration_time(tmp_path, capsys):
    """The model is homogeneous in its rates: peak, HBM, NVLink and network bandwidth x2 and latencies
    /2 (the calibration fraction kept) halve every term, so the plan's iteration time halves exactly."""
    h200 = BUILT_IN["h200"]
    fast = replace(h200, name="twice an H200 cluster", peak_tflops=2 * h200.peak_tflops, hbm_gbps=2 * h200.hbm_gbps,
                   intra_gbps=2 * h200.intra_gbps, node_net_gbps=2 * h200.node_net_gbps,
                   alpha_intra_s=h200.alpha_intra_s / 2, alpha_inter_s=h200.alpha_inter_s / 2)
    path = _write(tmp_path / "fast.yaml", **asdict(fast))
    slow, quick = _plan_json(capsys, "--cluster", "h200"), _plan_json(capsys, "--cluster", str(path))
    assert quick["time"]["iteration_s"] == pytest.approx(slow["time"]["iteration_s"] / 2, rel=1e-12)
    assert quick["cluster"] == "twice an H200 cluster" and quick["memory_bytes"] == slow["memory_bytes"]


def test_scaling_model_on_your_cluster_writes_its_tables(tmp_path):
    mine = _write(tmp_path / "mine.yaml", **{**asdict(BUILT_IN["h200"]), "name": "my A100 nodes", "peak_tflops": 312.0,
                                             "hbm_gbps": 2039.0, "intra_gbps": 300.0, "node_net_gbps": 200.0,
                                             "memory_gib": 79.1, "baseline_fraction": 0.4})
    out = tmp_path / "tables"
    assert main(["scaling-model", "--cluster", str(mine), "--cluster", "dgx2h", "--out", str(out)]) == 0
    md = (out / "table.md").read_text()
    assert md.count("| my A100 nodes | scaling-") == 8 and md.count("| DGX-2H (V100 SXM3) | scaling-") == 8
    assert "DGX-2H mean absolute error over the 8 points: 5.0" in md and "for my A100 nodes; DGX-2H" in md
    assert main(["scaling-model", "--cluster", str(mine), "--out", str(tmp_path / "alone")]) == 0
    assert "mean absolute error" not in (tmp_path / "alone" / "table.md").read_text()  # no paper hardware


def test_scaling_model_on_your_cluster_without_out_keeps_the_committed_tables(tmp_path, monkeypatch):
    """--cluster FILE with no --out rewrote results/scaling_model with that cluster's rows alone (the
    committed DGX-2H table and its error line gone); it now writes a folder of its own."""
    from repro.perf.commands import scaling_out_dir

    mine = _write(tmp_path / "my nodes.yaml", **{**asdict(BUILT_IN["h200"]), "name": "my nodes"})
    monkeypatch.chdir(tmp_path)
    (tmp_path / "results" / "scaling_model").mkdir(parents=True)
    (tmp_path / "results" / "scaling_model" / "table.md").write_text("the committed table")
    assert main(["scaling-model", "--cluster", str(mine), "--cluster", "dgx2h"]) == 0
    assert (tmp_path / "results" / "scaling_model" / "table.md").read_text() == "the committed table"
    assert "| my nodes | scaling-" in (tmp_path / "results" / "scaling_model_my_nodes-dgx2h" / "table.md").read_text()
    assert scaling_out_dir(None) == scaling_out_dir([]) == Path("results/scaling_model")


@pytest.mark.parametrize("change, message", [
    ({"peak_tflop": 989.0}, "unknown field(s) ['peak_tflop']; missing field(s) ['peak_tflops']"),
    ({"gpus_per_node": "eight"}, "gpus_per_node"),
    ({"baseline_fraction": 0.0}, "baseline_fraction=0.0 must be in (0, 1]"),
    ({"baseline_fraction": 34}, "python -m repro.perf.gpu_bench --out DIR --dtypes bf16 --checkpointing on"),
    ({"node_net_gbps": -1}, "node_net_gbps=-1.0 must be a positive number"),
    ({"peak_tflops": float("nan")}, "peak_tflops=nan must be a positive number"),
    ({"alpha_inter_s": float("nan")}, "alpha_intra_s / alpha_inter_s must be numbers of seconds"),
    # a measured fraction the model can only meet with GEMMs above peak, or with no time left for them
    ({"baseline_fraction": 0.8, "fused_attention": False}, "leaves the GEMMs 1"),
    ({"hbm_gbps": 10.0}, "leaves no time for the GEMMs"),
])
def test_a_bad_cluster_file_is_an_error_naming_field_and_fix(tmp_path, capsys, change, message):
    fields = {**asdict(BUILT_IN["h200"]), **change}
    if "peak_tflop" in change:
        del fields["peak_tflops"]
    path = _write(tmp_path / "bad.yaml", **fields)
    with pytest.raises(ClusterSpecError, match="bad.yaml"):
        load_cluster(path)
    assert main(["plan", CONFIG, "--cluster", str(path)]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err, err


def test_an_unknown_cluster_names_the_built_in_ones_and_the_template(capsys):
    assert main(["plan", CONFIG, "--cluster", "a100"]) == 2
    err = capsys.readouterr().err
    assert "--cluster a100: neither a built-in cluster (dgx2h, h200) nor a file" in err
    assert "copy slurm/clusters/h200.yaml" in err


def test_plan_paper_on_one_cluster_file(tmp_path, capsys):
    assert main(["plan", "--paper", "--cluster", str(CLUSTER_FILES / "dgx2h.yaml"), "--out", str(tmp_path)]) == 0
    md = (tmp_path / "paper_configs.md").read_text()
    assert "dgx2h.yaml (the cluster column)" in md and "| h200 |" not in md
