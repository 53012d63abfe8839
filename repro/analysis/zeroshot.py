"""Zero-shot table (Table 3: WikiText-103 perplexity, LAMBADA accuracy) and validation perplexity (Fig. 6).

Evaluation runs live in experiment "zero-shot" (repro/eval/report.py): metrics `wikitext/word_ppl`
and `lambada/accuracy` (a fraction), tag `task`, tag `training_run_id` naming the evaluated model's
training run, whose params give the model size, device and the rest of the provenance. Per model
the table shows a WikiText and a LAMBADA eval of one checkpoint where one has both (`_pair`), each the
eval that follows the paper's protocol (`follows_paper`), of the latest checkpoint, that scored the
most of the test set (`_rank`), the newest among equals; evals of two checkpoints say so.
"""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd

from repro.analysis import runs as R
from repro.analysis.paper import paper_items, paper_value, paper_values
from repro.analysis.tables import NOT_RUN, fmt, write_table

PAPER_PROTOCOL = {"window": "1024", "stride": "32", "max_lines": "all", "file": "wiki.test.tokens"}
PAPER_BPE_TOKENS = 270329  # T of WikiText-103's wiki.test.tokens, the paper's file (Appendix E)
FILE_LABELS = {"wikitext-2.test.tokens": "WikiText-2 tokens file (not like-for-like)",
               "wiki.test.raw": "WikiText raw file (not like-for-like)"}


def _paper_file(ev) -> bool:
    """WikiText-103's wiki.test.tokens: by its BPE count T = 270,329 when the whole file was scored,
    else by name (WikiText-2's zip holds a wiki.test.tokens too: its T is 278,365)."""
    tokens = R.get(ev, "metrics.wikitext/num_bpe_tokens")
    if tokens is not None and str(R.get(ev, "params.max_lines", "?")) == "all":
        return int(tokens) == PAPER_BPE_TOKENS
    return R.get(ev, "params.file") == PAPER_PROTOCOL["file"]


def _file_label(ev) -> str:
    name = str(R.get(ev, "params.file", "?"))
    if _paper_file(ev):
        return f"{name} (WikiText-103, the paper's)"
    if name == PAPER_PROTOCOL["file"]:
        return f"{name} (T={int(R.get(ev, 'metrics.wikitext/num_bpe_tokens')):,}, not the paper's 270,329)"
    return FILE_LABELS.get(name, name)


def follows_paper(ev) -> bool:
    """The paper's protocol: strict LAMBADA on every passage; WikiText at window 1024, stride 32 over
    the whole of WikiText-103's wiki.test.tokens."""
    if R.get(ev, "tags.task") == "lambada":
        subset = str(R.get(ev, "params.max_examples", "all"))  # runs before the option logged none
        return R.get(ev, "params.strict") == "True" and subset == "all"
    settings = {k: str(R.get(ev, f"params.{k}", "?")) for k in PAPER_PROTOCOL if k != "file"}
    return all(PAPER_PROTOCOL[k] == v for k, v in settings.items()) and _paper_file(ev)


def _protocol(ev) -> str:
    if ev is None:
        return ""
    if R.get(ev, "tags.task") == "lambada":
        strict = "strict" if R.get(ev, "params.strict") == "True" else "NOT strict"
        subset = str(R.get(ev, "params.max_examples", "all"))
        return f"lambada: {strict}" + (" (paper)" if follows_paper(ev) else
                                       "" if subset == "all" else f", first {subset} passages only")
    if follows_paper(ev):
        return "wikitext: paper protocol"
    got = {k: str(R.get(ev, f"params.{k}", "?")) for k in PAPER_PROTOCOL if k != "file"}
    return "wikitext: reduced: " + ", ".join(f"{k}={v}" for k, v in got.items()) + f", file={_file_label(ev)}"


def _protocols(w, l) -> str:
    """Both evals' protocols, and their checkpoints when they differ (_checkpoints)."""
    return "; ".join(p for p in (_protocol(w), _protocol(l), _checkpoints(w, l)) if p)


def _coverage(ev) -> float:
    """How much of the test set the eval scored: WikiText targets or LAMBADA passages (0 if unlogged)."""
    metric = "lambada/num_examples" if R.get(ev, "tags.task") == "lambada" else "wikitext/num_targets"
    return float(R.get(ev, f"metrics.{metric}", 0.0))


def _iteration(ev) -> int:
    """The training iteration of the evaluated checkpoint (-1 when not logged: evals before it was)."""
    value = str(R.get(ev, "params.checkpoint_iteration", ""))
    return int(value) if value.isdigit() else -1


def _rank(ev) -> tuple:
    return follows_paper(ev), _iteration(ev), _coverage(ev)


def _best(evals: pd.DataFrame):
    """The eval ranking first by _rank (newest first: a later one wins only by ranking strictly higher);
    None for none."""
    best = None
    for _, ev in evals.sort_values("start_time", ascending=False).iterrows():
        if best is None or _rank(ev) > _rank(best):
            best = ev
    return best


def _pair(evals: pd.DataFrame) -> tuple:
    """One model's (WikiText, LAMBADA) evals, either None: the best (_best) of one checkpoint, the
    checkpoint with both tasks that follows the paper's protocol most, then the latest; with no logged
    checkpoint iteration holding both, each task's best (_checkpoints shows the mismatch)."""
    tasks = [evals[evals["tags.task"] == task] for task in ("wikitext", "lambada")]
    iterations = [{_iteration(ev) for _, ev in part.iterrows()} for part in tasks]
    both = (iterations[0] & iterations[1]) - {-1}
    if not both:
        return tuple(_best(part) for part in tasks)
    pairs = [tuple(_best(part.loc[[_iteration(ev) == it for _, ev in part.iterrows()]]) for part in tasks)
             for it in both]
    return max(pairs, key=lambda p: (follows_paper(p[0]) + follows_paper(p[1]), _iteration(p[0])))


def _chosen_by_model(evals: pd.DataFrame) -> dict[str, tuple]:
    """Per evaluated model (_model_key), its WikiText and LAMBADA evals (_pair): of one checkpoint where
    it can, each following the paper's protocol, of the latest checkpoint (a mid-training one, or an
    older iter_* evaluated later, does not replace the final one), that scored the most of the test set
    (a quick check on 40 lines does not replace a full-file eval); the newest among equals."""
    if evals.empty or "tags.task" not in evals:
        return {}
    evals = evals[evals["tags.task"].isin(["wikitext", "lambada"])].sort_values("start_time", ascending=False)
    keys = [_model_key(ev) for _, ev in evals.iterrows()]
    return {key: _pair(evals.loc[[k == key for k in keys]]) for key in dict.fromkeys(keys)}


def _checkpoints(w, l) -> str:
    """A note when the two evals are of different checkpoints of one run (both iterations logged)."""
    if w is None or l is None or -1 in (_iteration(w), _iteration(l)) or _iteration(w) == _iteration(l):
        return ""
    return (f"different checkpoints: wikitext of iteration {_iteration(w)}, lambada of iteration "
            f"{_iteration(l)} (no checkpoint has both)")


def _model_key(ev) -> str:
    """The evaluated model: its training run id, `imported:SOURCE` for `checkpoint import-hf` weights,
    `checkpoint:PATH` for a checkpoint whose training was not tracked."""
    imported = R.get(ev, "params.imported_from")
    if imported:
        return f"imported:{imported}"
    return R.get(ev, "tags.training_run_id") or f"checkpoint:{R.get(ev, 'params.checkpoint', 'unknown')}"


def _model_name(train, size: str | None) -> str:
    """The paper size; else the run name, or `custom L2-h64-a16-s1024` when that name is a paper size's
    (the trainer names a `--set model.num_layers=2` run of gpt2_355m.yaml `gpt2-355m`)."""
    name = R.get(train, "run_name")
    return size or (name if name and not R.is_paper_size(name) else f"custom {R.shape_text(train)}")


def _train_label(train) -> str:
    """run_label, with the training run's status when it did not finish (KILLED, FAILED, deleted)."""
    status = "deleted" if R.get(train, "deleted") else R.get(train, "status", "FINISHED")
    return R.run_label(train) + ("" if status == "FINISHED" else f", training run {status}")


def measured_models(tracking_uri: str, experiment: str = "zero-shot") -> pd.DataFrame:
    """One row per evaluated training run: model size, word ppl, LAMBADA %, label, provenance, run ids."""
    rows = []
    for train_id, (w, l) in _chosen_by_model(R.load_runs(tracking_uri, experiment)).items():
        if train_id.startswith("imported:"):
            rows.append(_imported_row(train_id.removeprefix("imported:"), w, l))
            continue
        row = _trained_row(tracking_uri, train_id, w, l)
        if row is not None:
            rows.append(row)
    return pd.DataFrame(rows)


def _trained_row(tracking_uri: str, train_id: str, w, l) -> dict | None:
    """A row for a model trained here: its training run (or untracked checkpoint) and chosen evals;
    None for a model a Slurm script's --smoke trained (its evals check the pipeline, not the model)."""
    untracked = train_id.startswith("checkpoint:")
    train = None if untracked else R.get_run_row(tracking_uri, train_id)
    if train and train.get("experiment") == R.SMOKE_EXPERIMENT:
        return None
    size = R.paper_size(train) if train else None
    acc = R.get(l, "metrics.lambada/accuracy") if l is not None else None
    evals = [e for e in (w, l) if e is not None]
    return {"model": _model_name(train, size) if train else train_id,
            "paper_size": size is not None,
            "wikitext_word_ppl": R.get(w, "metrics.wikitext/word_ppl") if w is not None else None,
            "lambada_acc": 100 * acc if acc is not None else None,
            "label": _train_label(train) if train else
            "training not tracked" if untracked else "training run not in this store",
            "protocol": _protocols(w, l),
            "provenance": (R.provenance(train) if train else train_id if untracked else
                           f"training run {train_id[:8]}")
            + "; eval runs " + ", ".join(str(e["run_id"])[:8] for e in evals),
            "paper_protocol": sum(follows_paper(e) for e in evals),
            "eval_time": max(R.get(e, "start_time", 0) for e in evals),
            "training_run_id": train_id}


def _imported_row(source: str, w, l) -> dict:
    """A row for weights imported with `repro checkpoint import-hf` (OpenAI's GPT-2, say) or
    `import-megatron` (NVIDIA's GPT-2 345M, say)."""
    acc = R.get(l, "metrics.lambada/accuracy") if l is not None else None
    command = R.get(w if w is not None else l, "params.imported_with") or "import-hf"
    origin = "Megatron-LM" if command == "import-megatron" else "Hugging Face"
    return {"model": f"{source} (imported)", "paper_size": False,
            "wikitext_word_ppl": R.get(w, "metrics.wikitext/word_ppl") if w is not None else None,
            "lambada_acc": 100 * acc if acc is not None else None,
            "label": f"imported {origin} weights, not trained here",
            "protocol": _protocols(w, l),
            "provenance": f"`repro checkpoint {command} {source}`; eval runs "
            + ", ".join(str(e["run_id"])[:8] for e in (w, l) if e is not None),
            "training_run_id": ""}


def build(tracking_uri: str, experiment: str = "zero-shot") -> pd.DataFrame:
    """Paper rows (Table 3 models, each with its paper-size run whose evals follow the paper's protocol,
    then the newest, or 'not run') then the other measured models."""
    paper, measured = paper_values(), measured_models(tracking_uri, experiment)
    rows, used = [], set()
    for item in paper_items(paper, "zero_shot"):
        row = {"model": item, "paper_wikitext_ppl": paper_value(paper, "zero_shot", item, "wikitext103_ppl"),
               "paper_lambada_acc": paper_value(paper, "zero_shot", item, "lambada_acc")}
        hit = measured[measured["paper_size"] & (measured["model"] == item)] if len(measured) else measured
        if len(hit):
            best = hit.sort_values(["paper_protocol", "eval_time"], ascending=False).iloc[0]
            used.add(best.name)
            row.update(best.drop("model").to_dict())
        rows.append(row)
    for idx, m in measured.iterrows():
        if idx not in used:
            rows.append(m.to_dict())
    return pd.DataFrame(rows)


def display(table: pd.DataFrame) -> pd.DataFrame:
    """Paper and measured side by side; 'not run' where a paper model has no evaluation."""
    rows = []
    for _, r in table.iterrows():
        has_run = R.get(r, "training_run_id") is not None
        is_paper = R.get(r, "paper_wikitext_ppl") is not None
        missing = NOT_RUN if r["model"] != "previous-best" else "—"
        other = "— (paper size, another run)" if R.get(r, "paper_size") else "— (not a paper model)"
        rows.append([r["model"], fmt(R.get(r, "paper_wikitext_ppl")) if is_paper else other,
                     fmt(R.get(r, "wikitext_word_ppl")) if has_run else missing,
                     fmt(R.get(r, "paper_lambada_acc")) if is_paper else "—",
                     fmt(R.get(r, "lambada_acc")) if has_run else missing,
                     R.get(r, "label", ""), R.get(r, "protocol", ""), R.get(r, "provenance", "")])
    return pd.DataFrame(rows, columns=["model", "paper WikiText-103 ppl", "measured word ppl", "paper LAMBADA %",
                                       "measured LAMBADA %", "measured on", "eval protocol", "provenance"])


def valid_curves(tracking_uri: str, experiments: tuple[str, ...] = ("gpt2",)) -> dict[str, pd.DataFrame]:
    """Validation perplexity exp(valid_loss) against iteration for every run that logged valid_loss,
    unfinished ones too (as in Table 2: GPT-2 runs take weeks), their status in the legend."""
    from repro.analysis.figures import short_label

    curves = {}
    for experiment in experiments:
        runs = R.load_runs(tracking_uri, experiment, finished_only=False)
        for _, run in runs.iterrows():
            if R.get(run, "metrics.valid_loss") is None:
                continue
            hist = R.metric_history(tracking_uri, run["run_id"], "valid_loss")
            curves[short_label(run)] = hist.assign(value=[math.exp(min(v, 700)) for v in hist["value"]])
    return curves


def report(tracking_uri: str, out_dir: str | Path, experiment: str = "zero-shot",
           train_experiments: tuple[str, ...] = ("gpt2",)) -> str:
    """Write zero_shot_table.{csv,md} and fig6_valid_ppl.png; return the Markdown."""
    from repro.analysis.figures import plot_curves

    out_dir = Path(out_dir)
    table = build(tracking_uri, experiment)
    notes = ["Measured word ppl: `wikitext/word_ppl` = exp(sum NLL / T_o) on the word-level WikiText test file. "
             "Paper protocol: WikiText-103's wiki.test.tokens (T = 270,329 BPE tokens), window 1024, stride 32; "
             "WikiText-2's tokens file has the same text with more <unk> (3 BPE targets each): not like-for-like. "
             "LAMBADA: strict last-word accuracy over the 5,153 passages.",
             "Per model, both evaluations are of one checkpoint (`checkpoint_iteration`) where one has both tasks: "
             "the checkpoint whose pair follows the paper's protocol most, then the latest; else each task's own "
             "choice, the eval protocol column naming the two checkpoints. Each evaluation shown follows the "
             "paper's protocol if any does, then is of its latest checkpoint, then scored the most of the test "
             "set; the newest among equals.",
             "Rows labelled CPU or reduced size evaluate small models trained here for minutes: they test the "
             "pipeline and are not comparable to the paper's numbers."]
    text = write_table(display(table), table, out_dir, "zero_shot_table",
                       "Zero-shot evaluation (Table 3)", notes, tracking_uri)
    ref = paper_value(paper_values(), "zero_shot", "gpt2-8.3b", "valid_ppl_final")
    plot_curves(valid_curves(tracking_uri, train_experiments), out_dir / "fig6_valid_ppl.png",
                "validation perplexity exp(valid_loss)", "Fig. 6: validation perplexity vs iteration "
                f"(measured runs of {', '.join(train_experiments)}; paper: 8.3B GPT-2)", log_y=True,
                reference=(ref, f"paper: 8.3B final validation ppl {ref} (Fig. 6)"))
    return text
