"""`repro finetune race` wiring: inputs, model, seeds, MLflow (experiment "bert") and JSONL logging."""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path

from repro.cli import UserError
from repro.eval.race import RaceFormatError, encode_race, load_race, race_dir_from_env
from repro.models.bert import BertConfig

EXPERIMENT = "bert"
POSITIONS = "embeddings.position.weight"
DEFAULT_SIZE = "bert-336m"  # the model built without --checkpoint and --model-config
SHAPE = ("num_layers", "hidden_size", "num_attention_heads", "seq_length")


def _tokenizer(args):
    from repro.data.tokenizers import bert_tokenizer, build_tokenizer

    if args.vocab:
        return bert_tokenizer(Path(args.vocab))
    from repro.data.fetch import data_dir_from_env

    return build_tokenizer("bert", Path(args.data_dir) if args.data_dir else data_dir_from_env())


def model_config(args, vocab_size: int) -> tuple[BertConfig, dict | None]:
    """From the checkpoint (its config), else a YAML model: block, else the named size (random init)."""
    if args.checkpoint:
        from repro.models.bert_checkpoint import read_bert

        cfg, state = read_bert(args.checkpoint)
        if cfg.vocab_size != vocab_size:
            raise UserError(f"checkpoint vocab_size={cfg.vocab_size} but the tokenizer has {vocab_size} "
                            "ids: use the vocab the model was pretrained with (--vocab)")
        return cfg, state
    if args.model_config:
        from omegaconf import OmegaConf

        if not Path(args.model_config).is_file():
            raise UserError(f"--model-config {args.model_config} does not exist. Fix: give a YAML file with "
                            "a model: block, e.g. experiments/bert/tiny_cpu.yaml")
        block = OmegaConf.to_container(OmegaConf.load(args.model_config).get("model", {}))
        known = {f.name for f in fields(BertConfig)}
        cfg = BertConfig(**{k: v for k, v in block.items() if k in known})
    else:
        cfg = BertConfig(**_bert_size(args.size or DEFAULT_SIZE).model_config().__dict__)
    cfg.vocab_size = vocab_size
    print(f"warning: no --checkpoint: fine-tuning a randomly initialised BERT ({cfg.num_layers} layers, "
          f"hidden {cfg.hidden_size})")
    return cfg, None


def _bert_sizes() -> dict:
    from repro.models.sizes import SIZES

    return {n: s for n, s in SIZES.items() if s.family == "bert"}


def _bert_size(name: str):
    """The named BERT size, or a UserError listing them (--size builds the model only without
    --checkpoint and --model-config; otherwise it names the model's size: see size_label)."""
    berts = _bert_sizes()
    if name not in berts:
        raise UserError(f"--size {name} is not a BERT size. Fix: choose one of {', '.join(berts)}, "
                        "or give --checkpoint or --model-config for another model")
    return berts[name]


def _shape(model) -> tuple[int, ...]:
    return tuple(getattr(model, k) for k in SHAPE)


def _shape_text(model) -> str:
    return "L{}-h{}-a{}-s{}".format(*_shape(model))


def size_label(name: str | None, cfg: BertConfig) -> str:
    """The size to log and to pick the paper's batch/lr by: --size if given, else the paper BERT size
    of exactly the model's shape (layers, hidden, heads, positions), else "custom". A paper size
    given for a model of another shape is a UserError (the run would be reported as that size)."""
    sizes = _bert_sizes()
    inferred = next((n for n, s in sizes.items() if _shape(s) == _shape(cfg)), None)
    if name is None:
        return inferred or "custom"
    if name in sizes and name != inferred:
        raise UserError(f"--size {name} is the paper's {_shape_text(sizes[name])}, but the model is "
                        f"{_shape_text(cfg)} ({inferred or 'not a paper size'}). Fix: leave out --size (the "
                        "size is inferred from the model's shape), or give a checkpoint of that size")
    return name


def shorten(cfg: BertConfig, state: dict | None, seq_length: int) -> tuple[BertConfig, dict | None]:
    """The model cut to at most seq_length positions, the checkpoint's position table with it (the
    first rows: the same model on inputs of that length)."""
    if seq_length < cfg.seq_length:
        cfg.seq_length = seq_length
        if state is not None:
            state = {**state, POSITIONS: state[POSITIONS][:seq_length]}
    return cfg, state


def _groups(tp: int):
    from repro.parallel.groups import ProcessGroups, discover_launch_env, init_distributed

    if discover_launch_env().world_size > 1:  # torchrun, or srun with several tasks
        return init_distributed(tp)
    if tp != 1:
        raise UserError(f"--tp {tp} needs {tp} ranks: launch with torchrun --nproc-per-node {tp}")
    return ProcessGroups.single()


def _device():
    """This rank's GPU under a launcher (LOCAL_RANK / SLURM_LOCALID) when CUDA is there, else CPU."""
    from repro.parallel.groups import discover_launch_env

    return discover_launch_env().device()


def run(args) -> int:
    """Fine-tune on train, evaluate dev and test (middle/high/total) for each seed; report the median seed."""
    from repro.eval.race_finetune import write_results
    from repro.train.checkpoint import CheckpointError

    try:
        root = race_dir_from_env(args.race_dir)
        raw = {s: load_race(root, s) for s in ("train", "dev", "test")}
        tok = _tokenizer(args)
        cfg, state = model_config(args, tok.vocab_size)
        size = size_label(args.size, cfg)
        cfg, state = shorten(cfg, state, args.seq_length)
    except (RaceFormatError, FileNotFoundError, ValueError) as err:
        raise UserError(str(err)) from None
    except CheckpointError as err:
        raise UserError(f"--checkpoint {args.checkpoint}: {err} (fine-tuning needs a BERT `repro train` "
                        "run)") from None
    splits = {s: encode_race(q, tok, cfg.seq_length, args.max_qa_tokens) for s, q in raw.items()}
    pg = _groups(args.tp)
    device = _device()
    from repro.tracking.logger import RunLogger
    from repro.provenance import git_sha
    from repro.train.loop import device_name

    params = {"task": "race", "size": size, "device": str(device), "device_type": device.type,
              "device_name": device_name(device),
              "world_size": pg.tp_size * pg.dp_size, "precision": "fp32", "git_sha": git_sha(),
              "checkpoint": args.checkpoint or "", "tp": pg.tp_size,
              "dp": pg.dp_size, "epochs": args.epochs, "seeds": " ".join(map(str, args.seeds)),
              "num_layers": cfg.num_layers, "hidden_size": cfg.hidden_size,
              "num_attention_heads": cfg.num_attention_heads, "seq_length": cfg.seq_length,
              "train_questions": len(splits["train"])}
    # global rank 0 logs, as in training: metrics.jsonl always, MLflow when reachable (else `repro tracking sync`)
    log = RunLogger(args.run_dir, EXPERIMENT, f"race-{size}", params, {"task": "race"},
                    use_mlflow=not args.no_mlflow) if pg.rank == 0 else None
    try:
        chosen = _fine_tune_seeds(args, size, cfg, state, splits, pg, device, log)
    except BaseException:
        if log:
            log.close("FAILED")
        raise
    if log:
        log.close()
        print(f"results: {write_results(Path(args.run_dir), *chosen)}")
    return 0


def _fine_tune_seeds(args, size, cfg, state, splits, pg, device, log):
    """Every seed's fine-tuning (the paper's batch/lr of `size`) and accuracies; (results, median-dev
    seed's result) on rank 0."""
    from repro.eval.race_finetune import options_for, print_report, run_seed

    def record(metrics: dict, step: int = 0) -> None:
        if log:
            log.log_metrics(metrics, step)

    results, scored = [], ("train", "dev", "test") if args.eval_train else ("dev", "test")
    for seed in args.seeds:
        opts = options_for(size, args.batch_size, args.lr, args.epochs, seed)
        res = run_seed(cfg, state, splits, opts, pg,
                       lambda m, i, s=seed: record({f"seed{s}/{k}": v for k, v in m.items()}, i), device, scored)
        record({f"seed{seed}/{sp}/acc_{lv}": v for sp, acc in res.accuracy.items() for lv, v in acc.items()})
        results.append(res)
    if pg.rank != 0:
        return None
    chosen = print_report(results)
    record({f"{sp}/acc_{lv}": v for sp, acc in chosen.accuracy.items() for lv, v in acc.items()})
    record({"median_seed": chosen.seed})
    return results, chosen
