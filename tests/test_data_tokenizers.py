"""Must-show 1: tokenizer vectors and the GPT-2 round trip on the WikiText test text."""

from __future__ import annotations

import pickle

import pytest
from data_fixtures import bert_tokenizer, data_dir, data_mirror, gpt2_tokenizer  # noqa: F401

from repro.data.errors import DataError
from repro.data.tokenizers import build_tokenizer


def test_gpt2_known_vector(gpt2_tokenizer):
    # the spelling of a special token is text, as OpenAI's encoder gives it (also in a worker process)
    assert gpt2_tokenizer.encode("hello <|endoftext|>") == [31373, 1279, 91, 437, 1659, 5239, 91, 29]
    assert pickle.loads(pickle.dumps(gpt2_tokenizer)).encode_batch(["<|endoftext|>"]) == [[27, 91, 437, 1659, 5239, 91, 29]]
    assert gpt2_tokenizer.decode([31373, 50256]) == "hello<|endoftext|>"
    assert gpt2_tokenizer.vocab_size == 50257
    assert gpt2_tokenizer.eod == 50256
    assert gpt2_tokenizer.encode(" the") == [262]


def test_bert_known_vector(bert_tokenizer):
    tok = bert_tokenizer
    assert (tok.cls, tok.sep, tok.mask, tok.pad) == (101, 102, 103, 0)
    assert tok.vocab_size == 30522
    assert tok.encode("the") == [1996]
    assert tok.encode("The") == [1996]  # uncased
    assert tok.encode("a [MASK] or [SEP]") == tok.encode("a [ mask ] or [ sep ]")  # text, not ids 103 / 102
    assert pickle.loads(pickle.dumps(tok)).encode("[CLS]") == tok.encode("[ cls ]") == [1031, 18856, 2015, 1033]
    pieces = tok.encode("unaffable")
    assert len(pieces) > 1 and tok.continuation_mask()[pieces[1:]].all()
    assert tok.decode(tok.encode("Hello, World!")) == "hello, world!"


def test_gpt2_round_trip_on_wikitext_test(gpt2_tokenizer, data_dir):
    text = (data_dir / "wikitext" / "wiki.test.raw").read_text(encoding="utf-8")
    ids = gpt2_tokenizer.encode(text)
    assert len(ids) > 250_000
    assert gpt2_tokenizer.decode(ids) == text


def test_tokenizer_pickles_for_workers(gpt2_tokenizer):
    clone = pickle.loads(pickle.dumps(gpt2_tokenizer))
    assert clone.encode("hello world") == gpt2_tokenizer.encode("hello world")
    assert clone.eod == 50256


def test_unknown_tokenizer_kind(data_dir):
    with pytest.raises(DataError, match="unknown tokenizer 'sentencepiece'.*Fix"):
        build_tokenizer("sentencepiece", data_dir)
