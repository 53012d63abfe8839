"""Offline lm-eval tasks: copies of repro/eval/tasks with absolute data paths, and their data.

    tasks_dir = write_local_tasks(Path("data"), Path("/tmp/tasks"))
    # lm_eval ... --include_path /tmp/tasks --tasks lambada_openai_local,wikitext_local
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from repro.data.fetch import data_path

TASKS_DIR = Path(__file__).resolve().parent / "tasks"
LAMBADA = "lambada/lambada_openai.test.jsonl"
WIKITEXT_RAW = "wikitext/wiki.test.raw"
WIKITEXT_PAGES = "wikitext/wikitext_document_level.test.jsonl"


def _is_article_title(line: str) -> bool:
    """A top-level ' = Title = ' line (section headers ' = = Title = = ' are not)."""
    line = line.replace("= = =", "===").replace("= =", "==").strip()
    return line.startswith("= ") and line.endswith(" =")


def wikitext_pages(raw_text: str) -> list[str]:
    """wiki.test.raw split into articles as lm-eval's wikitext dataset (EleutherAI/wikitext_document_level)
    splits it: the text's lines (split at "\n") joined again with "\n", a new page at each article title,
    blank pages dropped. A page so ends without the newline before the next title."""
    pages, lines = [], []
    for line in raw_text.split("\n"):
        if _is_article_title(line):
            pages.append("\n".join(lines))
            lines = []
        lines.append(line)
    pages.append("\n".join(lines))
    return [p for p in pages if p.strip()]


def write_local_tasks(data_dir: Path | str, out_dir: Path | str) -> Path:
    """Write the task YAMLs (data paths made absolute, quoted) and the wikitext page jsonl into out_dir."""
    data_dir, out_dir = Path(data_dir), Path(out_dir)  # as strings too, as README.md shows the call
    pages = wikitext_pages(data_path(data_dir, WIKITEXT_RAW).read_text(encoding="utf-8"))
    lambada = data_path(data_dir, LAMBADA).resolve()  # both inputs found before out_dir is made
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / "wikitext_document_level.test.jsonl", "w", encoding="utf-8") as handle:
        handle.writelines(json.dumps({"page": p}, ensure_ascii=False) + "\n" for p in pages)
    targets = {f"data/{LAMBADA}": lambada,
               f"data/{WIKITEXT_PAGES}": (out_dir / "wikitext_document_level.test.jsonl").resolve()}
    for source in TASKS_DIR.iterdir():
        if source.suffix == ".yaml":
            text = source.read_text(encoding="utf-8")
            for old, new in targets.items():
                text = text.replace(f"test: {old}", f"test: {json.dumps(str(new))}")  # quoted: a " #" stays
            (out_dir / source.name).write_text(text, encoding="utf-8")
        elif source.suffix == ".py":
            shutil.copyfile(source, out_dir / source.name)
    return out_dir
