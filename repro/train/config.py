"""Typed run configuration: YAML files that compose, dotted overrides, one validate step.

    repro train experiments/gpt2/gpt2_355m.yaml --set train.train_iters=10 --set parallel.tp=2

A YAML may list `include: [other.yaml, ...]` (paths relative to it), merged first; a model may be
named by `model_size: gpt2-355m` (repro.models.sizes), whose numbers fill `model` before the file's
own `model:` keys (and replace the architecture keys of the files it includes, SIZE_SHAPE_KEYS). Unknown keys and wrong types are errors (OmegaConf structured configs).
Derived values (dp, gradient-accumulation steps, padded vocab) are computed in `derive`, never set.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Optional

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from repro.models.config import ModelConfig
from repro.models.sizes import get_size
from repro.parallel.groups import ParallelDims


class RunConfigError(ValueError):
    """A run configuration that cannot be used; the message names the problem and the fix."""


@dataclass
class ParallelConfig:
    tp: int = 1
    """Tensor-parallel degree; dp is derived as world_size / tp."""


@dataclass
class OptimConfig:
    lr: float = 1.5e-4
    """Peak learning rate after warm-up."""
    min_lr: float = 1e-5
    """Floor of the decay."""
    lr_warmup_iters: int = 0
    """Linear warm-up iterations."""
    lr_decay_iters: Optional[int] = None
    """Iterations over which the lr decays to min_lr (default: train_iters)."""
    lr_decay_style: str = "cosine"
    """cosine (GPT-2), linear (BERT) or constant."""
    weight_decay: float = 0.01
    """Decoupled (AdamW) weight decay; none on biases and layer norms."""
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    """Adam betas: not stated in the paper; Megatron's 2019 defaults."""
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    """Global gradient-norm clipping (TP-aware); 0 disables."""
    fused: bool = True
    """torch's fused AdamW kernel (CPU and CUDA; false: its foreach implementation, with the clip
    2.7x slower on a CPU, results/bench/bench_cpu.md part d). It also applies the fp16 unscale and the
    clip: both go in as its gradient divisor, with no pass over the gradients of their own."""
    flat_step: bool = False
    """With precision.params=half and main_grads=fp32 (no ZeRO): step the fp32 masters with one
    compiled kernel per flat main-grad bucket that also rounds them into the half model, instead of
    the fused AdamW and a copy pass (repro.train.flat_adamw; same checkpoints, fp32 rounding apart).
    Compiled on a GPU whatever train.compile says (it needs inductor's Triton there: eagerly it would be
    about ten kernels a run, slower than the fused AdamW), eager on CPU. Off by default until a GPU
    measures it faster (`gpu_bench --optimizer flat`)."""
    override_schedule: bool = False
    """On resume, take the schedule (lr, min_lr, lr_warmup_iters, lr_decay_iters, lr_decay_style) from
    this config instead of refusing a change (Megatron-LM's --override-opt_param-scheduler): the way
    on after a divergence. metrics.jsonl's rows after the checkpoint move to metrics.jsonl.before-*,
    as the steps are redone with other values (MLflow keeps both in the metric's history)."""


@dataclass
class PrecisionConfig:
    precision: str = "fp32"
    """fp32, bf16 or fp16 (fp16 adds dynamic loss scaling)."""
    params: str = "fp32"
    """Dtype of the model's parameters under bf16/fp16: `fp32` (autocast over fp32 weights) or `half`
    (Megatron's recipe: half parameters and activations, fp32 master weights in the optimizer).
    DeepSpeed ZeRO always keeps half parameters with fp32 masters."""
    main_grads: str = "fp32"
    """With params: half, the dtype gradients are accumulated over micro batches and all-reduced
    over DP in: `fp32` (Megatron-LM's main_grad; bucketed all-reduce overlapped with backward) or
    `param` (the 2019 fp16 recipe: torch DDP in the parameter dtype, bf16 sums keep 8 bits). Under
    DeepSpeed ZeRO it sets ZeRO's gradient dtype the same way (repro.train.engine.zero_grad_dtype)."""
    initial_loss_scale: float = 2.0**32
    loss_scale_window: int = 1000
    """Iterations without overflow before the scale doubles (under DeepSpeed ZeRO its first doubling, at the
    start and after each overflow, comes one clean iteration later: DeepSpeed's own rule)."""
    hysteresis: int = 2
    """Overflows before the scale first halves (Megatron-LM's and DeepSpeed's rule: once used up, every
    further overflow halves it; it is restored only when the scale grows)."""
    min_loss_scale: float = 1.0


@dataclass
class TrainConfig:
    micro_batch_size: int = 4
    """Samples per rank per forward pass."""
    global_batch_size: int = 8
    """Samples per optimizer step over all DP ranks; accumulation = global / (micro * dp)."""
    train_iters: int = 100
    seed: int = 1234
    log_interval: int = 10
    save_interval: int = 0
    """Save a checkpoint every N iterations (0: only at the end)."""
    keep_checkpoints: int = 0
    """Keep only the N newest checkpoints, removing older ones once a save is complete (0: keep all, as
    Megatron-LM does). An 8.3B checkpoint with its Adam state is ~100 GB: every 1,000 of 300k
    iterations, all of them would need ~30 TB. A job still reading a removed one (an eval) fails."""
    eval_interval: int = 0
    """Held-out loss every N iterations (0: only at the end)."""
    exit_duration_minutes: float = 0.0
    """Stop with a checkpoint once this many minutes have passed since the trainer started (0: no
    limit; Megatron-LM's --exit-duration-in-mins). The run ends as for Slurm's USR1 warning: checkpoint,
    MLflow run KILLED, RUN_DIR/stopped_by_signal, exit 0, so slurm/launch.sh requeues the job. Set it a
    save's time (the logged save_seconds) plus a step below the job's time limit where the signal's lead
    is too short."""
    eval_iters: int = 10
    """Global batches of held-out loss per evaluation, as in Megatron-LM: eval_iters x global_batch_size
    samples, split over the DP ranks, so every layout evaluates the same samples."""
    zero_stage: int = 0
    """DeepSpeed ZeRO stage for optimizer state (0: plain trainer without DeepSpeed)."""
    zero_overlap_comm: bool = False
    """DeepSpeed's overlap_comm: reduce gradient buckets during backward (what ZeRO-2 on GPUs wants;
    off, DeepSpeed's default, reduces after backward and keeps `repro bench`'s buffer accounting)."""
    device: str = "auto"
    """auto (cuda when available), cpu or cuda."""
    compile: bool = False
    """torch.compile the training objective (model forward and loss; backward through AOTAutograd).
    Plain trainer only (zero_stage 0)."""
    compile_scope: str = "auto"
    """What train.compile compiles. objective: forward and loss as one graph (the most fusion, but
    its backward hands every gradient over at its end, so the DP all-reduce cannot overlap it);
    blocks: each transformer layer on its own (torchtitan's way: a layer's gradients reach the DP
    all-reduce as its backward ends, overlapping the layers still to go; under torch DDP dynamo also
    cuts each layer's graph at DDP's bucket boundaries); auto: blocks when DP > 1 or with activation
    checkpointing and attention dropout (whose checkpoint runs eagerly), else objective."""


@dataclass
class DataConfig:
    train_prefix: str = ""
    """Indexed dataset prefix (PREFIX.bin/.idx) of the training split."""
    valid_prefix: str = ""
    """Held-out split prefix; empty disables evaluation."""
    cache_dir: str = ""
    """Where sample indices are cached (default: beside the data). Shared storage: only rank 0 writes
    them; the other ranks read them when there, else build them in memory (on every start)."""
    vocab_dir: str = ""
    """Data directory holding vocab/ (BERT samples need the WordPiece vocab); default REPRO_DATA_DIR or ./data."""
    num_workers: Optional[int] = None
    """Processes per rank that build samples ahead of the step; 0: in the training process. Default:
    2 for BERT on GPUs (its masking costs ~0.4-0.6 ms a 512-token sample), else 0: a GPT sample is a slice
    of the memory-mapped tokens, cheaper to build than to receive from a worker
    (results/bench/data_loader.md), and on a CPU the workers, forked after the model, would keep its
    pages while training rewrites them (twice the memory)."""


@dataclass
class TrackingConfig:
    experiment: str = "gpt2"
    """MLflow experiment, one per family: scaling, gpt2, bert."""
    paper_ref: str = ""
    """The paper table or figure this run reproduces."""
    enabled: bool = True


@dataclass
class RunConfig:
    name: str = "run"
    family: str = "gpt"
    """gpt (next-token loss) or bert (masked LM + sentence-order prediction)."""
    model_size: str = ""
    """A named size of repro.models.sizes (fills `model`); empty: `model` as given."""
    run_dir: str = ""
    """Checkpoints, metrics.jsonl and logs (default runs/<name>)."""
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)


@dataclass(frozen=True)
class Derived:
    """Values computed from the config and the world size."""

    dp: int
    grad_accum_steps: int
    padded_vocab_size: int


def yaml_error_detail(err: yaml.MarkedYAMLError) -> str:
    """Where and what a YAML syntax error is: `line 2, column 1: found duplicate key ...`."""
    mark = err.problem_mark
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
    return f"{where}{err.problem or err.context}"


def _read_yaml(path: Path) -> dict:
    """One YAML file as a dict; RunConfigError naming the file for anything else."""
    if path.is_dir():
        raise RunConfigError(f"config {path} is a directory: give a YAML file such as "
                             "experiments/tiny/gpt_tiny.yaml")
    try:
        raw = OmegaConf.to_container(OmegaConf.load(path))
    except yaml.MarkedYAMLError as err:
        raise RunConfigError(f"config {path} is not valid YAML ({yaml_error_detail(err)}): "
                             "fix the file's syntax") from None
    except (yaml.YAMLError, OmegaConfBaseException, OSError, UnicodeDecodeError) as err:
        raise RunConfigError(f"config {path} cannot be read ({str(err).splitlines()[0] if str(err) else err!r}): "
                             "give a readable YAML file") from None
    if raw is None or raw == {}:
        raise RunConfigError(f"config {path} is empty (no sections, or only comments): fill it with sections "
                             "such as `model:` and `train:`, or include a config: `include: [gpt_tiny.yaml]` "
                             "(experiments/tiny/gpt_tiny.yaml is one)")
    if not isinstance(raw, dict):
        raise RunConfigError(f"config {path} holds a YAML {type(raw).__name__}, not a mapping: its top level "
                             "must be sections such as `model:` and `train:`")
    return raw


SIZE_SHAPE_KEYS = ("num_layers", "hidden_size", "num_attention_heads", "vocab_size", "num_tokentypes")
"""The architecture a `model_size` defines: an included file's values of these give way to the size
named by the including file (a `model.num_layers` in a shared base.yaml cannot reshape every size)."""


def _load_yaml(path: Path, seen: tuple[Path, ...] = ()) -> dict:
    if not path.exists():
        raise RunConfigError(f"config file {path} does not exist: check the path")
    if path in seen:
        raise RunConfigError(f"config {path} includes itself through {[str(s) for s in seen]}")
    raw = _read_yaml(path)
    includes = raw.pop("include", []) or []
    if not isinstance(includes, list):
        raise RunConfigError(f"config {path}: include must be a list of paths, e.g. include: [base.yaml]")
    merged: dict = {}
    for inc in includes:
        merged = _merge(merged, _load_yaml((path.parent / str(inc)).resolve(), seen + (path,)))
    if raw.get("model_size") and isinstance(merged.get("model"), dict):  # the size named here outranks includes
        merged["model"] = {k: v for k, v in merged["model"].items() if k not in SIZE_SHAPE_KEYS}
    return _merge(merged, raw)


def _merge(base: dict, top: dict) -> dict:
    out = dict(base)
    for key, value in top.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def _size_defaults(raw: dict) -> dict:
    name = raw.get("model_size") or ""
    if not name:
        return raw
    try:
        size = get_size(name)
    except KeyError as err:
        raise RunConfigError(str(err.args[0])) from None
    return _merge({"model": asdict(size.model_config())}, raw)


def _dotted(overrides: list[str]) -> dict:
    """`--set KEY=VALUE` overrides as a nested dict (RunConfigError for one without `=`)."""
    for item in overrides:
        key, sep, _ = item.partition("=")
        if not sep or not key.strip():
            raise RunConfigError(f"--set {item}: expected KEY=VALUE with a dotted key, "
                                 "e.g. --set train.train_iters=10")
    quoted = [f"{item}''" if item.endswith("=") else item for item in overrides]  # KEY= sets ""
    try:
        parsed = OmegaConf.from_dotlist(quoted)
    except OmegaConfBaseException as err:
        raise RunConfigError(f"--set {' '.join(overrides)}: {str(err).splitlines()[0]}: "
                             "give each as KEY=VALUE, e.g. --set train.train_iters=10") from None
    for item in _last_per_key(overrides):
        _check_text_kept(item, parsed)
    return OmegaConf.to_container(parsed)


def _last_per_key(overrides: list[str]) -> list[str]:
    """The last override of each key: of a key given twice the last wins (as in OmegaConf's dotlist and
    most CLIs; slurm/launch.sh's smoke mode sets data.cache_dir before the user's own --set)."""
    last = {item.partition("=")[0].strip(): item for item in overrides}
    return list(last.values())


def _check_text_kept(item: str, parsed) -> None:
    """A value YAML reads as other text than was given (' #' starts a comment, outer spaces go) is an
    error, not a silent change: `run_dir=/runs/gpt2 #2` would train in /runs/gpt2."""
    key, _, raw = item.partition("=")
    value = OmegaConf.select(parsed, key.strip(), default=None)
    if not isinstance(value, str) or value == raw or raw[:1] in ("'", '"'):
        return
    raise RunConfigError(f"--set {item}: YAML reads the value as {value!r} (' #' starts a comment, spaces "
                         f"around it are dropped): quote it, --set \"{key}='{raw}'\", or choose a name "
                         "without them")


def _blame(err: OmegaConfBaseException, path, overrides: list[str]) -> RunConfigError:
    """A type/key error naming the key and where it came from: the `--set` override or the file."""
    key = getattr(err, "full_key", None) or ""
    source = f"{path or 'config'}"
    for item in overrides:
        name = item.partition("=")[0].strip()
        if key and (key == name or key.startswith(name + ".") or name.startswith(key + ".")):
            source = f"--set {item}"
    where = f"{key}: " if key else ""
    return RunConfigError(f"{source}: {where}{str(err).splitlines()[0]} (fix the key or the value's type; "
                          "repro/train/config.py lists every field)")


def load_config(path: str | Path | None, overrides: list[str] = ()) -> RunConfig:
    """Compose YAML (+ includes, + named size) with dotted overrides into a typed RunConfig."""
    raw = _load_yaml(Path(path).resolve()) if path else {}
    dotted = _dotted(list(overrides))
    if dotted.get("model_size") and isinstance(raw.get("model"), dict):  # --set model_size= outranks the file
        raw["model"] = {k: v for k, v in raw["model"].items() if k not in SIZE_SHAPE_KEYS}
    try:
        raw = _size_defaults(_merge(raw, dotted))
        cfg = OmegaConf.merge(OmegaConf.structured(RunConfig), raw)
        run = OmegaConf.to_object(cfg)
    except OmegaConfBaseException as err:
        raise _blame(err, path, list(overrides)) from None
    if not run.run_dir:
        run.run_dir = str(Path("runs") / run.name)
    return run


def _check_counts(cfg: RunConfig, world_size: int) -> None:
    """Counts that must be >= 1 (divisors, loop bounds) and intervals that must be >= 0."""
    if world_size < 1:
        raise RunConfigError(f"world size {world_size}: launch at least one rank (--nproc, --ntasks, srun -n)")
    t, o, p = cfg.train, cfg.optim, cfg.precision
    positive = {"parallel.tp": cfg.parallel.tp, "train.micro_batch_size": t.micro_batch_size,
                "train.global_batch_size": t.global_batch_size, "train.train_iters": t.train_iters,
                "train.log_interval": t.log_interval, "train.eval_iters": t.eval_iters,
                "precision.loss_scale_window": p.loss_scale_window, "precision.hysteresis": p.hysteresis}
    if o.lr_decay_iters is not None:
        positive["optim.lr_decay_iters"] = o.lr_decay_iters
    for key, value in positive.items():
        if value < 1:
            raise RunConfigError(f"{key}={value} must be a positive integer: set {key} >= 1 "
                                 f"(e.g. --set {key}=1)")
    for key, value in {"train.save_interval": t.save_interval, "train.eval_interval": t.eval_interval,
                       "train.keep_checkpoints": t.keep_checkpoints,
                       "optim.lr_warmup_iters": o.lr_warmup_iters,
                       "train.exit_duration_minutes": t.exit_duration_minutes}.items():
        if value < 0:
            raise RunConfigError(f"{key}={value} must be >= 0: set {key}=0 or more")


def _check_optim_values(cfg: RunConfig) -> None:
    """The optimizer's and loss scaler's numbers in their ranges (Megatron-LM asserts the same): a
    min_lr above lr would make the decay climb, a negative weight decay or clip would train silently."""
    o, p = cfg.optim, cfg.precision
    _check_finite(cfg)
    if not o.lr > 0:
        raise RunConfigError(f"optim.lr={o.lr} must be positive: the peak learning rate, e.g. --set optim.lr=1.5e-4")
    if not 0 <= o.min_lr <= o.lr:
        raise RunConfigError(f"optim.min_lr={o.min_lr} must be between 0 and optim.lr={o.lr}: the decay ends at "
                             "min_lr, so above lr it would raise the lr; e.g. --set optim.min_lr=1e-5")
    for key, value in {"optim.adam_beta1": o.adam_beta1, "optim.adam_beta2": o.adam_beta2}.items():
        if not 0 <= value < 1:
            raise RunConfigError(f"{key}={value} must be in [0, 1): e.g. --set {key}=0.9")
    for key, value in {"optim.weight_decay": o.weight_decay, "optim.adam_eps": o.adam_eps,
                       "optim.clip_grad": o.clip_grad}.items():
        if not value >= 0:
            off = " (0: no clipping)" if key == "optim.clip_grad" else ""
            raise RunConfigError(f"{key}={value} must be >= 0: set {key}=0{off} or more")
    if not 0 < p.min_loss_scale <= p.initial_loss_scale:
        raise RunConfigError(f"precision.min_loss_scale={p.min_loss_scale} and precision.initial_loss_scale="
                             f"{p.initial_loss_scale} must satisfy 0 < min_loss_scale <= initial_loss_scale: "
                             "e.g. the defaults, 1 and 2**32")
    if cfg.train.zero_stage and p.precision == "fp16" and math.log2(p.initial_loss_scale) % 1:
        power = round(math.log2(p.initial_loss_scale))
        raise RunConfigError(f"precision.initial_loss_scale={p.initial_loss_scale:g} under ZeRO: DeepSpeed takes the "
                             f"scale as a power of two and would start at 2**{power} = {2.0**power:g}, unlike the "
                             f"plain trainer. Fix: --set precision.initial_loss_scale={2.0**power:g} (or another "
                             "power of two)")


def _check_finite(cfg: RunConfig) -> None:
    """Every float setting of the run a finite number: optim.lr=inf passed `lr > 0` and trained to NaN
    weights, exit 0; weight_decay=inf or adam_eps=inf likewise. (The model's: ModelConfig.validate.)"""
    for section in (cfg.optim, cfg.precision, cfg.train):
        for f in fields(section):
            value = getattr(section, f.name)
            if isinstance(value, float) and not math.isfinite(value):
                key = f"{type(section).__name__.removesuffix('Config').lower()}.{f.name}"
                raise RunConfigError(f"{key}={value} is not a finite number. Fix: --set {key}=<a number> "
                                     f"(the default is {f.default})")


def derive(cfg: RunConfig, world_size: int) -> Derived:
    """Validate the layout and batch arithmetic for `world_size` ranks; compute derived values."""
    _check_counts(cfg, world_size)
    _check_optim_values(cfg)
    dims = ParallelDims.from_world(cfg.parallel.tp, world_size)
    cfg.model.validate(dims.tp)
    t = cfg.train
    per_step = t.micro_batch_size * dims.dp
    if t.micro_batch_size < 1 or t.global_batch_size % per_step:
        raise RunConfigError(
            f"global_batch_size={t.global_batch_size} is not a multiple of micro_batch_size="
            f"{t.micro_batch_size} x dp={dims.dp} = {per_step}: change train.global_batch_size or "
            f"train.micro_batch_size, or launch a different number of ranks")
    if cfg.precision.precision not in ("fp32", "bf16", "fp16"):
        raise RunConfigError(f"precision={cfg.precision.precision!r}: use fp32, bf16 or fp16")
    if cfg.precision.params not in ("fp32", "half"):
        raise RunConfigError(f"precision.params={cfg.precision.params!r}: use fp32 or half")
    if cfg.precision.params == "half" and cfg.precision.precision == "fp32":
        raise RunConfigError("precision.params=half needs precision=bf16 or fp16: set one, or params=fp32")
    if cfg.precision.main_grads not in ("fp32", "param"):
        raise RunConfigError(f"precision.main_grads={cfg.precision.main_grads!r}: use fp32 or param")
    if cfg.optim.flat_step and not (cfg.precision.params == "half" and cfg.precision.main_grads == "fp32"
                                    and not t.zero_stage):
        raise RunConfigError("optim.flat_step steps the fp32 masters of a half model over its fp32 main-grad buckets: "
                             "set precision.params=half and precision.main_grads=fp32 without ZeRO "
                             "(train.zero_stage=0), or optim.flat_step=false")
    if cfg.optim.lr_decay_iters is not None and cfg.optim.lr_decay_iters <= cfg.optim.lr_warmup_iters:
        raise RunConfigError(
            f"optim.lr_decay_iters={cfg.optim.lr_decay_iters} is not above optim.lr_warmup_iters="
            f"{cfg.optim.lr_warmup_iters}: the decay ends at lr_decay_iters, counted from iteration 0, so the lr "
            "would fall to min_lr right after warm-up; set lr_decay_iters > lr_warmup_iters")
    if cfg.optim.lr_decay_style not in ("cosine", "linear", "constant"):
        raise RunConfigError(f"lr_decay_style={cfg.optim.lr_decay_style!r}: use cosine, linear or constant")
    if t.device not in ("auto", "cpu", "cuda"):
        raise RunConfigError(f"train.device={t.device!r}: use auto (cuda when available), cpu or cuda, e.g. "
                             "--set train.device=cuda (each rank takes the GPU of its local rank; no index)")
    if cfg.family not in ("gpt", "bert"):
        raise RunConfigError(f"family={cfg.family!r}: use gpt or bert")
    if cfg.family == "bert" and cfg.model.seq_length < 8:  # [CLS] a [SEP] b [SEP] and room to mask
        raise RunConfigError(f"model.seq_length={cfg.model.seq_length} is too short for a BERT sentence pair: "
                             "set model.seq_length >= 8 (the paper's is 512)")
    if not 0 <= t.seed < 2**31:  # numpy's and torch's generators take it; a negative one raised mid-start
        raise RunConfigError(f"train.seed={t.seed}: use a seed in [0, 2**31), e.g. --set train.seed=1234")
    if cfg.data.num_workers is not None and cfg.data.num_workers < 0:
        raise RunConfigError(f"data.num_workers={cfg.data.num_workers}: use 0 (batches built in the training "
                             "process) or more, e.g. --set data.num_workers=2")
    if t.compile_scope not in ("auto", "objective", "blocks"):
        raise RunConfigError(f"train.compile_scope={t.compile_scope!r}: use auto, objective or blocks")
    if t.compile and t.zero_stage:
        raise RunConfigError("train.compile is for the plain trainer: set train.zero_stage=0 or train.compile=false")
    if t.zero_stage not in (0, 1, 2):
        raise RunConfigError(f"zero_stage={t.zero_stage}: use 0 (no DeepSpeed), 1 or 2")
    if t.zero_overlap_comm and not t.zero_stage:
        raise RunConfigError("train.zero_overlap_comm is DeepSpeed's: set train.zero_stage=1 or 2, or leave it "
                             "false (the plain trainer always overlaps its DP all-reduce with backward)")
    _check_run_dir(cfg.run_dir)
    return Derived(dims.dp, t.global_batch_size // per_step, cfg.model.padded_vocab_size(dims.tp))


def _check_run_dir(run_dir: str) -> None:
    """run_dir is, or can become, a directory: a file there or above it was a NotADirectoryError (or
    FileExistsError) traceback from the tracker after the data had loaded. Nothing is created."""
    from repro.provenance import file_in_the_way

    existing = file_in_the_way(Path(run_dir))
    if existing is not None:
        raise RunConfigError(f"run_dir={run_dir}: {existing} is not a directory (checkpoints, metrics and logs are "
                             "written into a directory). Fix: give a directory path, e.g. --set run_dir=runs/NAME")


def to_yaml(cfg: RunConfig) -> str:
    """The resolved config as YAML (saved with checkpoints and to MLflow)."""
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


# Keys a resumed run may change: its length and reporting, where files live, and knobs that do not
# change the math. With optim.lr_decay_iters unset the decay follows train.train_iters, so a longer
# run also stretches the schedule; set optim.lr_decay_iters to keep it. data.* are locations: the
# files must hold the same data (the position in it is the checkpoint's consumed_samples; the training split's
# size is checked at resume: repro.train.engine_state.check_same_train_data).
RESUME_SAFE = ("name", "run_dir", "train.train_iters", "train.log_interval", "train.save_interval", "train.keep_checkpoints",
               "train.eval_interval", "train.eval_iters", "train.exit_duration_minutes", "train.compile",
               "train.compile_scope", "train.zero_overlap_comm", "optim.flat_step", "optim.override_schedule",
               "model.activation_checkpointing",
               "tracking.", "data.")
SCHEDULE_KEYS = ("optim.lr", "optim.min_lr", "optim.lr_warmup_iters", "optim.lr_decay_iters", "optim.lr_decay_style")
"""What optim.override_schedule lets a resume change."""


def _flat(node: dict, prefix: str = "") -> dict:
    """A nested dict as `section.key -> value`."""
    out = {}
    for key, value in node.items():
        out.update(_flat(value, f"{prefix}{key}.") if isinstance(value, dict) else {f"{prefix}{key}": value})
    return out


def _all_differences(saved_yaml: str, cfg: RunConfig) -> dict[str, tuple]:
    """`key -> (saved, new)` for every setting that differs from a checkpoint's resolved config (keys
    only one side knows, from another code version, are skipped)."""
    saved = _flat(OmegaConf.to_container(OmegaConf.create(saved_yaml)))
    new = _flat(OmegaConf.to_container(OmegaConf.create(to_yaml(cfg))))
    return {key: (saved[key], new[key]) for key in sorted(saved.keys() & new.keys()) if saved[key] != new[key]}


def resume_differences(saved_yaml: str, cfg: RunConfig) -> dict[str, tuple]:
    """The differences a resume may not make: outside RESUME_SAFE, and outside SCHEDULE_KEYS unless
    optim.override_schedule."""
    safe = RESUME_SAFE + (SCHEDULE_KEYS if cfg.optim.override_schedule else ())
    return {key: change for key, change in _all_differences(saved_yaml, cfg).items()
            if not any(key == s or (s.endswith(".") and key.startswith(s)) for s in safe)}


def saved_schedule(saved_yaml: str, cfg: RunConfig) -> tuple[OptimConfig, int]:
    """The optim config and train.train_iters a saved config's lr schedule ran with (SCHEDULE_KEYS and
    train.train_iters from `saved_yaml`, the rest, and any key it lacks, from `cfg`)."""
    saved = _flat(OmegaConf.to_container(OmegaConf.create(saved_yaml)))
    optim = {key.split(".", 1)[1]: saved[key] for key in SCHEDULE_KEYS if key in saved}
    return replace(cfg.optim, **optim), int(saved.get("train.train_iters", cfg.train.train_iters))


def schedule_differences(saved_yaml: str, cfg: RunConfig) -> dict[str, tuple]:
    """`key -> (saved, new)` of the settings of the lr schedule (SCHEDULE_KEYS, train.train_iters) that
    differ from a saved config."""
    keys = SCHEDULE_KEYS + ("train.train_iters",)
    return {key: change for key, change in _all_differences(saved_yaml, cfg).items() if key in keys}


def check_resume(saved_yaml: str, cfg: RunConfig, ckpt: str) -> None:
    """Refuse to resume checkpoint `ckpt` with settings that change the run (RESUME_SAFE aside)."""
    diff = resume_differences(saved_yaml, cfg)
    if diff:
        lines = "".join(f"\n  {key}: {old!r} -> {new!r}" for key, (old, new) in diff.items())
        schedule = (" A new schedule (after a divergence): add --set optim.override_schedule=true." if
                    set(diff) & set(SCHEDULE_KEYS) else "")
        raise RunConfigError(
            f"{ckpt} was saved with a different config:{lines}\nresume with the saved config (drop those "
            f"--set overrides or YAML edits; it is in {cfg.run_dir}/config.yaml), or start a new run with "
            f"--set run_dir=NEW_DIR.{schedule} Safe to change on resume: "
            f"{', '.join(k + '*' if k.endswith('.') else k for k in RESUME_SAFE)}")


def flat_params(cfg: RunConfig) -> dict[str, str]:
    """`section.key -> value` strings for MLflow params."""
    return {key: str(value) for key, value in _flat(asdict(cfg)).items()}
