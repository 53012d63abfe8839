"""GPT-2 byte-level BPE and BERT uncased WordPiece through Hugging Face `tokenizers`.

Both behind one small interface (`TextTokenizer`): encode / encode_batch / decode, vocab_size and
the special ids the datasets need (eod, cls, sep, mask, pad; None where a vocabulary has none).
A special token's spelling in the text ("<|endoftext|>", "[SEP]", "[MASK]" in a web page about
language models) is encoded as ordinary text, as OpenAI's GPT-2 encoder and Google's BERT tokenizer
(the ones Megatron-LM uses) do: only the datasets place special ids, so a document never gains a
false end-of-document or [SEP] from its own words. (A plain-text corpus that separates its documents
with "<|endoftext|>" is split at the markers by `repro data prepare`'s layout `endoftext`.)

    tok = build_tokenizer("gpt2", "data")      # data/vocab/gpt2-vocab.json + gpt2-merges.txt
    tok.encode("hello <|endoftext|>")          # [31373, 1279, 91, 437, 1659, 5239, 91, 29]: text
    tok.encode("hello <|endoftext|>", special_spellings=True)   # [31373, 220, 50256]: Hugging Face's
    tok.eod                                    # 50256: the id prepare appends to each document
    bert = build_tokenizer("bert", "data")     # data/vocab/bert-large-uncased-vocab.txt
    bert.encode("the")                         # [1996]; no [CLS]/[SEP] added: datasets add them
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers

from repro.data.errors import DataError
from repro.data.fetch import data_path

GPT2_VOCAB = "vocab/gpt2-vocab.json"
GPT2_MERGES = "vocab/gpt2-merges.txt"
BERT_VOCAB = "vocab/bert-large-uncased-vocab.txt"
TOKENIZER_KINDS = ("gpt2", "bert")


@dataclass(frozen=True)
class SpecialIds:
    """Ids of the special tokens; None where the vocabulary has no such token."""

    eod: int | None = None
    cls: int | None = None
    sep: int | None = None
    mask: int | None = None
    pad: int | None = None
    unk: int | None = None


class TextTokenizer:
    """A Hugging Face tokenizer plus the special ids; picklable, so it can go to worker processes."""

    def __init__(self, kind: str, backend: Tokenizer, special: SpecialIds) -> None:
        self.kind = kind
        self.backend = backend
        self.special = special
        backend.encode_special_tokens = True  # special-token spellings in text are text

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.backend.encode_special_tokens = True  # not part of the backend's pickled state

    @property
    def vocab_size(self) -> int:
        """Number of ids, special tokens included (GPT-2: 50257, BERT: 30522)."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    eod = property(lambda self: self.special.eod, doc="End-of-document id (GPT-2: 50256).")
    cls = property(lambda self: self.special.cls, doc="[CLS] id (BERT: 101).")
    sep = property(lambda self: self.special.sep, doc="[SEP] id (BERT: 102).")
    mask = property(lambda self: self.special.mask, doc="[MASK] id (BERT: 103).")
    pad = property(lambda self: self.special.pad, doc="Padding id (BERT: 0; GPT-2: the eod id).")

    def encode(self, text: str, special_spellings: bool = False) -> list[int]:
        """Token ids of one text, without any added [CLS]/[SEP]/eod. With `special_spellings`, a special
        token's spelling is that token, as Hugging Face's tokenizers give it by default (the data
        mirror's test vector: "hello <|endoftext|>" -> [31373, 220, 50256])."""
        self.backend.encode_special_tokens = not special_spellings
        try:
            return self.backend.encode(text, add_special_tokens=False).ids
        finally:
            self.backend.encode_special_tokens = True

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Token ids of many texts (the library parallelises over them)."""
        encodings = self.backend.encode_batch(texts, add_special_tokens=False)
        return [e.ids for e in encodings]

    def decode(self, ids: list[int] | np.ndarray) -> str:
        """Text of token ids, special tokens kept."""
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=False)

    def token_to_id(self, token: str) -> int | None:
        """Id of one vocabulary entry, or None."""
        return self.backend.token_to_id(token)

    def continuation_mask(self) -> np.ndarray:
        """Bool per id: True where the token continues a word (WordPiece '##')."""
        if self.kind != "bert":
            raise ValueError(f"continuation_mask needs a WordPiece tokenizer, not {self.kind!r}")
        mask = np.zeros(self.vocab_size, dtype=bool)
        for token, idx in self.backend.get_vocab(with_added_tokens=True).items():
            mask[idx] = token.startswith("##")
        return mask


def gpt2_tokenizer(vocab_json: Path, merges_txt: Path) -> TextTokenizer:
    """GPT-2 byte-level BPE from OpenAI's encoder.json (= vocab.json) and vocab.bpe (= merges.txt)."""
    backend = Tokenizer(models.BPE.from_file(str(vocab_json), str(merges_txt)))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken("<|endoftext|>", special=True)])
    eod = backend.token_to_id("<|endoftext|>")
    return TextTokenizer("gpt2", backend, SpecialIds(eod=eod, pad=eod))


def bert_tokenizer(vocab_txt: Path) -> TextTokenizer:
    """BERT uncased WordPiece (lower-cased, accents stripped) from vocab.txt; a DataError naming it for a
    file that cannot be read, is not UTF-8, or lacks [UNK] (every word outside the vocabulary is [UNK])."""
    fix = ("Fix: give a BERT WordPiece vocab.txt (UTF-8, one token a line, [UNK] among them), such as "
           f"data/{BERT_VOCAB} from `repro data fetch`")
    try:
        backend = Tokenizer(models.WordPiece.from_file(str(vocab_txt), unk_token="[UNK]"))
    except Exception as err:  # the library raises a bare Exception ("Error while reading WordPiece file: ...")
        raise DataError(f"{vocab_txt} is not a readable WordPiece vocabulary ({err}). {fix}") from None
    if backend.token_to_id("[UNK]") is None:
        raise DataError(f"{vocab_txt} has no [UNK] token ({backend.get_vocab_size()} tokens). {fix}")
    backend.normalizer = normalizers.BertNormalizer(lowercase=True, strip_accents=None)
    backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    backend.decoder = decoders.WordPiece(prefix="##")
    names = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    backend.add_special_tokens([AddedToken(n, special=True) for n in names])
    pad, unk, cls, sep, mask = (backend.token_to_id(n) for n in names)
    return TextTokenizer("bert", backend, SpecialIds(cls=cls, sep=sep, mask=mask, pad=pad, unk=unk))


def build_tokenizer(kind: str, data_dir: Path | str, verify: bool = True) -> TextTokenizer:
    """The `kind` tokenizer ('gpt2' or 'bert') from the vocab files in data_dir, checked by sha256."""
    if kind == "gpt2":
        return gpt2_tokenizer(data_path(data_dir, GPT2_VOCAB, verify),
                              data_path(data_dir, GPT2_MERGES, verify))
    if kind == "bert":
        return bert_tokenizer(data_path(data_dir, BERT_VOCAB, verify))
    raise DataError(f"unknown tokenizer {kind!r}. Fix: use one of {', '.join(TOKENIZER_KINDS)}")
