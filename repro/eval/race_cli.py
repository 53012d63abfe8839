"""`repro finetune race` wiring: inputs, model, seeds, MLflow (experiment "bert") and JSONL logging."""

from __future__ import annotations

from collections import ChainMap
from dataclasses import asdict, fields
from pathlib import Path
from typing import Mapping

from repro.cli import UserError
from repro.eval.commands import process_groups
from repro.eval.race import RaceFormatError, check_questions, encode_race, load_race, race_dir_from_env
from repro.eval.race_finetune import SeedInterrupted, SeedStopped
from repro.models.bert import BertConfig

EXPERIMENT = "bert"
POSITIONS = "embeddings.position.weight"
DEFAULT_SIZE = "bert-336m"  # the model built without --checkpoint and --model-config
SHAPE = ("num_layers", "hidden_size", "num_attention_heads", "seq_length")


def _tokenizer(args):
    from repro.data.tokenizers import bert_tokenizer, build_tokenizer

    if args.vocab:
        if not Path(args.vocab).is_file():
            raise UserError(f"--vocab {args.vocab} is not a file. Fix: give the WordPiece vocab.txt the model "
                            "was pretrained with, or leave out --vocab for the data dir's (repro data fetch)")
        return bert_tokenizer(Path(args.vocab))
    from repro.data.fetch import data_dir_from_env

    return build_tokenizer("bert", Path(args.data_dir) if args.data_dir else data_dir_from_env())


def model_config(args, vocab_size: int) -> tuple[BertConfig, Mapping | None]:
    """From the checkpoint (its config), else a YAML model: block, else the named size (random init)."""
    if args.checkpoint:
        from repro.models.bert_checkpoint import read_bert

        cfg, state = read_bert(args.checkpoint)
        if cfg.vocab_size != vocab_size:
            raise UserError(f"checkpoint vocab_size={cfg.vocab_size} but the tokenizer has {vocab_size} "
                            "ids: use the vocab the model was pretrained with (--vocab)")
        return cfg, state
    if args.model_config:
        cfg = yaml_config(args.model_config)
    else:
        if args.size is None and not _cuda():
            raise UserError(f"no --checkpoint or --model-config: the default model is {DEFAULT_SIZE} at sequence "
                            f"length {args.seq_length}, which needs well over 20 GB on a CPU. Fix: give --checkpoint, "
                            "or --model-config experiments/bert/tiny_cpu.yaml for a CPU check (--size "
                            f"{DEFAULT_SIZE} to build it anyway)")
        cfg = BertConfig(**_bert_size(args.size or DEFAULT_SIZE).model_config().__dict__)
    cfg.vocab_size = vocab_size
    print(f"warning: no --checkpoint: fine-tuning a randomly initialised BERT ({cfg.num_layers} layers, "
          f"hidden {cfg.hidden_size})")
    return cfg, None


YAML_FIX = "Fix: give a YAML file with a model: block, e.g. experiments/bert/tiny_cpu.yaml"


def yaml_config(path: str) -> BertConfig:
    """The BertConfig of a YAML file: a `repro train` BERT config's model (its model_size and includes
    applied), else the file's model: block (its BertConfig keys, type-checked); a UserError naming the
    file for a missing or unreadable file, a top level or model: that is no mapping, a bad value."""
    import yaml
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    if not Path(path).is_file():
        raise UserError(f"--model-config {path} does not exist. {YAML_FIX}")
    try:
        raw = OmegaConf.to_container(OmegaConf.load(path))
    except (yaml.YAMLError, OmegaConfBaseException, OSError, UnicodeDecodeError) as err:
        raise UserError(f"--model-config {path} is not readable YAML ({_first_line(err)}). {YAML_FIX}") from None
    if isinstance(raw, dict) and raw.keys() - {"model"}:  # family, model_size, include, train, ...
        return _training_config_model(path)
    block = raw.get("model", {}) if isinstance(raw, dict) else raw
    if not isinstance(block, dict):
        what = "its model: block" if isinstance(raw, dict) else "its top level"
        kind = "empty" if block is None else f"a YAML {type(block).__name__}"
        raise UserError(f"--model-config {path}: {what} is {kind}, not a mapping of model settings. {YAML_FIX}")
    known = {f.name for f in fields(BertConfig)}
    try:
        merged = OmegaConf.merge(OmegaConf.structured(BertConfig), {k: v for k, v in block.items() if k in known})
        return OmegaConf.to_object(merged)
    except OmegaConfBaseException as err:
        key = getattr(err, "full_key", None)
        where = f"model.{key}: " if key else ""
        raise UserError(f"--model-config {path}: {where}{_first_line(err)}. {YAML_FIX}") from None


def _training_config_model(path: str) -> BertConfig:
    """The model of a `repro train` config (experiments/bert/*.yaml), composed as training composes it
    (includes, model_size); a UserError for a config that is not BERT's (`family: bert`)."""
    from repro.models.bert import as_bert_config
    from repro.train.config import RunConfigError, load_config

    try:
        run = load_config(path)
    except RunConfigError as err:
        raise UserError(f"--model-config {err}") from None
    if run.family != "bert":
        raise UserError(f"--model-config {path} is a {run.family} config (family: {run.family}): RACE fine-tunes "
                        f"a BERT. {YAML_FIX}, or experiments/bert/bert_336m.yaml")
    return as_bert_config(run.model)


def _first_line(err: Exception) -> str:
    """An error's first line; for a YAML syntax error, where it is and what is wrong."""
    mark = getattr(err, "problem_mark", None)
    if mark is not None:
        return f"line {mark.line + 1}, column {mark.column + 1}: {err.problem or err.context}"
    return str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _bert_sizes() -> dict:
    from repro.models.sizes import SIZES

    return {n: s for n, s in SIZES.items() if s.family == "bert"}


def canonical_size(name: str) -> str:
    """A paper BERT size matched case-insensitively, as the paper names it (`bert-1.3B` -> `bert-1.3b`);
    any other name as given."""
    return next((n for n in _bert_sizes() if n.lower() == name.lower()), name)


def _bert_size(name: str):
    """The named BERT size (any case), or a UserError listing them (--size builds the model only without
    --checkpoint and --model-config; otherwise it names the model's size: see size_label)."""
    berts, name = _bert_sizes(), canonical_size(name)
    if name not in berts:
        raise UserError(f"--size {name} is not a BERT size. Fix: choose one of {', '.join(berts)}, "
                        "or give --checkpoint or --model-config for another model")
    return berts[name]


def _shape(model) -> tuple[int, ...]:
    return tuple(getattr(model, k) for k in SHAPE)


def _shape_text(model) -> str:
    return "L{}-h{}-a{}-s{}".format(*_shape(model))


def size_label(name: str | None, cfg: BertConfig) -> str:
    """The size to log and to pick the paper's batch/lr by: --size if given (a paper size in any case,
    named as the paper does), else the paper BERT size of exactly the model's shape (layers, hidden,
    heads, positions), else "custom". A UserError for a paper size given for a model of another shape
    (the run would be reported as that size) and for an unknown name that would run at the default
    batch/lr in its place (see _check_label)."""
    sizes = _bert_sizes()
    inferred = next((n for n, s in sizes.items() if _shape(s) == _shape(cfg)), None)
    if name is None:
        return inferred or "custom"
    name = canonical_size(name)
    if name in sizes and name != inferred:
        raise UserError(f"--size {name} is the paper's {_shape_text(sizes[name])}, but the model is "
                        f"{_shape_text(cfg)} ({inferred or 'not a paper size'}). Fix: leave out --size (the "
                        "size is inferred from the model's shape), or give a checkpoint of that size")
    if name not in sizes:
        _check_label(name, inferred, cfg)
    return name


TYPO_CUTOFF = 0.75  # difflib similarity: bert-13b, bert-1.3, bert1.3b are typos; bert-tiny-cpu, bert-base are not


def _check_label(name: str, inferred: str | None, cfg: BertConfig) -> None:
    """A UserError for an unknown --size that would run at the default batch/lr under a wrong name: a
    paper size mistyped (e.g. bert-13b), or any label for a model of a paper shape. Other labels name
    models of other shapes (`smoke` in slurm/race_finetune.sh, `bert-tiny-cpu` in scripts/cpu_results.sh)."""
    import difflib

    sizes = _bert_sizes()
    if inferred:
        raise UserError(f"--size {name} is not a BERT size, and the model is the paper's {inferred} "
                        f"({_shape_text(cfg)}). Fix: leave out --size, or give --size {inferred}")
    close = difflib.get_close_matches(name.lower(), list(sizes), 1, TYPO_CUTOFF)
    if close:
        raise UserError(f"--size {name} is not a BERT size (did you mean {close[0]}?). Fix: give one of "
                        f"{', '.join(sizes)} (any case) for a model of that shape, or leave out --size")


def shorten(cfg: BertConfig, state: Mapping | None, seq_length: int) -> tuple[BertConfig, Mapping | None]:
    """The model cut to at most seq_length positions, the checkpoint's position table with it (the
    first rows: the same model on inputs of that length)."""
    if seq_length < cfg.seq_length:
        cfg.seq_length = seq_length
        if state is not None:
            state = ChainMap({POSITIONS: state[POSITIONS][:seq_length]}, state)  # the rest read lazily
    return cfg, state


BYTES_PER_PARAM = 16  # fp32 weights, gradients and Adam's two moments (autocast keeps fp32 weights)
MEMORY_MARGIN = 1.25  # activations (4 sequences per question), the CUDA context, fragmentation


def finetune_bytes_per_rank(cfg: BertConfig, tp: int) -> float:
    """Weights, gradients and Adam state of one rank at this TP degree (the planner's parameter count;
    the MLM/SOP heads it includes are not built for fine-tuning: a slight over-count)."""
    from repro.perf.memory import bert_params_per_rank

    return BYTES_PER_PARAM * bert_params_per_rank(cfg, tp)


def choose_tp(cfg: BertConfig, world: int, device_bytes: float | None) -> int:
    """--tp when not given: 1 on CPU; on a GPU the smallest degree that divides the heads and the world
    and leaves `finetune_bytes_per_rank` x MEMORY_MARGIN within the device (3.9B on a 32 GB V100: 4)."""
    if device_bytes is None:
        return 1
    fits = [tp for tp in range(1, world + 1) if world % tp == 0 and cfg.num_attention_heads % tp == 0
            and finetune_bytes_per_rank(cfg, tp) * MEMORY_MARGIN <= device_bytes]
    if not fits:
        need = finetune_bytes_per_rank(cfg, 1) * MEMORY_MARGIN / 2**30
        raise UserError(f"fine-tuning this BERT needs about {need:.0f} GiB at TP=1 ({BYTES_PER_PARAM} bytes a "
                        f"parameter with a {MEMORY_MARGIN}x margin), more than {world} GPU(s) of "
                        f"{device_bytes / 2**30:.0f} GiB hold at any TP degree dividing its "
                        f"{cfg.num_attention_heads} heads. Fix: launch more ranks, or give --tp explicitly")
    return fits[0]


def _tp(args, cfg: BertConfig) -> int:
    """--tp, else `choose_tp` for this launch's world size and device (printed on rank 0)."""
    from repro.parallel.groups import discover_launch_env

    if args.tp is not None:
        return args.tp
    env = discover_launch_env()
    device = env.device()
    memory = torch_device_bytes(device) if device.type == "cuda" else None
    tp = choose_tp(cfg, env.world_size, memory)
    if env.rank == 0 and memory is not None:
        print(f"--tp not given: TP={tp}, the smallest that fits "
              f"{finetune_bytes_per_rank(cfg, tp) * MEMORY_MARGIN / 2**30:.1f} GiB per GPU "
              f"(weights, gradients, Adam, {MEMORY_MARGIN}x margin) in {memory / 2**30:.0f} GiB", flush=True)
    return tp


def torch_device_bytes(device) -> float:
    import torch

    return float(torch.cuda.get_device_properties(device).total_memory)


def _device():
    """This rank's GPU under a launcher (LOCAL_RANK / SLURM_LOCALID) when CUDA is there, else CPU."""
    from repro.parallel.groups import discover_launch_env

    return discover_launch_env().device()


RECIPE = ("batch_size", "lr", "max_qa_tokens", "warmup_fraction", "weight_decay", "clip_grad")
"""The settings logged as params too: a run off the paper's batch/lr is told apart (repro/analysis/bert.py)."""


def _settings(args, size: str, cfg: BertConfig, train_questions: int, identity: dict, data: dict) -> dict:
    """What a seed's numbers depend on besides the seed (a restart skips only seeds finished with these):
    the model's full config, the checkpoint (its path and `identity`), the vocab, the schedule, the data
    (`data`: race_dir, named in a refusal but not compared, and race_data: race_data_identity)."""
    from repro.eval.race_finetune import options_for

    opts = options_for(size, args.batch_size, args.lr, args.epochs, 0, args.precision)
    return {"checkpoint": str(args.checkpoint or ""), "checkpoint_identity": identity, "model": asdict(cfg),
            "vocab": str(args.vocab or ""), "size": size, "epochs": opts.epochs,
            "batch_size": opts.batch_size, "lr": opts.lr, "warmup_fraction": opts.warmup_fraction,
            "weight_decay": opts.weight_decay, "clip_grad": opts.clip_grad, "precision": opts.precision,
            "seq_length": cfg.seq_length, "max_qa_tokens": args.max_qa_tokens,
            "train_questions": train_questions, "eval_train": bool(args.eval_train), **data}


def race_data_identity(raw: dict[str, list]) -> dict[str, dict]:
    """Per split: files (with questions), questions and a sha256 of what the loader read, in its order
    (each file's article, then each question's level, text, options and answer). Other RACE data, or its
    files edited, differ; a copy elsewhere (cp without -p: other paths and mtimes) does not. Hashing the
    parsed questions reads no file again: about as much as the 100 MB the loading parsed."""
    import hashlib
    import json

    out = {}
    for split, questions in raw.items():
        digest, source, files = hashlib.sha256(), None, 0
        for q in questions:
            if q.source != source:
                source, files = q.source, files + 1
                digest.update(json.dumps(["article", q.article]).encode())
            digest.update(json.dumps([q.level, q.question, q.options, q.label]).encode())
        out[split] = {"files": files, "questions": len(questions), "sha256": digest.hexdigest()}
    return out


MIN_SEQ_LENGTH = 8  # [CLS] qa [SEP] article [SEP] with a few tokens of each
MAX_SEED = 2**63 - 1  # torch's generators take a 64-bit seed; the model adds offsets to it


def check_numbers(args) -> None:
    """A UserError for a count or rate that cannot run (0 epochs crashed after the last seed; a short
    --seq-length raised a traceback; a negative --max-qa-tokens cut tokens off the end; --batch-size 0
    and --lr 0 silently became the paper's values), for bad --seeds and for a --run-dir under a file."""
    limits = [("--epochs", args.epochs, 1, "e.g. --epochs 3 (paper)"),
              ("--seq-length", args.seq_length, MIN_SEQ_LENGTH, "e.g. --seq-length 512"),
              ("--max-qa-tokens", args.max_qa_tokens, 1, "e.g. --max-qa-tokens 128 (paper)"),
              ("--batch-size", args.batch_size, 1, "or leave it out for the paper's")]
    for option, value, least, hint in limits:
        if value is not None and value < least:
            raise UserError(f"{option} {value} must be at least {least}. Fix: {hint}")
    if args.lr is not None and not 0 < args.lr < float("inf"):  # (inf trained to NaN and scored it)
        raise UserError(f"--lr {args.lr} must be a positive, finite number. Fix: e.g. --lr 2e-5, or leave it out "
                        "for the paper's")
    check_seeds(args.seeds)
    check_run_dir(Path(args.run_dir))


def check_seeds(seeds: list[int]) -> None:
    """A UserError for a seed out of 0..MAX_SEED (an OverflowError traceback after the data was loaded)
    or given twice (counted as two seeds in the median, the same run twice)."""
    bad = [s for s in seeds if not 0 <= s <= MAX_SEED]
    if bad:
        raise UserError(f"--seeds {bad[0]} is out of range: a seed is 0 to {MAX_SEED} (2**63-1). "
                        "Fix: e.g. --seeds 1234 1235 1236 1237 1238 (the default)")
    repeated = sorted({s for s in seeds if seeds.count(s) > 1})
    if repeated:
        raise UserError(f"--seeds repeats {' '.join(map(str, repeated))}: each seed is one run of the median. "
                        "Fix: give each seed once, e.g. --seeds 1234 1235 1236 1237 1238 (the default)")


def check_run_dir(run_dir: Path) -> None:
    """A UserError for a --run-dir that is, or is under, something other than a directory (it was a
    NotADirectoryError traceback after the data was loaded); nothing is created."""
    from repro.provenance import file_in_the_way

    existing = file_in_the_way(run_dir)
    if existing is not None:
        raise UserError(f"--run-dir {run_dir}: {existing} is not a directory (the run's results are written "
                        "into a directory). Fix: give a directory path, e.g. --run-dir runs/race")


def check_layout(batch_size: int, cfg: BertConfig, pg, given: bool) -> None:
    """A UserError, before the run starts, for a model the TP ranks cannot split (ModelConfig.validate)
    or a batch (`given` by --batch-size, else the paper's) the DP ranks cannot split evenly."""
    from repro.models.config import ConfigError

    tp, dp = pg.tp_size, pg.dp_size
    try:
        cfg.validate(tp)
    except ConfigError as err:
        raise UserError(f"{err}. Fix: give --tp a divisor of the heads (and of the ranks), or leave it out") from None
    if batch_size % dp:
        what = f"--batch-size {batch_size}" if given else f"the batch size {batch_size} (the paper's)"
        raise UserError(f"{what} is not divisible by the {dp} data-parallel ranks ({tp * dp} ranks / tp={tp}). "
                        f"Fix: give a --batch-size that is a multiple of {dp}, or launch ranks to match")


def run(args) -> int:
    """Fine-tune on train, evaluate dev and test (middle/high/total) for each seed; report the median seed.

    Each finished seed is saved in RUN_DIR/seeds/, and a run in the same directory with the same
    settings skips it (a requeued Slurm job). A stop signal (TERM, USR1: Slurm's warning before the time
    limit), agreed by all ranks after a step, ends the current seed unfinished: RUN_DIR/stopped_by_signal,
    exit 0, so slurm/launch.sh requeues the job; the restart redoes that seed from its start. Ctrl-C ends
    the run as a stop does, at once: the MLflow run KILLED (as training's), exit 130 (repro.cli)."""
    from repro.eval.race_finetune import finished_seeds, race_data_text, read_stopped_seed, write_results
    from repro.models.bert_checkpoint import checkpoint_identity
    from repro.train.checkpoint import CheckpointError

    check_numbers(args)
    try:
        root = race_dir_from_env(args.race_dir)
        raw = {s: load_race(root, s) for s in ("train", "dev", "test")}
        tok = _tokenizer(args)
        cfg, state = model_config(args, tok.vocab_size)
        identity = checkpoint_identity(args.checkpoint) if args.checkpoint else {}
        size = size_label(args.size, cfg)
        cfg, state = shorten(cfg, state, args.seq_length)
        check_questions(root, raw)
        splits = {s: encode_race(q, tok, cfg.seq_length, args.max_qa_tokens) for s, q in raw.items()}
    except (RaceFormatError, FileNotFoundError, ValueError) as err:
        raise UserError(str(err)) from None
    except CheckpointError as err:
        hint = "" if "Fix:" in str(err) else " (fine-tuning needs a BERT `repro train` run)"
        raise UserError(f"--checkpoint {args.checkpoint}: {err}{hint}") from None
    data = {"race_dir": str(root.resolve()), "race_data": race_data_identity(raw)}
    settings = _settings(args, size, cfg, len(splits["train"]), identity, data)
    try:
        done = finished_seeds(Path(args.run_dir), args.seeds, settings)
        logged = read_stopped_seed(Path(args.run_dir), settings)  # launch.sh removes stopped_by_signal first
    except ValueError as err:
        raise UserError(str(err)) from None
    pg = process_groups(_tp(args, cfg), "finetune race ...")
    check_layout(settings["batch_size"], cfg, pg, given=args.batch_size is not None)
    if args.seq_length > cfg.seq_length and pg.rank == 0:
        print(f"--seq-length {args.seq_length}: the model has {cfg.seq_length} positions, so inputs are "
              f"{cfg.seq_length} tokens (the results record seq_length {cfg.seq_length})", flush=True)
    device = _device()
    from repro.tracking.logger import RunLogger
    from repro.tracking.run_dir import recorded_run_id
    from repro.provenance import git_sha
    from repro.train.loop import StopSignal, device_name

    params = {"task": "race", "size": size, "device": str(device), "device_type": device.type,
              "device_name": device_name(device),
              "world_size": pg.tp_size * pg.dp_size, "precision": args.precision, "git_sha": git_sha(),
              "checkpoint": args.checkpoint or "", "tp": pg.tp_size,
              "dp": pg.dp_size, "epochs": args.epochs, "seeds": " ".join(map(str, args.seeds)),
              "num_layers": cfg.num_layers, "hidden_size": cfg.hidden_size,
              "num_attention_heads": cfg.num_attention_heads, "seq_length": cfg.seq_length,
              "train_questions": len(splits["train"]), **{k: settings[k] for k in RECIPE},
              "race_dir": data["race_dir"], "race_data": race_data_text(data["race_data"])}
    pretrained = _pretraining(args.checkpoint)
    params.update({k: v for k, v in pretrained.items() if k != "training_run_id"})  # iteration or import source
    tags = {"task": "race", **{k: v for k, v in pretrained.items() if k == "training_run_id"}}
    # global rank 0 logs, as in training: metrics.jsonl always, MLflow when reachable (else `repro tracking sync`)
    continued = bool(done) or bool(logged)
    log = RunLogger(args.run_dir, EXPERIMENT, f"race-{size}", params, tags,
                    use_mlflow=not args.no_mlflow, starts_over=not continued,
                    resume_run_id=recorded_run_id(args.run_dir) if continued else None) if pg.rank == 0 else None
    if log and continued:  # rows an earlier launch could not send (killed with rows queued, or offline)
        log.catch_up()
    try:
        with StopSignal(pg.world_group) as stop:
            outcome = _fine_tune_seeds(args, size, cfg, state, splits, pg, device, log, done, settings, stop, logged)
    except SeedStopped as stopped:
        return _stopped(args, stopped, pg, log, settings)
    except KeyboardInterrupt as interrupt:  # (repro.cli says so and exits 130)
        _interrupted(args, interrupt, pg, log, settings)
        raise
    except BaseException:
        if log:
            log.close("FAILED")
        raise
    if log:
        log.log_params({"median_seed": str(outcome[1].seed)})  # an identifier: exact, not a float metric
        log.close()
        print(f"results: {write_results(Path(args.run_dir), *outcome)}")
    return 0


def _pretraining(checkpoint: str | None) -> dict[str, str]:
    """The pretraining checkpoint's iteration and training run id (the BERT table joins RACE runs to
    the MLM perplexity of the run they fine-tuned); {} without a `repro train` checkpoint."""
    from repro.train.checkpoint import training_provenance

    return training_provenance(checkpoint) if checkpoint else {}


GOES_ON = "finished seeds are in {}, and the same command in the same --run-dir goes on from the next unfinished seed"


def _stopped(args, stopped, pg, log, settings: dict) -> int:
    """The agreed stop: the marker slurm/launch.sh requeues on, the seed's step and `settings` (a restart
    with others is refused), the MLflow run KILLED (a restart reopens it)."""
    if pg.rank == 0:
        print(f"stopping: {stopped} (a stop signal); {GOES_ON.format(Path(args.run_dir) / 'seeds')}", flush=True)
        _end_killed(Path(args.run_dir), stopped.seed, stopped.step, log, settings)
    return 0


def _interrupted(args, interrupt: KeyboardInterrupt, pg, log, settings: dict) -> None:
    """Ctrl-C, wherever it landed: the run ended as a stop ends it (as training's Ctrl-C is), not FAILED;
    the interrupted seed's logged steps noted (SeedInterrupted), so a restart does not log them twice.
    A second Ctrl-C waits until this is done."""
    from repro.train.signals import stop_signals_deferred

    if pg.rank != 0:
        return
    seed, step = getattr(interrupt, "seed", None), getattr(interrupt, "step", 0)
    with stop_signals_deferred():
        _end_killed(Path(args.run_dir), seed, step, log, settings)
    what = f"seed {seed}" if seed is not None else "the run"
    print(f"interrupted {what}; {GOES_ON.format(Path(args.run_dir) / 'seeds')}", flush=True)


def _end_killed(run_dir: Path, seed: int | None, step: int, log, settings: dict) -> None:
    """The unfinished seed's last logged step (if any) and `settings` in seeds/stopped.json, the stop
    marker, the MLflow run (and run_status) KILLED."""
    from repro.eval.race_finetune import save_stopped_seed
    from repro.provenance import write_atomic
    from repro.tracking.run_dir import STOP_MARKER

    if seed is not None and step:
        save_stopped_seed(run_dir, seed, step, settings)
    write_atomic(run_dir / STOP_MARKER, (f"race seed {seed}" if seed is not None else "race").encode())
    if log:
        log.close("KILLED")


def _fine_tune_seeds(args, size, cfg, state, splits, pg, device, log, done, settings, stop, logged=None):
    """Every seed's fine-tuning (the paper's batch/lr of `size`) and accuracies, but those in `done`
    (finished by an earlier run in the run dir); (results, median-dev seed's result, the seeds' ensemble's
    accuracies) on rank 0. A seed
    in `logged` (seed: steps) is one a stop or Ctrl-C interrupted: its steps up to that one are not logged again."""
    from repro.eval.race_finetune import (options_for, print_ensemble, print_report, run_seed, save_seed,
                                         stopped_seed_path)

    logged = logged or {}
    reached: dict[int, int] = {}  # seed -> its last step this launch logged (where a Ctrl-C leaves it)

    def record(metrics: dict, step: int = 0) -> None:
        if log:
            log.log_metrics(metrics, step)

    def record_step(seed: int, metrics: dict, step: int) -> None:
        if step > logged.get(seed, 0):
            record({f"seed{seed}/{k}": v for k, v in metrics.items()}, step)
            reached[seed] = step

    results, scored = [], ("train", "dev", "test") if args.eval_train else ("dev", "test")
    for seed in args.seeds:
        if seed in done:
            if pg.rank == 0:
                print(f"seed {seed}: finished by an earlier run in {args.run_dir}, not repeated", flush=True)
            results.append(done[seed])
            continue
        opts = options_for(size, args.batch_size, args.lr, args.epochs, seed, args.precision)
        try:
            res = run_seed(cfg, state, splits, opts, pg, lambda m, i, s=seed: record_step(s, m, i), device, scored,
                           stop)
            record({f"seed{seed}/{sp}/acc_{lv}": v for sp, acc in res.accuracy.items() for lv, v in acc.items()})
            if pg.rank == 0:
                save_seed(Path(args.run_dir), res, settings)
                stopped_seed_path(Path(args.run_dir)).unlink(missing_ok=True)
        except KeyboardInterrupt:
            raise SeedInterrupted(seed, reached.get(seed, 0)) from None
        results.append(res)
    if pg.rank != 0:
        return None
    chosen = print_report(results)
    record({f"{sp}/acc_{lv}": v for sp, acc in chosen.accuracy.items() for lv, v in acc.items()})
    ensemble = print_ensemble(results, splits)
    if ensemble:
        record({"ensemble/seeds": sum(1 for r in results if r.probabilities),
                **{f"ensemble/{sp}/acc_{lv}": v for sp, acc in ensemble.items() for lv, v in acc.items()}})
    return results, chosen, ensemble
