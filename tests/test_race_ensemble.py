"""Table 5's last number, the 3.9B "5-way ensemble" (93.1 / 90.0 / 90.9): `repro finetune race` keeps each
seed's option probabilities on dev and test, and scores the seeds' models together (probabilities
averaged over the seeds), beside the median seed; the BERT table shows it against the paper's row."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from repro.cli import main
from repro.eval.race import RaceTensors, accuracy_by_level
from repro.eval.race_finetune import FinetuneResult, ensemble_accuracy
from test_race import FIXTURE, write_fixture_vocab
from test_race_inputs_review import TINY_YAML


def _split(labels: list[int], levels: list[str]) -> RaceTensors:
    empty = torch.zeros(len(labels), 4, 1, dtype=torch.long)
    return RaceTensors(empty, empty, empty, torch.tensor(labels), levels)


def _one_hot_ish(right: list[bool], labels: list[int]) -> list[list[float]]:
    """Probabilities putting 0.7 on the label where `right`, else 0.7 on the next option."""
    rows = []
    for ok, label in zip(right, labels):
        row = [0.1] * 4
        row[label if ok else (label + 1) % 4] = 0.7
        rows.append(row)
    return rows


def test_the_ensemble_averages_probabilities_and_can_beat_every_seed():
    """Three seeds, each wrong on a different question of three: each scores 66.7%, their average 100%."""
    labels, levels = [0, 1, 2], ["middle", "high", "high"]
    split = {"dev": _split(labels, levels), "test": _split(labels, levels)}
    results = []
    for seed, wrong in enumerate(range(3)):
        right = [q != wrong for q in range(3)]
        probs = _one_hot_ish(right, labels)
        acc = accuracy_by_level(torch.tensor(probs).argmax(-1), split["test"].labels, levels)
        results.append(FinetuneResult(seed, {"dev": acc, "test": acc}, [1.0], {"dev": probs, "test": probs}))
    assert all(r.accuracy["test"]["total"] == pytest.approx(200 / 3) for r in results)
    together = ensemble_accuracy(results, split)
    assert together["test"] == {"middle": 100.0, "high": 100.0, "total": 100.0} == together["dev"]
    assert ensemble_accuracy(results[:1], split) == {}  # one model is no ensemble
    old = FinetuneResult(9, results[0].accuracy, [1.0])  # a seed saved before probabilities were kept
    assert ensemble_accuracy([old, *results[:2]], split) == ensemble_accuracy(results[:2], split)  # left out
    assert ensemble_accuracy([old, results[0]], split) == {}


@pytest.fixture(scope="module")
def vocab(tmp_path_factory) -> Path:
    return write_fixture_vocab(tmp_path_factory.mktemp("vocab") / "vocab.txt")


def test_finetune_race_scores_its_seeds_together_logs_and_tabulates_it(tmp_path, vocab, monkeypatch):
    """Three seeds of a tiny BERT on the RACE fixture: results.json's ensemble equals the average of the
    seed files' probabilities scored against the fixture's labels; MLflow has ensemble/test/acc_* and
    ensemble/seeds; the BERT table puts the ensemble in a row of its own beside the median seed's."""
    import mlflow

    from repro.analysis import bert as bert_table
    from repro.data.tokenizers import bert_tokenizer
    from repro.eval.race import encode_race, load_race

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    run = tmp_path / "run"
    argv = ["finetune", "race", "--race-dir", str(FIXTURE), "--vocab", str(vocab), "--model-config", str(TINY_YAML),
            "--run-dir", str(run), "--batch-size", "5", "--seq-length", "32", "--epochs", "1", "--seeds", "1", "2", "3"]
    assert main(argv) == 0
    results = json.loads((run / "results.json").read_text())
    seeds = [json.loads((run / "seeds" / f"seed_{s}.json").read_text()) for s in (1, 2, 3)]
    test = encode_race(load_race(FIXTURE, "test"), bert_tokenizer(vocab), 32)
    mean = torch.tensor([s["probabilities"]["test"] for s in seeds]).mean(0)
    assert results["ensemble"]["test"] == pytest.approx(accuracy_by_level(mean.argmax(-1), test.labels, test.levels))
    for seed in seeds:  # each seed's probabilities give its own logged accuracy
        own = torch.tensor(seed["probabilities"]["test"]).argmax(-1)
        assert seed["accuracy"]["test"] == pytest.approx(accuracy_by_level(own, test.labels, test.levels))

    logged = mlflow.MlflowClient(uri).get_run((run / "mlflow_run_id").read_text()).data.metrics
    assert logged["ensemble/seeds"] == 3
    assert logged["ensemble/test/acc_total"] == pytest.approx(results["ensemble"]["test"]["total"])
    table = bert_table.build(uri).set_index("model")
    paper = table.loc["bert-3.9b-ensemble"]
    assert (paper["paper_race_middle"], paper["paper_race_high"], paper["paper_race_total"]) == (93.1, 90.0, 90.9)
    ours = [m for m in table.index if m.endswith("-ensemble") and m != "bert-3.9b-ensemble"]
    assert len(ours) == 1 and "3-way ensemble of its seeds' models" in table.loc[ours[0], "label"]
    assert table.loc[ours[0], "race_total"] == pytest.approx(results["ensemble"]["test"]["total"])
    assert table.loc[ours[0].removesuffix("-ensemble"), "race_total"] == pytest.approx(results["median"]["test"]["total"])


def test_seeds_an_earlier_run_finished_without_probabilities_are_named_and_left_out(tmp_path, vocab, capsys):
    """A run dir whose seed 1 was finished by code that kept no option probabilities: the rerun with seeds
    1 2 3 reuses seed 1 for the median, leaves it out of the ensemble and says so."""
    run = tmp_path / "run"
    argv = ["finetune", "race", "--race-dir", str(FIXTURE), "--vocab", str(vocab), "--model-config", str(TINY_YAML),
            "--run-dir", str(run), "--batch-size", "5", "--seq-length", "32", "--epochs", "1", "--no-mlflow"]
    assert main([*argv, "--seeds", "1"]) == 0
    seed_file = run / "seeds" / "seed_1.json"
    older = json.loads(seed_file.read_text())
    del older["probabilities"]
    seed_file.write_text(json.dumps(older))
    capsys.readouterr()
    assert main([*argv, "--seeds", "1", "2", "3"]) == 0
    out = capsys.readouterr().out
    assert "ensemble: seed 1 (finished by an earlier run that kept no option probabilities) left out" in out, out
    assert "the 2 seeds' models together" in out, out
    results = json.loads((run / "results.json").read_text())
    assert [s["seed"] for s in results["seeds"]] == [1, 2, 3] and "test" in results["ensemble"]
