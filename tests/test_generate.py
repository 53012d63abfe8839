"""`repro generate`: the sampling filters, TP=2 generation equal to serial, and the command end to end."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from eval_helpers import mirror, write_tiny_checkpoint
from repro.eval.generate import Sampling, choose, filter_logits, generate
from repro.parallel.spawn import run_ranks

PROBS = torch.tensor([0.5, 0.3, 0.15, 0.05], dtype=torch.float64)


def _kept(logits: torch.Tensor) -> list[int]:
    return torch.isfinite(logits).nonzero().flatten().tolist()


def test_top_k_keeps_the_k_most_probable_and_their_ties():
    logits = torch.tensor([1.0, 4.0, 3.0, 3.0, 0.0])
    assert _kept(filter_logits(logits, top_k=2)) == [1, 2, 3]  # 3.0 ties with the 2nd
    assert _kept(filter_logits(logits, top_k=1)) == [1]
    assert _kept(filter_logits(logits, top_k=0)) == [0, 1, 2, 3, 4]
    assert torch.equal(logits, torch.tensor([1.0, 4.0, 3.0, 3.0, 0.0]))  # the input is not changed


@pytest.mark.parametrize("top_p, kept", [(0.79, [0, 1]), (0.81, [0, 1, 2]), (0.01, [0]), (1.0, [0, 1, 2, 3])])
def test_top_p_keeps_the_smallest_set_reaching_the_mass(top_p, kept):
    shuffled = torch.tensor([2, 0, 3, 1])  # the order in the vocabulary does not matter
    logits = PROBS.log()[shuffled]
    assert sorted(shuffled[_kept(filter_logits(logits, top_p=top_p))].tolist()) == kept


def _frequencies(sampling: Sampling, draws: int = 20_000) -> torch.Tensor:
    gen = torch.Generator().manual_seed(sampling.seed)
    counts = torch.bincount(torch.tensor([choose(PROBS.log(), sampling, gen) for _ in range(draws)]),
                            minlength=len(PROBS))
    return counts.double() / draws


@pytest.mark.parametrize("sampling, expected", [
    (Sampling(), PROBS),
    (Sampling(top_k=2), torch.tensor([0.625, 0.375, 0.0, 0.0], dtype=torch.float64)),
    (Sampling(temperature=2.0), PROBS.sqrt() / PROBS.sqrt().sum()),
    (Sampling(temperature=0.0), torch.tensor([1.0, 0.0, 0.0, 0.0], dtype=torch.float64)),
])
def test_draws_follow_the_filtered_tempered_distribution(sampling, expected):
    """20,000 seeded draws: within 0.015 of each probability (over 4 binomial standard deviations),
    and never a filtered-out token."""
    freq = _frequencies(sampling)
    assert torch.allclose(freq, expected, atol=0.015), (freq, expected)
    assert torch.all(freq[expected == 0] == 0)


def test_settings_errors_name_the_fix():
    bad = Sampling(max_new_tokens=0, temperature=-1.0, top_k=-2, top_p=1.5, seed=2**64).problems()
    assert len(bad) == 5 and all("give" in p for p in bad)  # the seed overflowed torch's manual_seed (exit 1)
    assert Sampling().problems() == [] and Sampling(temperature=0.0, top_p=0.1).problems() == []
    assert Sampling(seed=-1).problems() == Sampling(seed=2**64 - 1).problems() == []


def test_a_tiny_temperature_samples_the_most_probable_token_not_nan():
    """logits / 1e-310 overflowed to inf and the softmax to nan (a RuntimeError from multinomial)."""
    assert _frequencies(Sampling(temperature=1e-310), draws=100).tolist() == [1.0, 0.0, 0.0, 0.0]


def _model(tp_group, seq_length=16):
    from repro.models.config import ModelConfig
    from repro.models.gpt import GPT

    cfg = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=seq_length, vocab_size=1000,
                      hidden_dropout=0.0, attention_dropout=0.0)
    return GPT(cfg, tp_group, seed=3).double().eval()  # same master weights at every TP degree


def _reference_greedy(model, prompt: list[int], steps: int) -> list[int]:
    """The plainest loop: the serial model's full logits, argmax over the real vocabulary."""
    ids = list(prompt)
    for _ in range(steps):
        logits = model(torch.tensor([ids[-model.cfg.seq_length:]]))[0, -1, :model.cfg.vocab_size]
        ids.append(int(logits.argmax()))
    return ids[len(prompt):]


PROMPT = list(range(100, 120))  # 20 tokens: longer than the 16-position window


def _generations(pg) -> dict:
    model, eod = _model(pg.tp_group), 999  # an id the untrained model does not emit here
    out = {}
    for name, sampling in {"greedy": Sampling(12, temperature=0.0),
                           "sampled": Sampling(12, temperature=0.9, top_k=50, top_p=0.95, seed=5)}.items():
        out[name] = generate(model, pg.tp_group, PROMPT, sampling, eod, torch.Generator().manual_seed(sampling.seed))
    return out


def _rank() -> dict:
    from repro.parallel.groups import ParallelDims, ProcessGroups, build_process_groups

    serial = ProcessGroups.single()
    return {"serial": _generations(serial), "tp2": _generations(build_process_groups(ParallelDims(tp=2, dp=1))),
            "reference": _reference_greedy(_model(None), PROMPT, 12)}


def test_tp2_generation_equals_serial_and_the_plain_loop():
    """float64 model: TP changes only summation order (~1e-15), far below any logit gap that decides
    a token here, so the token sequences must be identical."""
    ranks = run_ranks(_rank, 2, timeout=120)
    for rank in ranks:
        assert rank["serial"]["greedy"] == rank["reference"]
        assert rank["tp2"] == ranks[0]["serial"]  # both TP ranks draw the same tokens, equal to serial
    assert len(ranks[0]["serial"]["sampled"]) == 12
    assert ranks[0]["serial"]["sampled"] != ranks[0]["serial"]["greedy"]


def test_generation_stops_at_end_of_text():
    model = _model(None)
    first = _reference_greedy(model, PROMPT, 1)[0]
    assert generate(model, None, PROMPT, Sampling(10, temperature=0.0), first, torch.Generator()) == []


def _cli(argv) -> int:
    from repro.cli import main

    return main(argv)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("gen") / "run", "run-xyz", seq_length=32)


def test_command_writes_what_it_prints_and_matches_the_library(checkpoint, tmp_path, capsys):
    from repro.data.tokenizers import build_tokenizer
    from repro.parallel.groups import ProcessGroups
    from repro.train.reshard import load_model_for_eval

    out = tmp_path / "samples.json"
    args = ["generate", "--checkpoint", str(checkpoint), "--prompt", "The tower is", "--max-new-tokens", "9",
            "--top-k", "40", "--num-samples", "2", "--seed", "7", "--data-dir", str(mirror()), "--out", str(out)]
    assert _cli(args) == 0
    printed = capsys.readouterr().out
    record = json.loads(out.read_text())
    assert record["training_run_id"] == "run-xyz" and record["iteration"] == 5 and record["tp"] == 1
    assert record["sampling"] == {"max_new_tokens": 9, "temperature": 1.0, "top_k": 40, "top_p": 1.0, "seed": 7}
    tok = build_tokenizer("gpt2", mirror())
    model = load_model_for_eval(checkpoint, ProcessGroups.single())
    gen = torch.Generator().manual_seed(7)
    for sample in record["samples"]:
        assert sample["tokens"] == generate(model, None, tok.encode("The tower is"), Sampling(9, top_k=40, seed=7),
                                            tok.eod, gen)
        assert sample["text"] == tok.decode(sample["tokens"]) and "The tower is" + sample["text"] in printed
    assert record["samples"][0]["tokens"] != record["samples"][1]["tokens"]  # the generator runs on


def test_command_at_tp2_under_torchrun_prints_the_serial_text(checkpoint, tmp_path):
    base = ["generate", "--checkpoint", str(checkpoint), "--prompt", "Megatron", "--max-new-tokens", "8",
            "--top-p", "0.9", "--data-dir", str(mirror())]
    assert _cli([*base, "--out", str(tmp_path / "tp1.json")]) == 0
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           "-m", "repro.cli", *base, "--tp", "2", "--out", str(tmp_path / "tp2.json")],
                          capture_output=True, text=True, env=env, timeout=180)
    assert proc.returncode == 0, proc.stderr[-2000:]
    tp1, tp2 = (json.loads((tmp_path / f).read_text()) for f in ("tp1.json", "tp2.json"))
    assert tp2["tp"] == 2 and tp2["samples"] == tp1["samples"]
    assert proc.stdout.count("=== sample 1/1") == 1  # printed by rank 0 only


def test_bad_input_exits_2_naming_the_fix_and_keeps_files(checkpoint, tmp_path, capsys):
    kept = tmp_path / "kept.json"
    kept.write_text("earlier samples")
    base = ["generate", "--checkpoint", str(checkpoint), "--data-dir", str(mirror())]
    cases = [(["--top-p", "0", "--out", str(kept)], "--top-p 0.0: give a probability"),
             (["--out", str(tmp_path)], "is a directory: give a file"),
             (["--prompt-file", str(tmp_path / "none.txt")], "no such file"),
             (["--tp", "2"], "launch with `torchrun --nproc-per-node 2"),
             (["--num-samples", "0"], "--num-samples 0: give 1 or more")]
    for extra, message in cases:
        assert _cli([*base, *extra]) == 2, extra
        assert message in capsys.readouterr().err, extra
    assert _cli(["generate", "--checkpoint", str(tmp_path / "nothing")]) == 2
    assert "no checkpoint at" in capsys.readouterr().err
    assert kept.read_text() == "earlier samples"
    assert Path(tmp_path / "none.txt").exists() is False
