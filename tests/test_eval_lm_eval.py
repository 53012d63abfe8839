"""Issue 5: the lm-eval model gives `repro eval lambada`'s accuracy on local task YAMLs, offline."""

from __future__ import annotations

import math
import os
from types import SimpleNamespace

import pytest
import torch

from eval_helpers import TrigramOracle, mirror

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
N = 24  # passages


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from repro.data.tokenizers import build_tokenizer
    from repro.eval.lambada import build_examples, read_passages
    from repro.eval.local_tasks import write_local_tasks

    tok = build_tokenizer("gpt2", mirror())
    examples = build_examples(read_passages(mirror() / "lambada" / "lambada_openai.test.jsonl")[:N], tok)
    table = {}
    for i, e in enumerate(examples):
        seq = e.context + e.target
        hidden = range(len(e.context) - 1, len(seq) - 1) if i % 3 == 0 else ()  # every third: unknown
        table.update({tuple(seq[p - 2:p + 1]): seq[p + 1] for p in range(2, len(seq) - 1) if p not in hidden})
    oracle = TrigramOracle(table, tok.vocab_size)
    oracle.cfg = SimpleNamespace(seq_length=1024)
    tasks = write_local_tasks(mirror(), tmp_path_factory.mktemp("tasks"))
    return tok, examples, oracle, tasks


def _simple_evaluate(lm, tasks_dir, task: str, limit: int) -> dict:
    import lm_eval
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_path=str(tasks_dir), include_defaults=False)
    return lm_eval.simple_evaluate(model=lm, tasks=[task], task_manager=manager, limit=limit, log_samples=True)


def test_lm_eval_lambada_accuracy_equals_repro_eval(setup):
    from repro.eval.lambada import evaluate_lambada, score_examples
    from repro.eval.lm_eval_adapter import MegatronReproLM
    from repro.parallel.groups import ProcessGroups

    tok, examples, oracle, tasks = setup
    ours = evaluate_lambada(oracle, ProcessGroups.single(), examples, batch_size=4)
    assert 0.3 < ours.accuracy < 0.9  # the oracle knows 2 of every 3 answers: a non-trivial number
    lm = MegatronReproLM(model=oracle, tokenizer=tok, batch_size=4)
    out = _simple_evaluate(lm, tasks, "lambada_openai_local", N)
    assert out["results"]["lambada_openai_local"]["acc,none"] == ours.accuracy
    samples = sorted(out["samples"]["lambada_openai_local"], key=lambda s: s["doc_id"])
    per_example = score_examples(oracle, None, examples, batch_size=4)
    for sample, score in zip(samples, per_example):  # the same request, token for token
        ll, greedy = sample["resps"][0][0]
        assert ll == pytest.approx(-score.nll, rel=1e-6) and bool(greedy) == score.correct


def test_rolling_loglikelihood_and_generation_of_a_tiny_gpt(setup):
    from repro.eval.lm_eval_adapter import MegatronReproLM
    from repro.models.config import ModelConfig
    from repro.models.gpt import GPT

    tok, examples, oracle, tasks = setup
    cfg = ModelConfig(num_layers=1, hidden_size=32, num_attention_heads=2, seq_length=16,
                      hidden_dropout=0.0, attention_dropout=0.0)
    gpt = GPT(cfg, seed=3).double().eval()
    text = "The quick brown fox jumps over the lazy dog near the river bank today."
    ids = [tok.eod] + tok.encode(text)
    assert len(ids) <= 16
    expected = -torch.nn.functional.cross_entropy(gpt(torch.tensor([ids[:-1]]))[0], torch.tensor(ids[1:]),
                                                  reduction="sum").item()
    lm = MegatronReproLM(model=gpt, tokenizer=tok, batch_size=2)
    req = SimpleNamespace(args=(text,))
    assert lm.loglikelihood_rolling([req])[0] == pytest.approx(expected, rel=1e-10)
    long_text = " ".join([text] * 4)  # longer than one window: disjoint windows cover every token
    assert math.isfinite(lm.loglikelihood_rolling([SimpleNamespace(args=(long_text,))])[0])
    # Greedy generation with the oracle continues a known passage with its own next 5 tokens.
    seq = examples[1].context
    k = next(k for k in range(10, len(seq) - 6) if "\n" not in tok.decode(seq[:k + 5])
             and all(oracle.next_of.get(tuple(seq[p - 2:p + 1])) == seq[p + 1] for p in range(k - 1, k + 4)))
    gen = MegatronReproLM(model=oracle, tokenizer=tok)
    req = SimpleNamespace(args=(tok.decode(seq[:k]), {"until": ["\n\n"], "max_gen_toks": 5}))
    assert gen.generate_until([req])[0] == tok.decode(seq[k:k + 5])
    req = SimpleNamespace(args=(tok.decode(seq[:k]), {"until": [tok.decode(seq[k + 2:k + 3])], "max_gen_toks": 5}))
    assert gen.generate_until([req])[0] == tok.decode(seq[k:k + 2])  # stops before the stop string


def test_lm_eval_wikitext_task_runs_offline(setup):
    from repro.eval.lm_eval_adapter import MegatronReproLM
    from repro.models.config import ModelConfig
    from repro.models.gpt import GPT

    tok, _, _, tasks = setup
    cfg = ModelConfig(num_layers=1, hidden_size=32, num_attention_heads=2, seq_length=256,
                      hidden_dropout=0.0, attention_dropout=0.0)
    lm = MegatronReproLM(model=GPT(cfg, seed=3).eval(), tokenizer=tok, batch_size=8)
    out = _simple_evaluate(lm, tasks, "wikitext_local", 1)["results"]["wikitext_local"]
    # An untrained 50k-vocab model: about ln(50257) = 10.8 nats per token, ~1.3 tokens per word.
    assert 1e4 < out["word_perplexity,none"] < 1e8
