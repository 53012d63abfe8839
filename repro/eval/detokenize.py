"""The WikiText detokenizer of the paper's evaluation (Megatron-LM's `wikitext_detokenizer`).

WikiText's word-level files split hyphens and number separators (" @-@ ", " @,@ ", " @.@ "), put
spaces before punctuation, inside brackets and quotes, between "=" of section headers and before
"'s". Undoing that gives text that GPT-2's byte-level BPE was trained on. The same rules are in
lm-evaluation-harness's wikitext task; the tests check both agree on the whole test file.

    wikitext_detokenize(" = = Career = = \\n He scored 1 @,@ 000 runs ( a record ) .")
    -> " == Career ==\\nHe scored 1,000 runs (a record)."
"""

from __future__ import annotations

import re

# (old, new) literal replacements, applied in this order.
_NUMBER_SEPARATORS = ((" @-@ ", "-"), (" @,@ ", ","), (" @.@ ", "."))
_PUNCTUATION = ((" : ", ": "), (" ; ", "; "), (" . ", ". "), (" ! ", "! "), (" ? ", "? "), (" , ", ", "))
_BRACKETS = (  # strip the spaces just inside a pair of brackets or quotes
    (re.compile(r"\(\s*([^\)]*?)\s*\)"), r"(\1)"),
    (re.compile(r"\[\s*([^\]]*?)\s*\]"), r"[\1]"),
    (re.compile(r"{\s*([^}]*?)\s*}"), r"{\1}"),
    (re.compile(r"\"\s*([^\"]*?)\s*\""), r'"\1"'),
    (re.compile(r"'\s*([^']*?)\s*'"), r"'\1'"),
)
_MISC = (("= = = =", "===="), ("= = =", "==="), ("= =", "=="), (" \u00b0 ", "\u00b0"),
         (" \n", "\n"), ("\n ", "\n"), (" N ", " 1 "), (" 's", "'s"))


def _replace_all(text: str, pairs: tuple[tuple[str, str], ...]) -> str:
    for old, new in pairs:
        text = text.replace(old, new)
    return text


def wikitext_detokenize(text: str) -> str:
    """Undo WikiText's word-level tokenization (the paper's invertible detokenizer)."""
    text = text.replace("s '", "s'")  # plural possessive
    text = re.sub(r"/' [0-9]/", r"/'[0-9]/", text)  # kept from the reference code (matches nothing)
    text = _replace_all(text, _NUMBER_SEPARATORS)
    text = _replace_all(text, _PUNCTUATION)
    for pattern, repl in _BRACKETS:
        text = pattern.sub(repl, text)
    return _replace_all(text, _MISC)


def count_original_tokens(text: str) -> int:
    """The paper's T_o: `len(text.strip().split(" "))` on the word-level file (245,566 for the test set)."""
    return len(text.strip().split(" "))
