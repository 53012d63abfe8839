"""Issue 5: TP=2 and DP=2 evaluation equal the serial (TP=1) evaluation of the same weights."""

from __future__ import annotations

import pytest
import torch

from eval_helpers import mirror
from repro.parallel.spawn import run_ranks

TOL = 1e-10  # float64 models: TP/DP change only the summation order


def _tiny_gpt(tp_group):
    from repro.models.config import ModelConfig
    from repro.models.gpt import GPT

    cfg = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=64,
                      hidden_dropout=0.0, attention_dropout=0.0)
    return GPT(cfg, tp_group, seed=7).double().eval()  # same master weights at every TP degree


def _inputs(data_dir):
    """1,500 WikiText BPE tokens (first 40k characters) and 24 LAMBADA examples."""
    from repro.data.tokenizers import build_tokenizer
    from repro.eval.detokenize import wikitext_detokenize
    from repro.eval.lambada import build_examples, read_passages
    from repro.eval.wikitext import WikitextData

    tok = build_tokenizer("gpt2", data_dir)
    text = (data_dir / "wikitext" / "wikitext-2.test.tokens").read_text(encoding="utf-8")[:40_000]
    data = WikitextData(tok.encode(wikitext_detokenize(text))[:1500], 1300)
    examples = build_examples(read_passages(data_dir / "lambada" / "lambada_openai.test.jsonl")[:24], tok)
    return data, examples, tok.eod


def _evaluate(pg, data, examples, pad_id) -> dict:
    from repro.eval.lambada import evaluate_lambada
    from repro.eval.wikitext import evaluate_perplexity

    model = _tiny_gpt(pg.tp_group)
    ppl = evaluate_perplexity(model, pg, data, window=64, stride=16, batch_size=4, pad_id=pad_id)
    lam = evaluate_lambada(model, pg, examples, batch_size=5, pad_id=pad_id)
    return {"ppl": ppl.metrics(), "lambada": lam.metrics()}


def _argmax_ties(pg) -> list[int]:
    from repro.eval.scoring import vocab_parallel_argmax

    full = torch.tensor([[1.0, 5.0, 5.0, 2.0], [0.0, 0.0, 0.0, 9.0], [3.0, 3.0, 3.0, 3.0]])
    local = full.chunk(pg.tp_size, dim=-1)[pg.tp_rank]
    return vocab_parallel_argmax(local, pg.tp_group).tolist()


def _rank(data_dir) -> dict:
    from repro.parallel.groups import ParallelDims, ProcessGroups, build_process_groups

    inputs = _inputs(data_dir)
    tp2 = build_process_groups(ParallelDims(tp=2, dp=1))
    dp2 = build_process_groups(ParallelDims(tp=1, dp=2))
    return {"serial": _evaluate(ProcessGroups.single(), *inputs), "tp2": _evaluate(tp2, *inputs),
            "dp2": _evaluate(dp2, *inputs), "argmax": _argmax_ties(tp2)}


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return run_ranks(_rank, 2, mirror(), timeout=240)


@pytest.mark.parametrize("layout", ["tp2", "dp2"])
def test_parallel_evaluation_equals_serial(ranks, layout):
    for rank in ranks:
        serial, got = rank["serial"], rank[layout]
        for task in ("ppl", "lambada"):
            for key, value in serial[task].items():
                assert got[task][key] == pytest.approx(value, rel=TOL, abs=TOL), (layout, task, key)
    assert ranks[0]["serial"]["ppl"]["num_targets"] == 1499
    assert ranks[0]["serial"]["lambada"]["num_examples"] == 24


def test_vocab_parallel_argmax_breaks_ties_like_torch(ranks):
    expected = torch.tensor([[1.0, 5.0, 5.0, 2.0], [0.0, 0.0, 0.0, 9.0], [3.0] * 4]).argmax(-1).tolist()
    assert expected == [1, 3, 0]
    assert all(rank["argmax"] == expected for rank in ranks)
