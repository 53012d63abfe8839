"""Offline lm-eval tasks: copies of repro/eval/tasks with absolute data paths, and their data.

    tasks_dir = write_local_tasks(Path("data"), Path("/tmp/tasks"))
    # lm_eval ... --include_path /tmp/tasks --tasks lambada_openai_local,wikitext_local
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

from repro.data.fetch import data_path

TASKS_DIR = Path(__file__).resolve().parent / "tasks"
LAMBADA = "lambada/lambada_openai.test.jsonl"
WIKITEXT_RAW = "wikitext/wiki.test.raw"
WIKITEXT_PAGES = "wikitext/wikitext_document_level.test.jsonl"
_ARTICLE_TITLE = re.compile(r"^ = [^=].* = $")


def wikitext_pages(raw_text: str) -> list[str]:
    """wiki.test.raw split into articles at top-level ' = Title = ' lines (one page each)."""
    pages: list[list[str]] = []
    for line in raw_text.splitlines(keepends=True):
        if _ARTICLE_TITLE.match(line.rstrip("\n")) or not pages:
            pages.append([])
        pages[-1].append(line)
    return ["".join(p) for p in pages if "".join(p).strip()]


def write_local_tasks(data_dir: Path, out_dir: Path) -> Path:
    """Write the task YAMLs (data paths made absolute) and the wikitext page jsonl into out_dir."""
    out_dir.mkdir(parents=True, exist_ok=True)
    pages = wikitext_pages(data_path(data_dir, WIKITEXT_RAW).read_text(encoding="utf-8"))
    with open(out_dir / "wikitext_document_level.test.jsonl", "w", encoding="utf-8") as handle:
        handle.writelines(json.dumps({"page": p}, ensure_ascii=False) + "\n" for p in pages)
    targets = {f"data/{LAMBADA}": data_path(data_dir, LAMBADA).resolve(),
               f"data/{WIKITEXT_PAGES}": (out_dir / "wikitext_document_level.test.jsonl").resolve()}
    for source in TASKS_DIR.iterdir():
        if source.suffix == ".yaml":
            text = source.read_text(encoding="utf-8")
            for old, new in targets.items():
                text = text.replace(f"test: {old}", f"test: {new}")
            (out_dir / source.name).write_text(text, encoding="utf-8")
        elif source.suffix == ".py":
            shutil.copyfile(source, out_dir / source.name)
    return out_dir
