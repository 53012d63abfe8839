"""Plain-text corpora in GPT-2's convention, documents separated by "<|endoftext|>" (TinyStories' .txt):
`repro data prepare` ends a document at each marker (layout `endoftext`, picked by `auto`) instead of
training on the marker spelled as eight BPE tokens; and the data mirror's GPT-2 test vector."""

from __future__ import annotations

import numpy as np
from data_fixtures import bert_tokenizer, data_dir, data_mirror, gpt2_tokenizer  # noqa: F401

from repro.cli import main
from repro.data.documents import read_documents
from repro.data.indexed_dataset import IndexedDataset

STORIES = ("Once upon a time, a cat sat on a mat.\n\nIt was happy.\n<|endoftext|>\n"
           "A dog ran to the park.\n<|endoftext|>\n\n<|endoftext|>\n"
           "Tom had a red ball.<|endoftext|>Sue had a blue one.\n")
MARKER_AS_TEXT = [27, 91, 437, 1659, 5239, 91, 29]  # "<|endoftext|>" spelled out in GPT-2 BPE


def test_the_markers_end_documents_and_are_not_text(tmp_path):
    path = tmp_path / "stories.txt"
    path.write_text(STORIES, encoding="utf-8")
    expected = ["Once upon a time, a cat sat on a mat.\n\nIt was happy.\n", "A dog ran to the park.\n",
                "Tom had a red ball.", "Sue had a blue one.\n"]
    assert list(read_documents(path)) == expected  # auto: the marker is in the first lines
    assert list(read_documents(path, layout="endoftext")) == expected


def test_other_layouts_and_json_lines_keep_a_spelled_out_marker_as_text(tmp_path):
    """A page that mentions the marker in a sentence is not taken for a corpus of them by `auto`."""
    page = tmp_path / "page.txt"
    page.write_text("GPT-2 ends a document with <|endoftext|> in its data.\n\nA second paragraph.\n", encoding="utf-8")
    assert list(read_documents(page)) == ["GPT-2 ends a document with <|endoftext|> in its data.\n",
                                          "A second paragraph.\n"]
    assert list(read_documents(page, layout="paragraph")) == list(read_documents(page))
    assert list(read_documents(page, layout="file")) == [page.read_text()]
    record = tmp_path / "page.jsonl"
    record.write_text('{"text": "a <|endoftext|> b"}\n', encoding="utf-8")
    assert list(read_documents(record)) == ["a <|endoftext|> b"]


def test_prepare_writes_one_eod_per_story_and_no_spelled_out_marker(data_dir, gpt2_tokenizer, tmp_path):
    corpus = tmp_path / "TinyStories-valid.txt"
    corpus.write_text("<|endoftext|>\n".join([STORIES] * 3), encoding="utf-8")
    code = main(["data", "prepare", "--input", str(corpus), "--output-prefix", str(tmp_path / "ts"),
                 "--data-dir", str(data_dir), "--workers", "1", "--no-progress", "--split", "1,0,0",
                 "--min-tokens", "0", "--no-dedup", "--no-eval-filter"])
    assert code == 0
    tokens = np.concatenate([np.asarray(d) for d in IndexedDataset(str(tmp_path / "ts_train"))])
    assert int((tokens == gpt2_tokenizer.eod).sum()) == 12  # 4 stories x 3, each ended by one eod
    text = tokens.tolist()
    assert not any(text[i:i + len(MARKER_AS_TEXT)] == MARKER_AS_TEXT for i in range(len(text)))
    assert "<|endoftext|>" not in gpt2_tokenizer.decode([t for t in text if t != gpt2_tokenizer.eod])  # mid-line too
    assert gpt2_tokenizer.decode(tokens[:tokens.tolist().index(gpt2_tokenizer.eod)]) == \
        "Once upon a time, a cat sat on a mat.\n\nIt was happy.\n"


def test_the_data_mirrors_gpt2_vector_with_special_spellings(gpt2_tokenizer, bert_tokenizer):
    """/work/shared/data/README.md's vector is Hugging Face's default; plain `encode` keeps spellings as
    text (OpenAI's encoder, Megatron's), and asking once does not change the next call."""
    assert gpt2_tokenizer.encode("hello <|endoftext|>", special_spellings=True) == [31373, 220, 50256]
    assert gpt2_tokenizer.encode("hello <|endoftext|>") == [31373, 1279, 91, 437, 1659, 5239, 91, 29]
    assert bert_tokenizer.encode("[SEP]", special_spellings=True) == [bert_tokenizer.sep]
    assert bert_tokenizer.sep not in bert_tokenizer.encode("[SEP]")
