"""Functions the wikitext_local task YAML names: the paper's detokenizer and lm-eval's counts."""

from __future__ import annotations

import re

from repro.eval.detokenize import wikitext_detokenize


def detokenize_page(doc: dict) -> str:
    """The detokenized page text (same rules as lm-eval's built-in wikitext task)."""
    return wikitext_detokenize(doc["page"])


def process_results(doc: dict, results: list) -> dict:
    """lm-eval's wikitext metrics: words and bytes counted on the page before detokenizing."""
    (loglikelihood,) = results
    words = len(re.split(r"\s+", doc["page"]))
    size = len(doc["page"].encode("utf-8"))
    return {"word_perplexity": (loglikelihood, words), "byte_perplexity": (loglikelihood, size),
            "bits_per_byte": (loglikelihood, size)}
