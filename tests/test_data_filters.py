"""The near-duplicate filter compares documents by their own words in any script: unrelated Russian,
Greek, Chinese or Japanese documents are not near-duplicates of each other, while English keeps
the words (and so the decisions) it always had."""

from __future__ import annotations

import json
import random
import re

import pytest
from data_fixtures import data_dir, data_mirror  # noqa: F401

from repro.data.filters import MinHasher, NearDuplicateFilter, words
from repro.data.preprocess import PrepareOptions, prepare

RNG = random.Random(0)
RU1 = "Москва является столицей России и крупнейшим городом страны. " + " ".join(
    RNG.choice(["река", "город", "мост", "улица", "парк", "дом", "школа", "завод", "поле", "лес"]) for _ in range(200))
RU2 = "Санкт-Петербург основан Петром Первым в начале восемнадцатого века. " + " ".join(
    RNG.choice(["небо", "море", "корабль", "ветер", "остров", "берег", "волна", "порт", "маяк"]) for _ in range(200))
EL = "Η Αθήνα είναι η πρωτεύουσα της Ελλάδας. " + " ".join(
    RNG.choice(["θάλασσα", "βουνό", "ήλιος", "σπίτι", "δρόμος", "πόλη"]) for _ in range(200))
ZH1 = "北京是中华人民共和国的首都，也是全国的政治和文化中心。长城位于北京北部，是世界著名的古代建筑。" * 3
ZH2 = "上海位于长江入海口，是中国最大的经济中心和国际港口城市。黄浦江穿过市区，两岸高楼林立。" * 3
JA = "東京は日本の首都であり、世界有数の大都市です。富士山は日本で一番高い山として知られています。" * 3
FOOTER = " Copyright 2019 Example Media. All rights reserved. Terms of use. Privacy policy."
RU3 = " ".join(RNG.choice(["новости", "выборы", "погода", "спорт", "матч", "команда", "прогноз"]) for _ in range(150))
RU4 = " ".join(RNG.choice(["рецепт", "мука", "сахар", "яйцо", "тесто", "печь", "пирог"]) for _ in range(150))
DOCS = {"ru1": RU1, "ru2": RU2, "el": EL, "zh1": ZH1, "zh2": ZH2, "ja": JA,  # two pages sharing an English footer:
        "ru3+footer": RU3 + FOOTER, "ru4+footer": RU4 + FOOTER}


def _decisions(texts: list[str]) -> list[bool]:
    hasher, filt = MinHasher(), NearDuplicateFilter(0.7)
    return [filt.is_duplicate(key, hasher.signature(words(text))) for key, text in enumerate(texts)]


def test_words_are_unicode_words_and_english_keeps_its_ascii_words(data_dir):  # noqa: F811
    assert words("Москва, 1,000 said; naïve CAFÉ x_y") == ["москва", "1", "000", "said", "naïve", "café", "x", "y"]
    assert words("東京は日本") == ["東", "京", "は", "日", "本"]  # no spaces: one character a word
    assert words("1 @,@ 000 , said") == words("1,000, said") == ["1", "000", "said"]
    for name in ("wikitext-2.valid.tokens", "wiki.test.raw"):  # the old [a-z0-9]+ words: same shingles
        lines = [x for x in (data_dir / "wikitext" / name).read_text(encoding="utf-8").splitlines() if x.isascii()]
        assert len([x for x in lines if x.strip()]) > 1000
        assert [words(x) for x in lines] == [re.findall(r"[a-z0-9]+", x.lower()) for x in lines]


def test_unrelated_non_latin_documents_are_not_near_duplicates():
    """Before: no ASCII words, one empty signature for all, all but the first dropped (Jaccard 1.0);
    a Russian page compared only by its English footer."""
    assert not any(_decisions(list(DOCS.values()))), dict(zip(DOCS, _decisions(list(DOCS.values()))))


@pytest.mark.parametrize("name", ["ru1", "el", "zh1", "ja"])
def test_a_near_copy_in_any_script_is_still_a_near_duplicate(name):
    text = DOCS[name]
    copy = text.replace(text[10:16], text[10:16][::-1], 1)  # a few characters changed
    assert _decisions([text, DOCS["ru2"], copy]) == [False, False, True]


def test_a_text_with_fewer_words_than_a_shingle_never_matches_another():
    """Under 5 words there is no shingle: such texts (symbols, numbers) are never near-duplicates,
    not of each other, nor of themselves, and nothing is compared with them."""
    short = ["★ ☆ ★ ☆ ★", "— · — · —", "1 2", "ok", "", "x y z w"]
    assert _decisions(short + short) == [False] * 12
    assert _decisions(["one two three four five six", "one two three four five six"]) == [False, True]


def test_prepare_keeps_unrelated_russian_greek_and_english_documents(data_dir, tmp_path):  # noqa: F811
    """The reviewer's corpus: 2 unrelated Russian, 1 Greek, 1 English document (each over 128 tokens)
    were kept 2, near-duplicates 2; all four are kept, and a repeat of one is dropped."""
    english = " ".join(RNG.choice(["alpha", "beta", "gamma", "delta", "river", "stone", "cloud"]) for _ in range(300))
    texts = [RU1, RU2, EL, english, RU2]
    (tmp_path / "c.jsonl").write_text("".join(json.dumps({"text": t}, ensure_ascii=False) + "\n" for t in texts),
                                      encoding="utf-8")
    report = prepare(PrepareOptions(input=tmp_path / "c.jsonl", output_prefix=str(tmp_path / "out"),
                                    data_dir=data_dir, workers=1, progress=False, split="1,0,0"))
    assert (report.documents, report.too_short, report.kept, report.near_duplicates) == (5, 0, 4, 1)


def test_eval_overlap_counts_distinct_shared_ngrams_not_repeats(data_dir):  # noqa: F811
    """A list page that repeats one stock phrase of the eval sets ("certified gold by the Recording
    Industry Association of America") shares its few 8-grams three times over: still under the
    threshold of 10 distinct ones, so it is kept; the same n-grams counted with repeats dropped it."""
    import numpy as np

    from repro.data.filters import FilterOptions, count_overlap, eval_ngram_set, ngram_hashes

    options = FilterOptions()
    eval_set = eval_ngram_set(data_dir, options.eval_files, options.ngram)
    line = ("Their album {} (released {}) sold well in the United States and Canada and toured widely, and was "
            "certified gold by the Recording Industry Association of America.")
    page = "\n".join(line.format(album, 1990 + i) for i, album in enumerate(["Red Sky", "Blue Night", "Open Road"]))
    hashes = ngram_hashes(words(page), options.ngram)
    repeats = int(np.isin(hashes, eval_set).sum())
    assert repeats >= options.min_matches > count_overlap(hashes, eval_set) > 0
