"""RACE fine-tuning: the paper's multiple-choice head on BERT, the training loop, the median seed
(the command's wiring is in race_cli.py).

Head (paper §5): pooled [CLS] -> dropout -> Linear(h, 1): one score per option, cross-entropy over
the 4. Schedule: 3 epochs, batch/lr 32/2e-5 (336M, 3.9B) or 16/1e-5 (1.3B); warm-up over 6% of
the steps then linear decay, weight decay 0.1, clipping 1.0 (the 2020 Megatron RACE example).

    repro finetune race --race-dir RACE --checkpoint bert.pt --seeds 1 2 3 4 5
    torchrun --nproc-per-node 2 -m repro.cli finetune race --race-dir RACE --checkpoint bert.pt --tp 2
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from repro.eval.race import PAPER_EPOCHS, RaceTensors, accuracy_by_level, format_accuracy
from repro.models.bert import BERT, BertConfig
from repro.parallel.grads import all_reduce_gradients
from repro.parallel.groups import ProcessGroups
from repro.parallel.random import RNGTracker, seed_default_generators
from repro.train.optim import clip_and_step

PAPER_BATCH_LR = {"bert-336m": (32, 2e-5), "bert-1.3b": (16, 1e-5), "bert-3.9b": (32, 2e-5)}


class MultipleChoiceBert(nn.Module):
    """BERT encoder + pooler, then dropout -> Linear(h, 1) per option (replicated on TP ranks)."""

    def __init__(self, cfg: BertConfig, tp_group=None, rng: RNGTracker | None = None, seed: int = 1234):
        super().__init__()
        self.bert = BERT(cfg, tp_group, rng, seed=seed, pretraining_heads=False)
        self.dropout = nn.Dropout(cfg.hidden_dropout)
        self.classifier = nn.Linear(cfg.hidden_size, 1)
        gen = torch.Generator().manual_seed(seed + 1)  # same head on every rank
        with torch.no_grad():
            self.classifier.weight.normal_(0.0, cfg.init_method_std, generator=gen)
            self.classifier.bias.zero_()

    def forward(self, tokens, token_types, padding_mask) -> torch.Tensor:
        b, c, s = tokens.shape  # (b, 4, s): one row per option
        hidden = self.bert.encode(tokens.view(b * c, s), token_types.view(b * c, s), padding_mask.view(b * c, s))
        scores = self.classifier(self.dropout(self.bert.pooled(hidden)))  # (b*4, 1)
        return scores.view(b, c)


@dataclass
class FinetuneOptions:
    """One fine-tuning run (one seed)."""

    epochs: int = PAPER_EPOCHS
    batch_size: int = 32  # questions per global batch (each question is 4 sequences)
    lr: float = 2e-5
    warmup_fraction: float = 0.06
    weight_decay: float = 0.1
    clip_grad: float = 1.0
    seed: int = 1234
    log_every: int = 10
    precision: str = "fp32"  # fp32 | bf16 | fp16: autocast over fp32 weights (fp16 with dynamic loss scaling)


PRECISIONS = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


class SeedStopped(Exception):
    """A stop signal (Slurm's warning before the time limit) was agreed by every rank mid-seed."""

    def __init__(self, seed: int, step: int) -> None:
        super().__init__(f"seed {seed} stopped at step {step}")
        self.seed, self.step = seed, step


class SeedInterrupted(KeyboardInterrupt):
    """Ctrl-C during a seed: the seed, and the last step of it that this launch logged (0: none)."""

    def __init__(self, seed: int, step: int) -> None:
        super().__init__(f"seed {seed} interrupted")
        self.seed, self.step = seed, step


@dataclass
class FinetuneResult:
    """Accuracies (%) per split and level, the training losses per step, and per scored split (dev,
    test) each question's option probabilities (what an ensemble of the seeds averages)."""

    seed: int
    accuracy: dict[str, dict[str, float]] = field(default_factory=dict)
    losses: list[float] = field(default_factory=list)
    probabilities: dict[str, list[list[float]]] = field(default_factory=dict)


def _optimizer(model: nn.Module, opts: FinetuneOptions, steps: int):
    """The pretraining trainer's AdamW groups and schedule: warm-up, then linear decay to 0."""
    from repro.train.config import OptimConfig
    from repro.train.optim import build_optimizer, lr_lambda

    cfg = OptimConfig(lr=opts.lr, min_lr=0.0, lr_warmup_iters=max(1, int(opts.warmup_fraction * steps)),
                      lr_decay_style="linear", weight_decay=opts.weight_decay, clip_grad=opts.clip_grad)
    opt = build_optimizer(model, cfg)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg, steps))


def _rows(data: RaceTensors, index: torch.Tensor, device: torch.device):
    """A batch of `data`'s rows on `device`, every tensor int64 (the split is held compact: INPUT_DTYPES)."""
    rows = (data.tokens[index], data.token_types[index], data.padding_mask[index], data.labels[index])
    return tuple(t.to(device, non_blocking=True).long() for t in rows)


def _device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


@torch.no_grad()
def option_probabilities(model: MultipleChoiceBert, data: RaceTensors, batch_size: int = 16) -> torch.Tensor:
    """Each question's softmax over its options, (questions, options) float32 on the CPU (every rank
    scores the whole split)."""
    model.eval()
    probs = []
    for start in range(0, len(data), batch_size):
        index = torch.arange(start, min(start + batch_size, len(data)))
        tokens, types, mask, _ = _rows(data, index, _device(model))
        probs.append(model(tokens, types, mask).float().softmax(-1).cpu())
    return torch.cat(probs)


def evaluate(model: MultipleChoiceBert, data: RaceTensors, batch_size: int = 16) -> dict[str, float]:
    """Accuracy on middle, high and total (every rank scores the whole split)."""
    return accuracy_by_level(option_probabilities(model, data, batch_size).argmax(-1), data.labels, data.levels)


ENSEMBLE_SPLITS = ("dev", "test")  # the splits whose option probabilities a seed keeps (not --eval-train's)


def ensemble_accuracy(results: list[FinetuneResult], splits: dict[str, RaceTensors]) -> dict[str, dict[str, float]]:
    """Accuracy per split of the seeds' models together (Table 5's 3.9B "5-way ensemble"): each question's
    option probabilities averaged over the seeds that kept them, the most probable option chosen. The
    paper does not say how its five models were combined; averaging probabilities is the usual way.
    {} with fewer than two such seeds."""
    voters = [r for r in results if r.probabilities]
    if len(voters) < 2:
        return {}
    out = {}
    for name in ENSEMBLE_SPLITS:
        if name in splits and all(name in r.probabilities for r in voters):
            mean = torch.tensor([r.probabilities[name] for r in voters]).mean(0)
            out[name] = accuracy_by_level(mean.argmax(-1), splits[name].labels, splits[name].levels)
    return out


def _train_step(model, opt, sched, share, pg: ProcessGroups, clip: float, batch_count: int,
                precision: str = "fp32", scaler=None) -> float:
    """One step on this rank's share of a batch of `batch_count` questions; returns the batch's mean loss.

    Each rank backpropagates its summed loss x dp / batch_count, so the DP average of the gradients is
    the gradient of the whole batch's mean loss however unevenly a short last batch splits (an empty
    share adds zero gradients without running the model). bf16/fp16 run the forward under autocast
    (fp32 weights and optimizer); fp16 scales the loss, and a step whose gradients overflow on any
    rank is skipped on every rank, the lr schedule not advanced."""
    tokens, types, mask, labels = share
    opt.zero_grad(set_to_none=True)
    if len(labels):
        with torch.autocast(tokens.device.type, dtype=PRECISIONS[precision], enabled=precision != "fp32"):
            scores = model(tokens, types, mask)
        loss_sum = F.cross_entropy(scores.float(), labels, reduction="sum")
        (loss_sum * (pg.dp_size / batch_count) * (scaler.scale if scaler else 1.0)).backward()
    else:  # no rows: no forward (its TP peers skip it too), zero gradients for the DP all-reduce
        loss_sum = torch.zeros((), device=labels.device)
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
    all_reduce_gradients(model.parameters(), pg.dp_group)
    params = [p for p in model.parameters() if p.grad is not None]
    _, overflow = clip_and_step(opt, params, clip, pg.tp_group, scaler, pg.world_group)
    if not overflow:
        sched.step()
    if scaler is not None:
        scaler.update(overflow)
    return _sum_over_dp(loss_sum.detach(), pg) / batch_count


def _sum_over_dp(value: torch.Tensor, pg: ProcessGroups) -> float:
    """The sum of `value` over the DP ranks."""
    if pg.dp_size > 1:
        import torch.distributed as dist

        value = value.clone()
        dist.all_reduce(value, group=pg.dp_group)
    return value.item()


def epoch_order(size: int, seed: int, epoch: int) -> torch.Tensor:
    """The shuffled order of `size` training questions in `epoch` of `seed`: a pure function of
    (seed, epoch), hashed jointly (numpy's SeedSequence) into a 63-bit generator seed, so a resumed
    run draws the same order and no two seeds share one (seed + epoch gave seed s's epoch e+1 to seed
    s+1's epoch e)."""
    import numpy as np

    state = np.random.SeedSequence([seed, epoch]).generate_state(1, dtype=np.uint64)[0]
    return torch.randperm(size, generator=torch.Generator().manual_seed(int(state) >> 1))


def finetune(model: MultipleChoiceBert, train: RaceTensors, opts: FinetuneOptions,
             pg: ProcessGroups | None = None, log=None, stop=None) -> list[float]:
    """Train for opts.epochs; each DP rank takes its slice of every (seeded, shuffled) batch. The
    last batch of an epoch may be short (as serially): a rank whose slice is empty adds zero. After
    every step a `stop` (loop.StopSignal) agreed by all ranks raises SeedStopped."""
    from repro.train.optim import DynamicLossScaler

    pg = pg or ProcessGroups.single()
    if opts.batch_size % pg.dp_size:
        raise ValueError(f"batch_size={opts.batch_size} is not divisible by dp={pg.dp_size}: "
                         f"use a multiple of {pg.dp_size}")
    per_rank = opts.batch_size // pg.dp_size
    steps_per_epoch = -(-len(train) // opts.batch_size)
    opt, sched = _optimizer(model, opts, steps_per_epoch * opts.epochs)
    scaler = DynamicLossScaler() if opts.precision == "fp16" else None  # Megatron's defaults
    losses: list[float] = []
    total = steps_per_epoch * opts.epochs
    for epoch in range(opts.epochs):
        order = epoch_order(len(train), opts.seed, epoch)
        for step in range(steps_per_epoch):
            batch = order[step * opts.batch_size:(step + 1) * opts.batch_size]
            mine = batch[pg.dp_rank * per_rank:(pg.dp_rank + 1) * per_rank]  # may be empty
            model.train()
            share = _rows(train, mine, _device(model))
            lr = opt.param_groups[0]["lr"]  # this step's rate (the step advances the schedule)
            losses.append(_train_step(model, opt, sched, share, pg, opts.clip_grad, len(batch),
                                      opts.precision, scaler))
            if len(losses) % opts.log_every == 0 or len(losses) == total:  # the last step too
                extra = {"train/loss_scale": scaler.scale} if scaler else {}
                metrics = {"train/loss": losses[-1], "train/lr": lr, **extra}
                if pg.rank == 0:  # a seed takes hours at the paper's sizes: show it moving
                    print(_loss_line(opts, epoch, len(losses), total, metrics), flush=True)
                if log is not None:
                    log(metrics, len(losses))
            if stop is not None and stop.agreed(_device(model)):
                raise SeedStopped(opts.seed, len(losses))
    return losses


def _loss_line(opts: FinetuneOptions, epoch: int, step: int, total: int, metrics: dict) -> str:
    """The progress line of a step, like the trainer's: seed, epoch, step, loss, lr (loss scale in fp16)."""
    scale = f" | loss scale {metrics['train/loss_scale']:g}" if "train/loss_scale" in metrics else ""
    return (f" seed {opts.seed} | epoch {epoch + 1}/{opts.epochs} | step {step:6d}/{total} | "
            f"loss {metrics['train/loss']:.4f} | lr {metrics['train/lr']:.3e}{scale}")


def run_seed(cfg: BertConfig, state, splits: dict[str, RaceTensors], opts: FinetuneOptions,
             pg: ProcessGroups, log=None, device: torch.device | None = None,
             scored: tuple[str, ...] = ("dev", "test"), stop=None) -> FinetuneResult:
    """Build the model (from a full checkpoint state if given) on `device` (default CPU), fine-tune on
    splits["train"], score the `scored` splits."""
    from repro.models.bert_checkpoint import load_full_state_dict

    device = device or torch.device("cpu")
    seed_default_generators(opts.seed, device)
    model = MultipleChoiceBert(cfg, pg.tp_group, RNGTracker(opts.seed, pg.tp_rank, device), seed=opts.seed)
    if state is not None:
        load_full_state_dict(model.bert, state, skip=("lm_head.", "sop_head."))
    model.to(device)
    result = FinetuneResult(opts.seed)
    result.losses = finetune(model, splits["train"], opts, pg, log, stop)
    for name in scored:
        probs = option_probabilities(model, splits[name])
        result.accuracy[name] = accuracy_by_level(probs.argmax(-1), splits[name].labels, splits[name].levels)
        if name in ENSEMBLE_SPLITS:
            result.probabilities[name] = [[round(p, 6) for p in row] for row in probs.tolist()]
    return result


def median_seed(results: list[FinetuneResult]) -> FinetuneResult:
    """The seed whose dev total accuracy is the median (the paper reports the median of 5 by dev).

    All its numbers come from that one run, so middle, high and total stay consistent; with an even
    count the lower middle is taken, and ties go to the smaller seed."""
    ranked = sorted(results, key=lambda r: (r.accuracy["dev"]["total"], r.seed))
    return ranked[(len(ranked) - 1) // 2]


def print_report(results: list[FinetuneResult]) -> FinetuneResult:
    """Print middle/high/total per split of the median seed and return that seed's result."""
    chosen = median_seed(results)
    label = (f"seed {chosen.seed}, the median by dev total of {len(results)} seeds" if len(results) > 1
             else f"seed {chosen.seed}")
    print(f"RACE accuracy (%), {label}:")
    for split, acc in chosen.accuracy.items():
        print("  " + format_accuracy(split, acc))
    return chosen


def print_ensemble(results: list[FinetuneResult], splits: dict[str, RaceTensors]) -> dict[str, dict[str, float]]:
    """Print and return the seeds' ensemble accuracy per split (ensemble_accuracy; {}: none), naming the
    seeds an earlier run finished before their option probabilities were kept (left out)."""
    ensemble = ensemble_accuracy(results, splits)
    unkept = [r.seed for r in results if not r.probabilities]
    if unkept and len(results) > 1:
        which = f"seed{'s' if len(unkept) > 1 else ''} {' '.join(map(str, unkept))}"
        print(f"ensemble: {which} (finished by an earlier run that kept no option probabilities) "
              f"{'left out' if ensemble else 'leave fewer than two seeds to combine'}; a new --run-dir fine-tunes "
              "every seed again", flush=True)
    if ensemble:
        voters = sum(1 for r in results if r.probabilities)
        print(f"RACE accuracy (%), the {voters} seeds' models together (option probabilities averaged):")
        for split, acc in ensemble.items():
            print("  " + format_accuracy(split, acc))
    return ensemble


def options_for(size: str, batch_size: int | None, lr: float | None, epochs: int, seed: int,
                precision: str = "fp32") -> FinetuneOptions:
    """The paper's batch/lr for a named size, overridden where given."""
    batch, rate = PAPER_BATCH_LR.get(size, (32, 2e-5))
    return replace(FinetuneOptions(), batch_size=batch_size or batch, lr=lr or rate, epochs=epochs, seed=seed,
                   precision=precision)


SEEDS_DIR = "seeds"  # RUN_DIR/seeds/seed_<n>.json: each finished seed, so a restarted job skips it


def seed_path(run_dir: Path, seed: int) -> Path:
    return Path(run_dir) / SEEDS_DIR / f"seed_{seed}.json"


def save_seed(run_dir: Path, result: FinetuneResult, settings: dict) -> Path:
    """A finished seed's accuracies and losses with the settings that produced them (atomically)."""
    from repro.provenance import write_atomic

    path = seed_path(run_dir, result.seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {"seed": result.seed, "accuracy": result.accuracy, "losses": result.losses, "settings": settings,
              "probabilities": result.probabilities}
    write_atomic(path, json.dumps(record).encode())
    return path


def stopped_seed_path(run_dir: Path) -> Path:
    return Path(run_dir) / "seeds" / "stopped.json"


def save_stopped_seed(run_dir: Path, seed: int, step: int, settings: dict) -> None:
    """Where a stop left the unfinished seed, with the settings it ran with: the restart reopens the
    MLflow run and logs its steps after `step` only (those up to it are logged already; the redo
    repeats them from the same seed). A second stop of the seed at an earlier step keeps the later one."""
    from repro.provenance import write_atomic

    previous = _stopped_record(run_dir)
    if previous.get("seed") == seed:
        step = max(step, previous["step"])
    path = stopped_seed_path(run_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, json.dumps({"seed": seed, "step": step, "settings": settings}).encode())


def _stopped_record(run_dir: Path) -> dict:
    """stopped.json's seed, step and settings ({} when there is none, or it is unreadable; settings {}
    for a file written before they were recorded)."""
    try:
        record = json.loads(stopped_seed_path(run_dir).read_text())
        settings = record.get("settings", {})
        return {"seed": int(record["seed"]), "step": int(record["step"]),
                "settings": settings if isinstance(settings, dict) else {}}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {}


def read_stopped_seed(run_dir: Path, settings: dict | None = None) -> dict[int, int]:
    """{seed: steps already logged} of the seed a stop left unfinished ({} when none, or unreadable).
    A seed stopped with other `settings` is a ValueError: the restart would mix two configurations in
    that seed's curve and MLflow run."""
    record = _stopped_record(run_dir)
    if not record:
        return {}
    changed = changed_settings(record["settings"], settings) if settings is not None else []
    if changed:
        raise other_settings_error(stopped_seed_path(run_dir), record["seed"], changed,
                                   f"stopped at step {record['step']}", record["settings"], settings)
    return {record["seed"]: record["step"]}


def other_settings_error(path: Path, seed: int, changed: list[str], state: str = "finished",
                         saved: dict | None = None, settings: dict | None = None) -> ValueError:
    """The refusal of a run dir whose seed `seed` (saved in `path`) ran with other settings; other RACE
    data is named then and now (directory and identity)."""
    data = ""
    if any(k.startswith("race_data.") for k in changed) and saved and settings:
        data = (f"; RACE data then: {saved.get('race_dir', '?')} ({race_data_text(saved['race_data'])}), "
                f"now: {settings.get('race_dir', '?')} ({race_data_text(settings['race_data'])})")
    return ValueError(f"{path} holds seed {seed} ({state}) fine-tuned with other settings ({', '.join(changed)} "
                      f"differ{data}). Fix: give a new --run-dir, or the original inputs and options, or delete "
                      f"{path.parent} to start over")


def race_data_text(identity: dict) -> str:
    """`train 8 files, 32 questions, sha256 1a2b3c4d; dev ...`: a settings' race_data, short."""
    return "; ".join(f"{split} {d.get('files')} files, {d.get('questions')} questions, sha256 "
                     f"{str(d.get('sha256'))[:8]}" for split, d in identity.items() if isinstance(d, dict))


NOT_COMPARED = ("race_dir",)
"""Settings recorded to be named, not compared: RACE data copied elsewhere resumes (race_data decides)."""


def changed_settings(saved: dict, settings: dict, prefix: str = "") -> list[str]:
    """The (dotted) keys whose values differ, among those both have: a seed saved before a key was
    recorded is compared on the keys it has (see finished_seeds' warning)."""
    changed = []
    for key in sorted((saved.keys() & settings.keys()) - set(() if prefix else NOT_COMPARED)):
        old, new = saved[key], settings[key]
        if isinstance(old, dict) and isinstance(new, dict):
            changed += changed_settings(old, new, f"{prefix}{key}.")
        elif old != new:
            changed.append(f"{prefix}{key}")
    return changed


def finished_seeds(run_dir: Path, seeds: list[int], settings: dict) -> dict[int, FinetuneResult]:
    """The seeds of `seeds` that an earlier run in `run_dir` finished with the same settings; a seed
    finished with other settings (another model, checkpoint, vocab, schedule, RACE data) is a ValueError:
    its numbers would be mixed into this run's median. A seed saved before a setting was recorded is
    reused with a warning naming what went unchecked."""
    done = {}
    for seed in seeds:
        path = seed_path(run_dir, seed)
        if not path.is_file():
            continue
        record = json.loads(path.read_text())
        saved = record.get("settings", {})
        changed = changed_settings(saved, settings)
        if changed:
            raise other_settings_error(path, seed, changed, saved=saved, settings=settings)
        _warn_unrecorded(path, seed, sorted(settings.keys() - saved.keys() - set(NOT_COMPARED)))
        done[seed] = FinetuneResult(seed, record["accuracy"], record["losses"], record.get("probabilities", {}))
    return done


def _warn_unrecorded(path: Path, seed: int, keys: list[str]) -> None:
    if keys:
        print(f"warning: {path} was saved before {', '.join(keys)} were recorded: seed {seed} is reused "
              "without checking them. Fix: give a new --run-dir to redo it with these inputs", flush=True)


def write_results(run_dir: Path, results: list[FinetuneResult], chosen: FinetuneResult,
                  ensemble: dict | None = None) -> Path:
    """results.json beside the run's metrics.jsonl (written atomically): the median seed, the seeds'
    ensemble (when two or more kept their probabilities), then every seed."""
    from repro.provenance import write_atomic

    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / "results.json"
    seeds = [{"seed": r.seed, "accuracy": r.accuracy, "final_loss": r.losses[-1]} for r in results]
    record = {"median": chosen.accuracy, "median_seed": chosen.seed, "selected_by": "dev total accuracy",
              **({"ensemble": ensemble} if ensemble else {}), "seeds": seeds}
    write_atomic(path, json.dumps(record, indent=2).encode())
    return path
