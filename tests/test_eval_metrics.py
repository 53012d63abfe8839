"""Issue 5: the detokenizer, T_o and T, and perplexity/accuracy equal hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from eval_helpers import PositionalModel, mirror
from repro.eval.detokenize import count_original_tokens, wikitext_detokenize
from repro.eval.lambada import Example, build_examples, evaluate_lambada, read_passages, score_examples
from repro.eval.wikitext import WikitextData, evaluate_perplexity, load_wikitext, sliding_windows
from repro.parallel.groups import ProcessGroups

HAND_MADE = [
    (" = = Career = = \n", " == Career ==\n"),
    (" = = = Early life = = = \n", " === Early life ===\n"),
    ("He scored 1 @,@ 000 runs", "He scored 1,000 runs"),
    ("a 1 @.@ 5 @-@ metre wall", "a 1.5-metre wall"),
    ("built ( in 1900 ) by", "built (in 1900) by"),
    ('he said " hello " . Then', 'he said "hello". Then'),
    ("John 's book", "John's book"),
    ("the players ' union", "the players' union"),
    ("it was 5 \u00b0 C", "it was 5\u00b0C"),
    ("Hello , world ; yes : no ! ok ? fine", "Hello, world; yes: no! ok? fine"),
]


@pytest.mark.parametrize("raw,expected", HAND_MADE)
def test_detokenizer_on_hand_made_lines(raw, expected):
    assert wikitext_detokenize(raw) == expected


def test_detokenizer_agrees_with_lm_eval_on_the_whole_test_files():
    from lm_eval.tasks.wikitext.preprocess_wikitext import wikitext_detokenizer

    for name in ("wikitext-2.test.tokens", "wiki.test.raw"):
        text = (mirror() / "wikitext" / name).read_text(encoding="utf-8")
        assert wikitext_detokenize(text) == wikitext_detokenizer({"page": text})


def test_original_and_bpe_token_counts():
    from repro.data.tokenizers import build_tokenizer

    tok = build_tokenizer("gpt2", mirror())
    tokens = load_wikitext(mirror() / "wikitext" / "wikitext-2.test.tokens", tok)
    assert tokens.num_original_tokens == 245_566  # the paper's T_o
    raw = load_wikitext(mirror() / "wikitext" / "wiki.test.raw", tok)
    # Documented in repro/eval/README: raw text (no <unk>) gives T = 272,045, 0.6% above the paper's
    # 270,329 on WikiText-103's own file; WikiText-2's file has more <unk> (3 BPE tokens each).
    assert len(raw.tokens) == 272_045 and abs(len(raw.tokens) / 270_329 - 1) < 0.01
    assert len(tokens.tokens) == 278_365
    assert count_original_tokens(" a b \n") == 2


def test_a_file_of_one_word_is_refused_not_divided_by_zero(tmp_path):
    """Every perplexity divides by T - 1 or T_o - 1: a one-word file used to end in ZeroDivisionError."""
    from repro.data.errors import DataError
    from repro.data.tokenizers import build_tokenizer

    (tmp_path / "one.txt").write_text("Hi\n")
    with pytest.raises(DataError, match="holds 1 word.*Fix:"):
        load_wikitext(tmp_path / "one.txt", build_tokenizer("gpt2", mirror()))
    (tmp_path / "lines.txt").write_text("hello\nworld\nagain\n")  # T_o counts single spaces: 1, not 3
    with pytest.raises(DataError, match=r"holds 1 word\(s\) \(T_o: tokens between single spaces.*Fix: give "
                                        "word-level text with spaces between words"):
        load_wikitext(tmp_path / "lines.txt", build_tokenizer("gpt2", mirror()))


def _telescoping_model(window: int) -> PositionalModel:
    """V=2; at window position p the probability of token 1 is (p + 1) / (p + 2)."""
    p = torch.arange(window, dtype=torch.float64)
    prob1 = (p + 1) / (p + 2)
    return PositionalModel(torch.stack([1 - prob1, prob1], dim=-1).log())


def test_sliding_windows_score_every_target_once():
    for num, window, stride in [(9, 4, 2), (9, 4, 4), (100, 16, 3), (5, 8, 2)]:
        scored = [w.start + 1 + p for w in sliding_windows(num, window, stride)
                  for p in range(w.first_scored, w.length)]
        assert scored == list(range(1, num))


@pytest.mark.parametrize("stride,expected", [(4, 2 * math.log(5)), (2, math.log(5) + 2 * math.log(5 / 3))])
def test_perplexity_equals_hand_computation(stride, expected):
    # 9 tokens, all 1, window 4: stride 4 scores positions 0-3 twice: 2 * -log(1/2 * 2/3 * 3/4 * 4/5)
    # = 2 ln 5; stride 2 scores window 0 fully (ln 5), then positions 2-3 twice: 2 ln(5/3).
    data = WikitextData([1] * 9, num_original_tokens=6)
    result = evaluate_perplexity(_telescoping_model(4), ProcessGroups.single(), data, window=4,
                                 stride=stride, batch_size=2)
    assert result.num_targets == 8 and result.num_tokens == 9
    assert result.sum_nll == pytest.approx(expected, rel=1e-12)  # float64 model: rounding only
    assert result.word_ppl == pytest.approx(math.exp(expected / 6), rel=1e-12)
    assert result.word_ppl_2020 == pytest.approx(math.exp(expected / 5), rel=1e-12)
    assert result.token_ppl == pytest.approx(math.exp(expected / 8), rel=1e-12)
    assert result.token_ratio == pytest.approx(8 / 5)


def test_a_diverged_models_overflowing_perplexities_are_inf_not_an_error():
    """Finite per-token losses of 1000 nats (a diverged model's huge logits): exp overflows a float.
    The metrics used to raise OverflowError after the whole evaluation, and nothing was saved."""
    wrong = PositionalModel(torch.tensor([[1000.0, 0.0]] * 8, dtype=torch.float64))  # token 1 at -1000
    ppl = evaluate_perplexity(wrong, ProcessGroups.single(), WikitextData([1] * 9, 6), window=4, stride=4)
    metrics = ppl.metrics()
    assert metrics["sum_nll"] == pytest.approx(8000.0) and metrics["avg_token_loss"] == pytest.approx(1000.0)
    assert metrics["token_ppl"] == metrics["word_ppl"] == metrics["word_ppl_2020"] == math.inf
    lam = evaluate_lambada(wrong, ProcessGroups.single(), [Example([0], [1])]).metrics()
    assert lam["target_ppl"] == math.inf and lam["sum_nll"] == pytest.approx(1000.0)


def _rotating_model() -> PositionalModel:
    """V=4; at position p token (p + 1) % 4 has probability 0.7, the others 0.1."""
    table = torch.full((8, 4), 0.1, dtype=torch.float64)
    table[torch.arange(8), (torch.arange(8) + 1) % 4] = 0.7
    return PositionalModel(table.log())


@pytest.mark.parametrize("batch_size", [1, 3, 4])
def test_lambada_accuracy_equals_hand_computation(batch_size):
    examples = [Example([0], [1, 2]),  # both pieces are the argmax: correct
                Example([0], [1, 0]),  # second piece is not: wrong under strict
                Example([3, 3, 3], [0]),  # position 2 predicts 3: wrong
                Example([2, 2, 2], [3])]  # right
    result = evaluate_lambada(_rotating_model(), ProcessGroups.single(), examples, batch_size)
    a, b = -math.log(0.7), -math.log(0.1)
    assert (result.num_examples, result.num_correct, result.num_target_tokens) == (4, 2, 6)
    assert result.accuracy == 0.5
    assert result.sum_nll == pytest.approx(4 * a + 2 * b, rel=1e-12)
    assert result.target_ppl == pytest.approx(math.exp((4 * a + 2 * b) / 6), rel=1e-12)
    non_strict = score_examples(_rotating_model(), None, [Example([0, 1], [0])], batch_size)
    assert not non_strict[0].correct  # the last piece alone: position 1 predicts 2, not 0


def test_strict_nonstrict_and_megatron_split_examples():
    from repro.data.tokenizers import build_tokenizer

    tok = build_tokenizer("gpt2", mirror())
    passages = read_passages(mirror() / "lambada" / "lambada_openai.test.jsonl")
    assert len(passages) == 5153
    strict = build_examples(passages[:50], tok, strict=True)
    loose = build_examples(passages[:50], tok, strict=False)
    for (c, w), s, n in zip(passages, strict, loose):
        assert s.target == tok.encode(" " + w) and len(n.target) == 1
        assert s.context + s.target == n.context + n.target  # GPT-2 BPE splits at the space
    megatron = build_examples(passages, tok, megatron_split=True)
    ours = build_examples(passages, tok)
    differ = [i for i, (m, o) in enumerate(zip(megatron, ours)) if m != o]
    assert len(differ) == 7  # the passages whose continuation holds a newline
    assert all("\n" in passages[i][1] for i in differ)
    # non-strict scores the passage as written, split or not (a re-split joined "of\n\nPower")
    assert build_examples([passages[i] for i in differ], tok, strict=False, megatron_split=True) == \
        [Example(ids[:-1], ids[-1:]) for ids in tok.encode_batch([f"{c} {w}" for c, w in (passages[i] for i in differ)])]
