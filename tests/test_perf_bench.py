"""Issue 9: `repro bench` on a tiny model writes valid JSON and Markdown (no speed is asserted)."""

from __future__ import annotations

import json

from repro.cli import main


def test_repro_bench_tiny_writes_results(tmp_path):
    assert main(["bench", "--tiny", "--rounds", "1", "--no-zero", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "bench_cpu.json").read_text())
    a = report["hf_compare"]
    assert set(a["ratio_hf_over_ours"]) == {"forward", "backward", "optimizer", "step"}
    assert all(v > 0 for v in a["ratio_hf_over_ours"].values())
    assert report["tp_comm"]["equal_on_every_rank"] is True
    for row in report["memory"]:
        assert row["rel_error_params"] == 0 and row["rel_error_optimizer"] == 0, row
    for name in ("hf_compare", "tp_comm", "memory"):
        assert name in json.loads((tmp_path / f"{name}.json").read_text())
    md = (tmp_path / "bench_cpu.md").read_text()
    assert "HF / ours" in md and "Exactly equal on every rank: **True**" in md


def test_bad_rounds_is_a_user_error(tmp_path, capsys):
    assert main(["bench", "--rounds", "0", "--out", str(tmp_path)]) == 2
    assert "--rounds" in capsys.readouterr().err


def test_scaling_model_command_writes_tables(tmp_path):
    assert main(["scaling-model", "--out", str(tmp_path)]) == 0
    assert (tmp_path / "table.csv").read_text().count("\n") == 17
    assert "mean absolute error" in (tmp_path / "table.md").read_text()
