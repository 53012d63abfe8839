"""BERT: RACE accuracy and MLM validation perplexity (the paper's BERT results), layer-norm order (Fig. 7).

RACE runs (repro/eval/race_cli.py, experiment "bert") carry params task=race, size, the model shape
(num_layers, hidden_size, num_attention_heads, seq_length), checkpoint, tp, dp and metrics
`test/acc_{middle,high,total}` (percent, of the seed with the median dev accuracy), and with two or more
seeds `ensemble/test/acc_{middle,high,total}` (their models together: Table 5's 3.9B 5-way ensemble row).
Fig. 7 runs are trainer runs (`repro train`, or repro/models/bert_ablation.py at CPU size) with the params
`model.layernorm_order`, `model.num_layers`, `model.hidden_size` and the per-step metric `mlm_loss`;
runs of the earlier standalone ablation loop (params `layernorm_order`, ..., metric `loss/mlm`) are read too.
"""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd

from repro.analysis import runs as R
from repro.analysis.paper import paper_items, paper_value, paper_values
from repro.analysis.tables import NOT_RUN, fmt, write_table

LEVELS = ("middle", "high", "total")
MLM_PPL_KEYS = ("valid/mlm_ppl", "valid_mlm_ppl", "mlm_valid_ppl")
MLM_LOSS_KEYS = ("valid/loss/mlm", "valid/mlm_loss", "valid_mlm_loss")
ORDER_NAMES = {"pre": "rearranged (paper: LN on sublayer input)", "post": "original BERT (LN after residual)"}


def _mlm_ppl(run) -> float | None:
    for key in MLM_PPL_KEYS:
        if R.get(run, f"metrics.{key}") is not None:
            return float(run[f"metrics.{key}"])
    for key in MLM_LOSS_KEYS:
        if R.get(run, f"metrics.{key}") is not None:
            return math.exp(float(run[f"metrics.{key}"]))
    return None


def _race_label(run) -> str:
    label = R.run_label(run)
    if R.get(run, "params.imported_from"):
        origin = "Megatron-LM" if R.get(run, "params.imported_with") == "import-megatron" else "imported"
        return label + f", fine-tuned from {origin} weights pretrained elsewhere"
    return label + ("" if R.get(run, "params.checkpoint") else ", random init (no pretrained checkpoint)")


def _race_model(run) -> str:
    """The row's model: its paper size (or `?`), or `SOURCE (imported)` for imported weights, which
    never fill a paper row (the paper's rows are models pretrained here)."""
    imported = R.get(run, "params.imported_from")
    return f"{imported} (imported)" if imported else R.size_name(run) or "?"


def _off_paper_recipe(run) -> str:
    """'' for a RACE run at the paper's protocol as far as it logged it; else what it ran at, e.g.
    `batch 64, lr 0.0001 (not the paper's 32, 2e-05); epochs 1 (not the paper's 3)`. Checked: batch and
    lr (of a paper size), epochs, max_qa_tokens, and training on all of RACE's training questions; a
    param a run did not log (runs before it was one) is not held against it."""
    from repro.eval.race import PAPER_EPOCHS, PAPER_MAX_QA_TOKENS, RACE_TRAIN_QUESTIONS

    checks = (_off_batch_lr(run), _off_number(run, "epochs", "epochs", PAPER_EPOCHS),
              _off_number(run, "max_qa_tokens", "max QA tokens", PAPER_MAX_QA_TOKENS),
              _off_number(run, "train_questions", "training questions", RACE_TRAIN_QUESTIONS, "RACE's"))
    return "; ".join(c for c in checks if c)


def _off_batch_lr(run) -> str:
    """'' at the paper's batch size and lr of its size (or a size without one, or neither logged)."""
    from repro.eval.race_finetune import PAPER_BATCH_LR

    paper, batch, lr = PAPER_BATCH_LR.get(R.size_name(run)), R.get(run, "params.batch_size"), R.get(run, "params.lr")
    if paper is None or batch is None or lr is None:
        return ""
    try:
        same = int(float(batch)) == paper[0] and math.isclose(float(lr), paper[1])
    except ValueError:
        same = False
    return "" if same else f"batch {batch}, lr {lr} (not the paper's {paper[0]}, {paper[1]})"


def _off_number(run, param: str, what: str, paper: int, whose: str = "the paper's") -> str:
    """'' when `param` is `paper` or not logged; else e.g. `epochs 1 (not the paper's 3)`."""
    value = R.get(run, f"params.{param}")
    if value is None:
        return ""
    try:
        same = float(value) == paper
    except ValueError:
        same = False
    return "" if same else f"{what} {value} (not {whose} {paper:,})"


def race_runs(runs: pd.DataFrame) -> list[dict]:
    """Per model (a paper size only when the logged shape is that size's), the RACE run at the paper's
    protocol (_off_paper_recipe; any, when none is) with the most seeds (the paper reports the median of
    5), the newest of those: test accuracy per level, label (naming what is off the paper's), provenance."""
    if runs.empty or "params.task" not in runs:
        return []
    race = runs[runs["params.task"] == "race"]  # newest first
    if "params.size" in race:  # race_finetune.sh --smoke: a pipeline check on a tiny model, not a table row
        race = race[race["params.size"] != "smoke"]
    seeds = race["params.seeds"].fillna("").astype(str).str.split().str.len() if "params.seeds" in race else 0
    off = [_off_paper_recipe(run) for _, run in race.iterrows()]
    out: dict[str, dict] = {}
    ranked = race.assign(_seeds=seeds, _off=[bool(o) for o in off], _recipe=off)
    for _, run in ranked.sort_values(["_off", "_seeds"], ascending=[True, False], kind="stable").iterrows():
        size, recipe = _race_model(run), run["_recipe"]
        if size in out:
            continue
        label = _race_label(run) + (f", {recipe}" if recipe else "")
        out[size] = _race_row(run, size, "test", label)
        voters = R.get(run, "metrics.ensemble/seeds")
        if voters is not None:  # the same run's seeds together: the row beside the paper's ensemble
            out[f"{size}-ensemble"] = _race_row(run, f"{size}-ensemble", "ensemble/test",
                                                f"{int(voters)}-way ensemble of its seeds' models, {label}")
    return list(out.values())


def _race_row(run, model: str, metrics: str, label: str) -> dict:
    """A RACE table row of `run`: the accuracies under `metrics`/acc_LEVEL, its label and provenance."""
    return {"model": model, "imported": bool(R.get(run, "params.imported_from")),
            **{f"race_{lv}": R.get(run, f"metrics.{metrics}/acc_{lv}") for lv in LEVELS},
            "seeds": R.get(run, "params.seeds", "?"), "label": label,
            "provenance": R.provenance(run) + f"; tp={R.get(run, 'params.tp', '?')}"
            f" dp={R.get(run, 'params.dp', '?')}; seeds {R.get(run, 'params.seeds', '?')}",
            "run_id": run["run_id"], "training_run_id": R.get(run, "tags.training_run_id")}


def _pretraining_mlm(uri: str, row: dict, by_size: dict) -> tuple[float | None, str, str] | None:
    """(MLM perplexity, run id, note) of the pretraining run the RACE run fine-tuned (its training_run_id
    tag), whatever that run's status (the note names one not FINISHED); without the tag (runs logged
    before it), of the newest pretraining run of its size, the note saying so. No perplexity (None, the
    note why) when the tagged run logged none or is not in the store: another run's is not this model's."""
    if row.get("imported"):  # pretrained elsewhere: no MLM run of ours belongs to it
        return None
    trained = row.get("training_run_id")
    if not trained:
        mlm = by_size.get(row["model"])
        fallback = "newest pretraining run of this size; the RACE run names none" if row.get("run_id") else ""
        return (*mlm, fallback) if mlm else None
    run = R.get_run_row(uri, trained)
    if run is None:
        return None, trained, f"its pretraining run {trained[:8]} is not in this store"
    ppl = _mlm_ppl(run)
    if ppl is None:
        return None, trained, f"its pretraining run {trained[:8]} logged none"
    status = "deleted" if run["deleted"] else run["status"]
    return ppl, trained, "" if status == "FINISHED" else f"pretraining run {status}"


def _ablation(run) -> bool:
    """A Fig. 7 layer-norm-order run (post-LN, or paper_ref naming Fig. 7): not the paper's pretraining."""
    order = _param(run, FIG7_PARAMS["order"]) or "pre"
    return order != "pre" or "Fig. 7" in str(R.get(run, "tags.paper_ref", ""))


def mlm_runs(runs: pd.DataFrame) -> dict[str, tuple[float, str]]:
    """Per model size, the MLM validation perplexity and run id of its newest pre-LN pretraining run
    (Fig. 7 ablation runs left out) that logged one."""
    out: dict[str, tuple[float, str]] = {}
    for _, run in runs.iterrows():
        size = R.size_name(run)
        ppl = _mlm_ppl(run)
        if size and ppl is not None and not _ablation(run):
            out.setdefault(size, (ppl, run["run_id"]))
    return out


def _with_mlm(row: dict, mlm: tuple[float | None, str, str] | None) -> dict:
    """The row with its MLM perplexity and note, and the MLM run's id (and note) in its provenance."""
    if mlm is None or mlm[0] is None:
        return {**row, "mlm_valid_ppl": None, "mlm_note": mlm[2] if mlm else ""}
    ppl, run_id, note = mlm
    source = f"MLM val ppl: run {run_id[:8]}" + (f" ({note})" if note else "")
    prov = "; ".join(p for p in (row.get("provenance", ""), source) if p)
    return {**row, "mlm_valid_ppl": ppl, "mlm_run_id": run_id, "mlm_note": note, "provenance": prov}


def build(tracking_uri: str, experiment: str = "bert") -> pd.DataFrame:
    """Paper BERT sizes (with measured run or 'not run') then the other measured RACE runs."""
    paper, runs = paper_values(), R.load_runs(tracking_uri, experiment)
    race, mlm = {r["model"]: r for r in race_runs(runs)}, mlm_runs(runs)
    rows = []
    for item in paper_items(paper, "bert"):
        row = {"model": item, **{f"paper_race_{lv}": paper_value(paper, "bert", item, f"race_{lv}") for lv in LEVELS},
               "paper_mlm_valid_ppl": paper_value(paper, "bert", item, "mlm_valid_ppl"), **race.pop(item, {})}
        rows.append(_with_mlm(row, _pretraining_mlm(tracking_uri, row, mlm)))
    for r in race.values():
        rows.append(_with_mlm(r, _pretraining_mlm(tracking_uri, r, mlm)))
    return pd.DataFrame(rows)


def _mlm_cell(r, ran: bool) -> str:
    """The measured MLM perplexity, with its note (a pretraining run not FINISHED, or not the tagged one)."""
    ppl, note = R.get(r, "mlm_valid_ppl"), R.get(r, "mlm_note")
    if ppl is not None:
        return fmt(ppl) + (f" ({note})" if note else "")
    if R.get(r, "imported"):
        return "pretrained elsewhere"
    return (note or "not logged") if ran else NOT_RUN


def display(table: pd.DataFrame) -> pd.DataFrame:
    """Paper and measured RACE test accuracy side by side, MLM perplexity, label and provenance."""
    rows = []
    for _, r in table.iterrows():
        ran = R.get(r, "run_id") is not None
        paper = R.get(r, "paper_race_total") is not None
        cells = [r["model"]]
        for lv in LEVELS:
            cells += [fmt(R.get(r, f"paper_race_{lv}"), 1) if paper else "—",
                      fmt(R.get(r, f"race_{lv}"), 1) if ran else NOT_RUN]
        cells += [fmt(R.get(r, "paper_mlm_valid_ppl")) if paper else "—", _mlm_cell(r, ran),
                  R.get(r, "label", ""), R.get(r, "provenance", "")]
        rows.append(cells)
    cols = ["model"] + [f"{w} {lv}" for lv in LEVELS for w in ("paper", "measured")]
    return pd.DataFrame(rows, columns=cols + ["paper MLM val ppl", "measured MLM val ppl", "measured on", "provenance"])


FIG7_PARAMS = {"order": ("model.layernorm_order", "layernorm_order"), "layers": ("model.num_layers", "num_layers"),
               "hidden": ("model.hidden_size", "hidden_size")}
"""Param of a trainer run, then of a run of the earlier standalone ablation loop."""


def _param(run, names: tuple[str, ...]):
    values = (R.get(run, f"params.{n}") for n in names)
    return next((v for v in values if v is not None), None)


def _order_runs(runs: pd.DataFrame) -> pd.DataFrame:
    """Runs with a layer-norm order (newest first); only those whose paper_ref names Fig. 7 when any do."""
    rows = runs.assign(**{k: [_param(r, names) for _, r in runs.iterrows()] for k, names in FIG7_PARAMS.items()})
    rows = rows[rows["order"].notna()]
    ref = rows["tags.paper_ref"].fillna("") if "tags.paper_ref" in rows else pd.Series("", index=rows.index)
    fig7 = rows[ref.astype(str).str.contains("Fig. 7", regex=False)]
    return fig7 if len(fig7) else rows


def _curve_label(run) -> str:
    size = f"{run['layers']} layers, h={run['hidden']}"
    return f"{ORDER_NAMES[run['order']]} [{size}; {R.run_label(run)}; run {run['run_id'][:8]}]"


def _size_key(run) -> tuple[int, int, int]:
    """(~ transformer parameters l h^2, layers, hidden): sorts sizes smallest first."""
    layers, hidden = int(run["layers"] or 0), int(run["hidden"] or 0)
    return layers * hidden ** 2, layers, hidden


def layernorm_curves(tracking_uri: str, experiment: str = "bert") -> dict[str, pd.DataFrame]:
    """Fig. 7: for every model size among the layer-norm-order runs (smallest first, e.g. 336M, where
    both orders train, then 1.3B, where the paper reports the original order unstable), the newest run
    of each order; its MLM training loss against iteration."""
    runs = R.load_runs(tracking_uri, experiment)
    runs = _order_runs(runs) if len(runs) else runs
    curves = {}
    for size in sorted({_size_key(run) for _, run in runs.iterrows()}):
        of_size = runs[[_size_key(run) == size for _, run in runs.iterrows()]]
        for order in ("pre", "post"):
            part = of_size[of_size["order"] == order]
            if len(part):
                run = part.iloc[0]
                metric = "mlm_loss" if R.get(run, "params.model.layernorm_order") else "loss/mlm"  # trainer / old loop
                curves[_curve_label(run)] = R.metric_history(tracking_uri, run["run_id"], metric)
    return curves


def report(tracking_uri: str, out_dir: str | Path, experiment: str = "bert") -> str:
    """Write bert_table.{csv,md} and fig7_layernorm_order.png; return the Markdown."""
    from repro.analysis.figures import plot_curves
    from repro.eval.race import PAPER_EPOCHS, PAPER_MAX_QA_TOKENS, RACE_TRAIN_QUESTIONS

    out_dir = Path(out_dir)
    notes = ["RACE: test-set accuracy (%) of the run's median seed by dev accuracy; an `-ensemble` row, of the same "
             "run's seeds' models together (each question's option probabilities averaged over the seeds: the paper "
             "does not say how its 5 models were combined). Paper MLM perplexity is on a 3% held-out "
             "set; 'not logged' means the run has no MLM validation metric. A RACE row's MLM perplexity is its "
             "pretraining run's (tag training_run_id), with that run's status when not FINISHED.",
             "Rows labelled reduced size / random init are pipeline checks on the hand-written RACE fixture "
             "(tests/fixtures/race), not the RACE dataset: not comparable to the paper.",
             f"A RACE label naming a batch/lr, epochs, max QA tokens or a training set other than the paper's "
             f"({PAPER_EPOCHS} epochs, {PAPER_MAX_QA_TOKENS} QA tokens, all {RACE_TRAIN_QUESTIONS:,} RACE training "
             "questions) marks a run off the paper's protocol: it fills a row only when no run of that model is on it."]
    table = build(tracking_uri, experiment)
    text = write_table(display(table), table, out_dir, "bert_table", "BERT: RACE and MLM validation perplexity",
                       notes, tracking_uri)
    plot_curves(layernorm_curves(tracking_uri, experiment), out_dir / "fig7_layernorm_order.png",
                "MLM training loss", "Fig. 7: layer-norm order (measured; the paper's curves are for BERT of 336M and larger)",
                empty_note="no layer-norm-order runs (python -m repro.models.bert_ablation, or the configs "
                           "experiments/bert/fig7_{336m,1.3b}_{pre,post}.yaml)")
    return text
