"""RACE (Lai et al. 2017) for the paper's BERT fine-tuning (§5): loader, inputs, accuracy, CLI.

Official layout: `RACE/{train,dev,test}/{middle,high}/*.txt`, each file one JSON object with
`article`, `questions`, `options` (4 per question), `answers` ("A"-"D"). Download it from
https://www.cs.cmu.edu/~glai1/data/race/ (research use only; there is no copy offline), extract,
and pass `--race-dir path/to/RACE` (or set REPRO_RACE_DIR). tests/fixtures/race is a small
hand-written set in the same format.

Input (paper / 2020 Megatron code): 4 samples per question, `[CLS] qa [SEP] article [SEP]` with
qa = the question with its "_" replaced by the option (else question + " " + option), qa at most
128 tokens, the article truncated to fill seq_length; token types 0 for `[CLS] qa [SEP]`, 1 after.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch

SPLITS, LEVELS, ANSWERS = ("train", "dev", "test"), ("middle", "high"), "ABCD"
REQUIRED_KEYS = ("article", "questions", "options", "answers")
DOWNLOAD_FIX = ("download RACE from https://www.cs.cmu.edu/~glai1/data/race/, extract it and pass "
                "--race-dir path/to/RACE (the folder holding train/ dev/ test/)")


class RaceFormatError(ValueError):
    """A RACE file or folder that does not follow the official layout; the message names it."""


@dataclass(frozen=True)
class RaceQuestion:
    """One question with its 4 options; `label` is the index of the right one."""

    level: str
    source: str
    article: str
    question: str
    options: tuple[str, ...]
    label: int


def _bad(path: Path, problem: str) -> RaceFormatError:
    return RaceFormatError(f"{path}: {problem}. Fix: correct or remove this file "
                           f"(official RACE files are JSON with keys {', '.join(REQUIRED_KEYS)})")


def parse_race_file(path: Path, level: str) -> list[RaceQuestion]:
    """The questions of one RACE file, validated (keys, 4 options, answers in A-D)."""
    try:
        doc = json.loads(Path(path).read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise _bad(path, f"not valid JSON ({err})") from None
    except OSError as err:  # a dangling link, no permission: the errno alone named no fix
        raise _bad(path, f"cannot be read ({err.strerror or err})") from None
    if not isinstance(doc, dict):
        raise _bad(path, "not a JSON object")
    missing = [k for k in REQUIRED_KEYS if k not in doc]
    if missing:
        raise _bad(path, f"missing key(s) {', '.join(map(repr, missing))}")
    qs, opts, answers = doc["questions"], doc["options"], doc["answers"]
    not_lists = [k for k in ("questions", "options", "answers") if not isinstance(doc[k], list)]
    if not_lists:
        raise _bad(path, f"{', '.join(map(repr, not_lists))} must be JSON lists")
    if not (len(qs) == len(opts) == len(answers)):
        raise _bad(path, f"{len(qs)} questions, {len(opts)} option lists and {len(answers)} answers "
                         "(they must be equal)")
    if not isinstance(doc["article"], str):
        raise _bad(path, f"the article is a {type(doc['article']).__name__}, not text")
    out = []
    for i, (q, options, answer) in enumerate(zip(qs, opts, answers)):
        if not isinstance(q, str):
            raise _bad(path, f"question {i} is a {type(q).__name__}, not text")
        if not isinstance(options, list) or len(options) != 4:
            n = len(options) if isinstance(options, list) else type(options).__name__
            raise _bad(path, f"question {i} has {n} options, not 4")
        if not all(isinstance(o, str) for o in options):
            raise _bad(path, f"question {i} has an option that is not text ({options!r})")
        if not isinstance(answer, str) or answer not in ANSWERS or len(answer) != 1:
            raise _bad(path, f"question {i} has answer {answer!r}, not one of A, B, C, D")
        out.append(RaceQuestion(level, str(path), doc["article"], q, tuple(options), ANSWERS.index(answer)))
    return out


def load_race(root: Path | str, split: str, levels: tuple[str, ...] = LEVELS) -> list[RaceQuestion]:
    """Every question of `split` under root/split/{middle,high}/*.txt, in sorted file order."""
    root = Path(root)
    if split not in SPLITS:
        raise RaceFormatError(f"unknown RACE split {split!r}: use one of {', '.join(SPLITS)}")
    questions: list[RaceQuestion] = []
    for level in levels:
        folder = root / split / level
        if not folder.is_dir():
            raise RaceFormatError(f"{folder}: missing (RACE layout is {{train,dev,test}}/{{middle,high}}"
                                  f"/*.txt). Fix: {DOWNLOAD_FIX}")
        files = sorted(filter(_race_file, folder.glob("*.txt")), key=lambda p: (len(p.stem), p.stem))
        if not files:
            raise RaceFormatError(f"{folder}: no *.txt files. Fix: {DOWNLOAD_FIX}")
        for path in files:
            questions += parse_race_file(path, level)
    return questions


def _race_file(path: Path) -> bool:
    """A file to read: a regular file (or a link to one), or a dangling link (reported by
    parse_race_file); a directory named *.txt is not one."""
    return path.is_file() or (path.is_symlink() and not path.exists())


def check_questions(root: Path, raw: dict[str, list[RaceQuestion]]) -> None:
    """RaceFormatError for a split, or a level of a split, without questions (its accuracy would be
    nan, or the run would fail after training): the paper reports middle and high of dev and test."""
    empty = [s for s, q in raw.items() if not q]
    if empty:
        raise RaceFormatError(f"{root}: the {' and '.join(empty)} split(s) hold no questions. Fix: point "
                              "--race-dir (REPRO_RACE_DIR) at the full RACE release (train, dev and test)")
    missing = [f"{s}/{lv}" for s, q in raw.items() for lv in LEVELS if not any(x.level == lv for x in q)]
    if missing:
        raise RaceFormatError(f"{root}: {', '.join(missing)} hold(s) no questions (each level's accuracy is "
                              f"reported). Fix: {DOWNLOAD_FIX}")


def race_dir_from_env(value: str | None) -> Path:
    """--race-dir, else REPRO_RACE_DIR; a clear error when neither is given."""
    value = value or os.environ.get("REPRO_RACE_DIR")
    if not value:
        raise RaceFormatError(f"no RACE directory given. Fix: {DOWNLOAD_FIX} or set REPRO_RACE_DIR")
    return Path(value)


def question_with_option(question: str, option: str) -> str:
    """The paper's qa text: "_" replaced by the option, else the option appended."""
    return question.replace("_", option) if "_" in question else f"{question} {option}"


PAPER_EPOCHS = 3
PAPER_MAX_QA_TOKENS = 128  # question+option tokens of an input (paper §5)
RACE_TRAIN_QUESTIONS = 87_866  # the official RACE release's training split (middle and high)

INPUT_DTYPES = {"tokens": np.int32, "token_types": np.uint8, "padding_mask": np.uint8}
"""How a split is held (6 bytes a position, not int64's 24: the 87,866 training questions at s=512 take
1.1 GB a rank, not 4.3); a batch is made int64 as it goes to the model (race_finetune._rows)."""


def build_choice_inputs(q: RaceQuestion, tokenizer, seq_length: int, max_qa_tokens: int = PAPER_MAX_QA_TOKENS,
                        article_ids: list[int] | None = None) -> dict[str, np.ndarray]:
    """tokens, token_types, padding_mask, each (4, seq_length): one row per option."""
    if seq_length < 8:
        raise ValueError(f"seq_length={seq_length} is too short for [CLS] qa [SEP] article [SEP]; use >= 8")
    article = tokenizer.encode(q.article) if article_ids is None else article_ids
    rows = {k: np.zeros((4, seq_length), dtype=dtype) for k, dtype in INPUT_DTYPES.items()}
    rows["tokens"][:] = tokenizer.pad
    for j, option in enumerate(q.options):
        qa = tokenizer.encode(question_with_option(q.question, option))[: min(max_qa_tokens, seq_length - 4)]
        ctx = article[: seq_length - len(qa) - 3]
        ids = [tokenizer.cls, *qa, tokenizer.sep, *ctx, tokenizer.sep]
        rows["tokens"][j, : len(ids)] = ids
        rows["token_types"][j, len(qa) + 2: len(ids)] = 1
        rows["padding_mask"][j, : len(ids)] = 1
    return rows


@dataclass
class RaceTensors:
    """A split as tensors: tokens/token_types/padding_mask (n, 4, s), labels (n,), levels."""

    tokens: "torch.Tensor"
    token_types: "torch.Tensor"
    padding_mask: "torch.Tensor"
    labels: "torch.Tensor"
    levels: list[str]

    def __len__(self) -> int:
        return len(self.labels)


def encode_race(questions: list[RaceQuestion], tokenizer, seq_length: int,
                max_qa_tokens: int = PAPER_MAX_QA_TOKENS) -> RaceTensors:
    """Tokenize every question's 4 samples (each article encoded once)."""
    import torch

    if not questions:
        raise RaceFormatError("no RACE questions to encode: the split is empty")
    cache: dict[str, list[int]] = {}
    rows = []
    for q in questions:
        ids = cache.get(q.source)
        if ids is None:
            ids = cache[q.source] = tokenizer.encode(q.article)
        rows.append(build_choice_inputs(q, tokenizer, seq_length, max_qa_tokens, ids))
    stack = {k: torch.from_numpy(np.stack([r[k] for r in rows])) for k in rows[0]}
    return RaceTensors(stack["tokens"], stack["token_types"], stack["padding_mask"],
                       torch.tensor([q.label for q in questions]), [q.level for q in questions])


def accuracy_by_level(predictions: torch.Tensor, labels: torch.Tensor, levels: list[str]) -> dict[str, float]:
    """Accuracy (%) on middle, high and total, as the paper's Table 5 reports it."""
    right = (predictions == labels).tolist()
    out = {}
    for level in LEVELS:
        picked = [r for r, lv in zip(right, levels) if lv == level]
        out[level] = 100.0 * sum(picked) / len(picked) if picked else float("nan")
    out["total"] = 100.0 * sum(right) / len(right)
    return out


def format_accuracy(split: str, acc: dict[str, float]) -> str:
    """One line: `dev   middle 86.9  high 81.5  total 83.0` (percent)."""
    return f"{split:<5} " + "  ".join(f"{k} {acc[k]:5.1f}" for k in ("middle", "high", "total"))


def _finetune_race(args) -> int:
    from repro.train.signals import recording_stop_signals

    with recording_stop_signals():  # a stop signal before the loop's handler exists is honoured after a step
        from repro.eval.race_cli import run

        return run(args)


def register(sub) -> None:
    """Add `repro finetune race` (heavy imports happen only when it runs)."""
    finetune = sub.add_parser("finetune", help="fine-tune a pretrained model on a downstream task")
    tasks = finetune.add_subparsers(dest="task", required=True, metavar="TASK")
    p = tasks.add_parser("race", help="RACE reading comprehension (paper Table 5)")
    p.add_argument("--race-dir", help="RACE root with {train,dev,test}/{middle,high} (REPRO_RACE_DIR)")
    p.add_argument("--checkpoint", help="pretrained BERT (repro.models.bert_checkpoint, any TP degree)")
    p.add_argument("--size", help="bert-336m | bert-1.3b | bert-3.9b: the paper's batch/lr, logged as the size "
                   "(default: the size of the model's shape, else custom; bert-336m without --checkpoint "
                   "and --model-config)")
    p.add_argument("--model-config", help="a BERT training config (experiments/bert/*.yaml: its model_size and "
                   "includes apply) or a YAML with only a model: block (e.g. experiments/bert/tiny_cpu.yaml)")
    p.add_argument("--data-dir", help="holds vocab/bert-large-uncased-vocab.txt (REPRO_DATA_DIR)")
    p.add_argument("--vocab", help="a WordPiece vocab.txt to use instead of the data dir's")
    p.add_argument("--epochs", type=int, default=PAPER_EPOCHS)
    p.add_argument("--batch-size", type=int, help="questions per batch (paper: 32, 16 for 1.3B)")
    p.add_argument("--lr", type=float, help="peak learning rate (paper: 2e-5, 1e-5 for 1.3B)")
    p.add_argument("--seq-length", type=int, default=512)
    p.add_argument("--max-qa-tokens", type=int, default=PAPER_MAX_QA_TOKENS)
    p.add_argument("--seeds", type=int, nargs="+", default=[1234, 1235, 1236, 1237, 1238],
                   help="one run per seed; reported: the seed with the median dev accuracy (paper: 5 seeds)")
    p.add_argument("--tp", type=int, help="tensor-parallel degree (launch with torchrun; the rest is DP). "
                   "Default: 1 on CPU; on GPUs the smallest that fits weights, gradients and Adam state "
                   "(16 bytes a parameter / TP, x1.25) in the device's memory")
    p.add_argument("--precision", choices=("fp32", "bf16", "fp16"), default="fp32",
                   help="fp32, or autocast over fp32 weights in bf16 or fp16 (fp16 with dynamic loss scaling); "
                        "on V100s fp16 is several times faster than fp32")
    p.add_argument("--eval-train", action="store_true",
                   help="also score the training split after each seed (an overfitting check: 88k questions, "
                        "9x dev and test together)")
    p.add_argument("--no-mlflow", action="store_true", help="only the JSONL metrics file")
    p.add_argument("--run-dir", default="runs/race", help="metrics.jsonl, results.json and each finished seed "
                   "(seeds/: the same command in the same run dir skips those) go here")
    p.set_defaults(func=_finetune_race)
