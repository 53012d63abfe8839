"""`repro train` and `repro checkpoint reshard | export-hf`."""

from __future__ import annotations

import os
import re
from pathlib import Path

USER_ERRORS = ("RunConfigError", "LayoutError", "ConfigError", "CheckpointError", "DataError", "DivergedError",
               "DiskFullError")


def train_rank(config_path: str | None, overrides: list[str]) -> dict:
    """Body of one rank: set up groups from the launch environment, then train."""
    from repro.train.signals import recording_stop_signals

    from repro.cli import DiskFullError, disk_full
    from repro.provenance import full_disk_behind

    with recording_stop_signals():  # from before the imports and the process group on
        try:
            return _train_rank(config_path, overrides)
        except (OSError, RuntimeError) as err:  # a rank's full disk (params.json, metrics.jsonl, ...): one line,
            full = full_disk_behind(err)       # also from a rank spawned by --nproc (USER_ERRORS)
            if full is None:
                raise
            raise DiskFullError(disk_full(full)) from None


def _train_rank(config_path: str | None, overrides: list[str]) -> dict:
    from repro.provenance import git_sha

    # the code this process runs is the code it started with: checkpoints, MLflow params and the
    # resume check name it, even if the checkout moves on during the run (git_sha honours the variable)
    os.environ["REPRO_GIT_SHA"] = git_sha()
    import torch
    import torch.distributed as dist

    from repro.parallel.groups import (ParallelDims, backend_for, build_process_groups, discover_launch_env,
                                       init_distributed)
    from repro.train.config import derive, load_config
    from repro.train.loop import train

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    cfg = load_config(config_path, overrides)
    launch = discover_launch_env()
    spawned = dist.is_initialized()  # by run_ranks
    derive(cfg, dist.get_world_size() if spawned else launch.world_size)  # before any group or file
    if spawned:
        return train(cfg, build_process_groups(ParallelDims.from_world(cfg.parallel.tp, dist.get_world_size())),
                     launch.local_rank)
    pg = init_distributed(cfg.parallel.tp, backend=backend_for(cfg.train.device))
    try:
        return train(cfg, pg, launch.local_rank)
    finally:  # its own group ends with it, failed or not (a caller's, above, stays with the caller)
        if dist.is_initialized():
            dist.destroy_process_group()


_ERROR_LINE = re.compile(rf"(?:[\w.]+\.)?(?:{'|'.join(USER_ERRORS)}): ")


def _as_user_error(err: Exception) -> Exception | None:
    """A bad-input error (also one re-raised from a spawned rank) as repro.cli.UserError."""
    from repro.cli import UserError

    if type(err).__name__ in USER_ERRORS:
        return UserError(str(err))
    lines = str(err).strip().splitlines() if isinstance(err, RuntimeError) else []
    starts = [i for i, line in enumerate(lines) if _ERROR_LINE.match(line)]
    if not starts:  # a rank's traceback ends with "module.Class: message" (the message may span lines)
        return None
    first = _ERROR_LINE.sub("", lines[starts[-1]], count=1)
    return UserError("\n".join([first, *lines[starts[-1] + 1:]]))


def _preflight(args, spawn: bool) -> None:
    """Refuse bad arguments, config and resume state in this process before spawning ranks."""
    from repro.cli import UserError
    from repro.train.config import derive, load_config
    from repro.train.engine_state import resume_meta

    if args.config is None and not args.set:
        raise UserError("no config given. Fix: `repro train experiments/demo/gpt_demo.yaml --nproc 2` (a YAML "
                        "under experiments/), with --set KEY=VALUE overrides")
    if args.nproc is not None and args.nproc < 1:
        raise UserError(f"--nproc {args.nproc}: give a positive number of ranks, e.g. --nproc 2 "
                        "(or leave it out under torchrun/srun)")
    if spawn:
        cfg = load_config(args.config, args.set)
        derive(cfg, args.nproc)
        resume_meta(cfg, cfg.parallel.tp, args.nproc)


def _train(args) -> int:
    from contextlib import nullcontext

    from repro.parallel.groups import discover_launch_env, spawns_ranks
    from repro.train.signals import recording_stop_signals

    launch = discover_launch_env()
    spawn = spawns_ranks(launch, args.nproc)
    launched = launch.launched and not spawn
    # this process trains when launched: a stop signal from here on is honoured after the first step
    with recording_stop_signals() if launched else nullcontext():
        return _launch(args, launched, spawn)


def _launch(args, launched: bool, spawn: bool) -> int:
    _preflight(args, spawn)
    if spawn:
        from repro.parallel.groups import default_backend
        from repro.parallel.spawn import run_ranks
        from repro.train.config import load_config

        # NCCL, one GPU per rank, when the ranks train on GPUs (gloo would move every all-reduce
        # through host memory, and every rank would share GPU 0)
        backend = "gloo" if load_config(args.config, args.set).train.device == "cpu" else default_backend()
        # a stop signal sent to this process alone (`kill PID`, a supervisor) reaches the ranks, which
        # checkpoint; their result is this command's
        final = run_ranks(train_rank, args.nproc, args.config, args.set, timeout=args.timeout, backend=backend,
                          forward_signals=True)[0]
    else:
        if not launched:
            from repro.parallel.spawn import free_port

            os.environ.setdefault("MASTER_PORT", str(free_port()))
        final = train_rank(args.config, args.set)
    if final.get("mlflow_run_id"):
        print(f"MLflow run {final['mlflow_run_id']}")
    return 0


def _reshard(args) -> int:
    from repro.train.reshard import reshard

    out = reshard(args.checkpoint, args.out, args.tp)
    print(f"wrote {out} at tp={args.tp}")
    return 0


def _export_tokenizer(cfg, data_dir: str | None):
    """GPT-2 BPE as a transformers tokenizer for an export, or None (a note says why) where the
    vocabulary files are not in the data directory or the model's vocabulary is not GPT-2's."""
    from repro.data.errors import DataError
    from repro.data.fetch import data_dir_from_env
    from repro.models.hf import GPT2_VOCAB_SIZE, hf_gpt2_tokenizer

    if cfg.vocab_size < GPT2_VOCAB_SIZE:
        print(f"note: no tokenizer written: a vocabulary of {cfg.vocab_size} ids is not GPT-2 BPE's")
        return None
    directory = Path(data_dir) if data_dir else data_dir_from_env()
    try:
        return hf_gpt2_tokenizer(directory, cfg.seq_length)
    except (DataError, OSError) as err:
        print(f"note: no tokenizer written ({str(err).splitlines()[0]}); `repro data fetch` or --data-dir "
              "gives it, else load GPT-2's tokenizer beside the model")
        return None


def _export_hf(args) -> int:
    from repro.models.hf import hf_gpt2_for_export
    from repro.train.checkpoint import CheckpointError, model_config, read_meta, resolve
    from repro.train.reshard import MergedModelState, new_directory

    out, ckpt = Path(args.out), resolve(args.checkpoint)
    meta = read_meta(ckpt)
    if meta.get("family", "gpt") != "gpt":
        raise CheckpointError(f"{args.checkpoint} is a {meta['family']} checkpoint: export-hf writes GPT-2 only")
    with new_directory(out) as tmp:  # an occupied --out is refused before loading; a failure leaves nothing
        cfg = model_config(ckpt, meta)
        # merged tensor by tensor into the exported model: one copy of the weights in memory
        hf_gpt2_for_export(MergedModelState(ckpt, meta), cfg).save_pretrained(tmp)
        tokenizer = _export_tokenizer(cfg, args.data_dir)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
    print(f"wrote a transformers.GPT2LMHeadModel{' and its tokenizer' if tokenizer else ''} to {out}")
    return 0


def _import_hf(args) -> int:
    from repro.train.reshard import import_hf

    out = import_hf(args.model, args.out, args.tp, args.make_vocab_size_divisible_by)
    print(f"wrote {out} at tp={args.tp} (model only): evaluate it with `repro eval ... --checkpoint {out}`")
    return 0


def _import_megatron(args) -> int:
    from repro.models.megatron import ImportOptions
    from repro.train.checkpoint import read_meta
    from repro.train.reshard import import_megatron

    options = ImportOptions(args.num_attention_heads, args.vocab_size, args.gelu, args.make_vocab_size_divisible_by)
    out = import_megatron(args.checkpoint, args.out, args.tp, options)
    use = ("fine-tune it with `repro finetune race --checkpoint {}`" if read_meta(out)["family"] == "bert" else
           "evaluate it with `repro eval ... --checkpoint {}`").format(out)
    print(f"wrote {out} at tp={args.tp} (model only): {use}")
    return 0


def _export_megatron(args) -> int:
    from repro.train.reshard import export_megatron

    out = export_megatron(args.checkpoint, args.out, args.tp)
    print(f"wrote {out} at tp={args.tp}: a Megatron-LM release checkpoint (torch format, megatron-core names); "
          "load it with --load, --no-load-optim, --no-load-rng and the model arguments saved in it")
    return 0


def _wrap(fn):
    """Run a command handler, turning bad-input errors into repro.cli.UserError (exit 2)."""
    def run(args) -> int:
        try:
            return fn(args)
        except Exception as err:
            user_error = _as_user_error(err)
            if user_error is None:
                raise
            raise user_error from None
    return run


def _stoppable(fn):
    """A `repro checkpoint` handler in which SIGTERM or SIGUSR1 (scancel, a time limit) is SystemExit, as
    in `repro data prepare`: its temporary output directory is removed, not left half written."""
    from repro.train.signals import exiting_on_stop_signals

    def run(args) -> int:
        with exiting_on_stop_signals():
            return fn(args)
    return _wrap(run)


def register(sub) -> None:
    from repro.cli import positive_seconds

    p = sub.add_parser("train", help="train a model from a YAML config (under torchrun/srun, or --nproc)")
    p.add_argument("config", nargs="?", default=None, help="YAML config (experiments/...)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="dotted override, e.g. --set train.train_iters=10 (repeatable)")
    p.add_argument("--nproc", type=int, default=None, help="spawn N local ranks (unless torchrun/srun started several)")
    p.add_argument("--timeout", type=positive_seconds, default=7200, help="seconds before spawned ranks are killed")
    p.set_defaults(func=_wrap(_train))
    c = sub.add_parser("checkpoint", help="checkpoint tools")
    csub = c.add_subparsers(dest="checkpoint_command", required=True)
    r = csub.add_parser("reshard", help="convert a checkpoint to another TP degree")
    r.add_argument("checkpoint")
    r.add_argument("--tp", type=int, required=True)
    r.add_argument("--out", required=True)
    r.set_defaults(func=_stoppable(_reshard))
    e = csub.add_parser("export-hf", help="merge to TP=1 and write a transformers GPT2LMHeadModel")
    e.add_argument("checkpoint")
    e.add_argument("--out", required=True)
    e.add_argument("--data-dir", default=None, help="where the GPT-2 vocabulary is, written beside the model as "
                   "its tokenizer (default: $REPRO_DATA_DIR or ./data)")
    e.set_defaults(func=_stoppable(_export_hf))
    i = csub.add_parser("import-hf", help="write a transformers GPT2LMHeadModel (e.g. OpenAI's GPT-2) as a "
                        "model-only checkpoint at a TP degree that divides its heads")
    i.add_argument("model", help="a save_pretrained directory, or a hub name (gpt2-medium) where the hub is reachable")
    i.add_argument("--out", required=True, help="a new directory")
    i.add_argument("--tp", type=int, default=1)
    i.add_argument("--make-vocab-size-divisible-by", type=int, default=1024,
                   help="vocab padding unit (1024: the paper's 51,200 rows for GPT-2's 50,257 tokens)")
    i.set_defaults(func=_stoppable(_import_hf))
    m = csub.add_parser("import-megatron", help="write a Megatron-LM GPT or BERT checkpoint (torch format, any "
                        "TP x PP, e.g. NVIDIA's 345M releases) as a model-only checkpoint at a TP degree")
    m.add_argument("checkpoint", help="Megatron-LM's --save directory (with latest_checkpointed_iteration.txt), "
                   "one iteration's folder of mp_rank_* folders, or one model_optim_rng.pt")
    m.add_argument("--out", required=True, help="a new directory")
    m.add_argument("--tp", type=int, default=1)
    m.add_argument("--num-attention-heads", type=int, default=None,
                   help="needed only when the checkpoint saved no training arguments (16 for the 345M releases)")
    m.add_argument("--vocab-size", type=int, default=None,
                   help="the real vocabulary under Megatron's padded rows (default: a GPT's saved vocab_size, as "
                   "export-megatron writes it, else GPT-2's BPE: 50257; BERT's from its saved tokenizer type "
                   "or its padded row count)")
    m.add_argument("--make-vocab-size-divisible-by", type=int, default=1024,
                   help="vocab padding unit here (Megatron's own padded rows are dropped on import)")
    m.add_argument("--gelu", choices=("tanh", "erf"), default=None,
                   help="the GeLU form, where the checkpoint's arguments do not say it (default: from them, else tanh)")
    m.set_defaults(func=_stoppable(_import_megatron))
    x = csub.add_parser("export-megatron", help="write a GPT checkpoint as a Megatron-LM release checkpoint "
                        "(torch format, megatron-core names) at a TP degree")
    x.add_argument("checkpoint")
    x.add_argument("--out", required=True, help="a new directory")
    x.add_argument("--tp", type=int, default=1)
    x.set_defaults(func=_stoppable(_export_megatron))
