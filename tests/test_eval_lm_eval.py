"""Issue 5: the lm-eval model gives `repro eval lambada`'s accuracy on local task YAMLs, offline, also
through the `repro-lm-eval` command on a checkpoint; lm-eval's wikitext word perplexity, exactly."""

from __future__ import annotations

import json
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


def test_context_and_continuation_are_split_as_lm_evals_hugging_face_model(setup):
    """The continuation's tokens are those of the whole text after the context's: where no space
    separates them GPT-2's BPE merges across the boundary ("foo" + "bar"), and published HF-backend
    numbers come from that split."""
    from repro.eval.lm_eval_adapter import MegatronReproLM

    tok, _, oracle, _ = setup
    lm = MegatronReproLM(model=oracle, tokenizer=tok)

    def hf(context, continuation):  # lm_eval.models.huggingface.HFLM._encode_pair, for a causal model
        spaces = len(context) - len(context.rstrip())
        if spaces:
            context, continuation = context[:-spaces], context[-spaces:] + continuation
        whole, ctx = tok.encode(context + continuation), tok.encode(context)
        return ctx, whole[len(ctx):]

    for context, continuation in [("foo", "bar"), ("The answer is ", "forty-two"), ("x=", "12345"), ("Hi", " there")]:
        example = lm._encode_pair(context, continuation)
        assert (example.context, example.target) == hf(context, continuation)
    assert lm._encode_pair("foo", "bar").target != tok.encode("bar")  # the case the split is for
    assert lm._encode_pair("", "Hello").context == [tok.eod]


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


def _memorizing_checkpoint(run_dir, examples, steps: int = 20):
    """A trainer-format checkpoint (run_dir/checkpoints/iter_0000020: meta.json + model_tp00.pt, as
    tests/test_eval_cli.py writes one) of a tiny GPT that learned the last word of every passage
    but each third one (a few Adam steps on those target tokens only): accuracy strictly between
    0 and 1, so an untrained or wrongly loaded model cannot match by both scoring zero."""
    from repro.models.config import ModelConfig
    from repro.models.gpt import GPT
    from repro.parallel.groups import ProcessGroups
    from repro.train import checkpoint as ck

    cfg = ModelConfig(num_layers=1, hidden_size=32, num_attention_heads=2, seq_length=128,
                      hidden_dropout=0.0, attention_dropout=0.0)
    gpt = GPT(cfg, seed=1)
    learned = [e for i, e in enumerate(examples) if i % 3]
    length = max(len(e.context) + len(e.target) for e in learned)
    ids = torch.zeros(len(learned), length, dtype=torch.long)
    targets = torch.full_like(ids, -100)  # ignored by cross_entropy
    for row, e in enumerate(learned):
        ids[row, :len(e.context) + len(e.target)] = torch.tensor(e.context + e.target)
        targets[row, len(e.context) - 1:len(e.context) + len(e.target) - 1] = torch.tensor(e.target)
    opt = torch.optim.Adam(gpt.parameters(), lr=1e-2)
    for _ in range(steps):
        loss = torch.nn.functional.cross_entropy(gpt(ids).flatten(0, 1), targets.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
    root, pg = run_dir / "checkpoints", ProcessGroups.single()
    tmp = ck.begin_save(root, steps, pg)
    torch.save(gpt.state_dict(), tmp / "model_tp00.pt")
    meta = {"format": ck.FORMAT_VERSION, "family": "gpt", "iteration": steps, "tp": 1, "dp": 1,
            "world_size": 1, "model": cfg.__dict__}
    (tmp / "meta.json").write_text(json.dumps(meta))
    ck.finish_save(root, steps, pg)
    return gpt.eval()


def test_repro_lm_eval_command_on_a_checkpoint_equals_repro_eval(setup, tmp_path):
    """The console path users run: `repro-lm-eval --model megatron-repro --model_args
    checkpoint=RUN_DIR,data_dir=DATA` (the checkpoint loaded by _load_checkpoint, the tokenizer
    built from data_dir) on the local LAMBADA task: lm-eval's acc is `repro eval lambada`'s
    evaluate_lambada on the same checkpoint and passages, and its perplexity (exp of the mean
    per-passage NLL) is repro's per-passage NLLs' (float32, same batches: rel 1e-6)."""
    import subprocess
    import sys
    from pathlib import Path

    from repro.eval.lambada import evaluate_lambada, score_examples
    from repro.parallel.groups import ProcessGroups
    from repro.train.reshard import load_model_for_eval

    tok, examples, _, tasks = setup
    n = 8
    trained = _memorizing_checkpoint(tmp_path / "run", examples[:n])
    script = Path(sys.executable).with_name("repro-lm-eval")
    cmd = [str(script)] if script.exists() else [sys.executable, "-m", "repro.eval.lm_eval_adapter"]
    out = subprocess.run(cmd + ["--model", "megatron-repro", "--model_args",
                                f"checkpoint={tmp_path / 'run'},data_dir={mirror()}",
                                "--batch_size", "4", "--include_path", str(tasks),  # lm-eval's default device: cuda
                                "--tasks", "lambada_openai_local", "--limit", str(n),
                                "--output_path", str(tmp_path / "out")],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    (results_file,) = (tmp_path / "out").rglob("results_*.json")
    results = json.loads(results_file.read_text())
    assert results["n-samples"]["lambada_openai_local"]["effective"] == n
    got = results["results"]["lambada_openai_local"]

    model = load_model_for_eval(tmp_path / "run", ProcessGroups.single())
    ours = evaluate_lambada(model, ProcessGroups.single(), examples[:n], batch_size=4)
    assert ours.accuracy == evaluate_lambada(trained, ProcessGroups.single(), examples[:n], batch_size=4).accuracy
    assert 0 < ours.accuracy < 1, ours  # learned passages right, the others not: a non-trivial number
    assert got["acc,none"] == ours.accuracy
    nll = [s.nll for s in score_examples(model, None, examples[:n], batch_size=4)]
    assert got["perplexity,none"] == pytest.approx(math.exp(sum(nll) / n), rel=1e-6)


def _lm_eval_rolling(gpt, tokens: list[int], eod: int, seq: int) -> tuple[float, list]:
    """lm-eval's rolling loglikelihood as its Hugging Face model computes it: its own windows
    (get_rolling_token_windows, context_len 1, then make_disjoint_window), each scored on
    (context + continuation)[:-1] by plain cross-entropy of its last len(continuation) logits."""
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

    windows = [make_disjoint_window(w) for w in get_rolling_token_windows(tokens, eod, seq, 1)]
    total = 0.0
    with torch.no_grad():
        for ctx, cont in windows:
            logits = gpt(torch.tensor([(ctx + cont)[-(seq + 1):][:-1]]))[0, -len(cont):]
            total -= torch.nn.functional.cross_entropy(logits, torch.tensor(cont), reduction="sum").item()
    return total, windows


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
    long_text = " ".join([text] * 4)  # 4 windows of 16: the last one takes a full window of context
    tokens = tok.encode(long_text)
    reference, windows = _lm_eval_rolling(gpt, tokens, tok.eod, 16)
    assert len(tokens) % 16 and len(windows[-1][0] + windows[-1][1]) == 17  # not a remainder's context
    got = lm.loglikelihood_rolling([SimpleNamespace(args=(s,)) for s in (long_text, "", text)])
    assert got[0] == pytest.approx(reference, rel=1e-10)
    assert got[1:] == [0.0, pytest.approx(expected, rel=1e-10)]  # lm-eval has no window for ""
    # Greedy generation with the oracle continues a known passage with its own next 5 tokens.
    seq = examples[1].context
    k = next(k for k in range(10, len(seq) - 6) if "\n" not in tok.decode(seq[:k + 5])
             and all(oracle.next_of.get(tuple(seq[p - 2:p + 1])) == seq[p + 1] for p in range(k - 1, k + 4)))
    gen = MegatronReproLM(model=oracle, tokenizer=tok)
    req = SimpleNamespace(args=(tok.decode(seq[:k]), {"until": ["\n\n"], "max_gen_toks": 5}))
    assert gen.generate_until([req])[0] == tok.decode(seq[k:k + 5])
    req = SimpleNamespace(args=(tok.decode(seq[:k]), {"until": [tok.decode(seq[k + 2:k + 3])], "max_gen_toks": 5}))
    assert gen.generate_until([req])[0] == tok.decode(seq[k:k + 2])  # stops before the stop string


def test_wikitext_pages_are_lm_evals_pages():
    """lm-eval's wikitext documents (EleutherAI/wikitext_document_level) are wiki.test.raw's lines,
    split at "\n" and joined again with "\n", a page at each article title: so the pages, joined with
    "\n", give back the file after its leading blank line, and a page ends without the newline before
    the next title. Pages cut with their line ends kept used to end in one newline more: 61 of 62
    pages one byte longer, and a different last BPE token ("\n\n" for "\n") or one more."""
    from repro.eval.local_tasks import wikitext_pages

    raw = (mirror() / "wikitext" / "wiki.test.raw").read_text(encoding="utf-8")
    pages = wikitext_pages(raw)
    assert len(pages) == 62 and " \n" + "\n".join(pages) == raw
    assert pages[0].startswith(" = Robert Boulter = \n") and pages[0].endswith(" = = = Theatre = = = \n \n \n ")
    assert pages[1].startswith(" = Du Fu = \n") and len(pages[0].encode("utf-8")) == 5667


def test_lm_eval_wikitext_word_perplexity_is_per_word_of_the_page(setup):
    """lm-eval's wikitext word_perplexity is exp(-sum log p / words of the original page), with
    sum log p the rolling loglikelihood of the detokenized page after [eot] in lm-eval's own windows
    of the model's seq_length (the last one with a full window of context). Expected value computed
    here from lm-eval's own built-in wikitext functions (detokenizer, word/byte counts, rolling
    windows) and plain cross-entropy of a float64 model, so only summation order differs: rel 1e-9.
    Token perplexity (1,218 targets for 1,093 words on this page) would be exp(sum NLL / 1218):
    5.0e4 against the word perplexity 1.7e5 of this untrained model."""
    from lm_eval.tasks.wikitext.preprocess_wikitext import process_results, wikitext_detokenizer

    from repro.eval.lm_eval_adapter import MegatronReproLM
    from repro.models.config import ModelConfig
    from repro.models.gpt import GPT

    tok, _, _, tasks = setup
    seq = 256
    cfg = ModelConfig(num_layers=1, hidden_size=32, num_attention_heads=2, seq_length=seq,
                      hidden_dropout=0.0, attention_dropout=0.0)
    gpt = GPT(cfg, seed=3).double().eval()
    lm = MegatronReproLM(model=gpt, tokenizer=tok, batch_size=2)
    out = _simple_evaluate(lm, tasks, "wikitext_local", 1)
    (sample,) = out["samples"]["wikitext_local"]
    doc = json.loads((tasks / "wikitext_document_level.test.jsonl").read_text().splitlines()[0])
    assert sample["doc"] == doc and doc["page"].startswith(" = Robert Boulter = ")

    ids = [tok.eod] + tok.encode(wikitext_detokenizer(doc))
    sum_nll = -_lm_eval_rolling(gpt, ids[1:], tok.eod, seq)[0]
    counts = process_results(doc, [0.0])
    words, size = counts["word_perplexity"][1], counts["byte_perplexity"][1]
    assert (words, len(ids) - 1) == (1093, 1218)  # words of the raw page vs BPE targets
    results = out["results"]["wikitext_local"]
    assert results["word_perplexity,none"] == pytest.approx(math.exp(sum_nll / words), rel=1e-9)
    assert results["byte_perplexity,none"] == pytest.approx(math.exp(sum_nll / size), rel=1e-9)
    assert results["bits_per_byte,none"] == pytest.approx(sum_nll / size / math.log(2), rel=1e-9)
    token_ppl = math.exp(sum_nll / (len(ids) - 1))
    assert results["word_perplexity,none"] > 2 * token_ppl  # what the old 1e4..1e8 bounds could not tell
