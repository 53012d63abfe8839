"""Typed run configuration: YAML files that compose, dotted overrides, one validate step.

    repro train experiments/gpt2/gpt2_355m.yaml --set train.train_iters=10 --set parallel.tp=2

A YAML may list `include: [other.yaml, ...]` (paths relative to it), merged first; a model may be
named by `model_size: gpt2-355m` (repro.models.sizes), whose numbers fill `model` before the file's
own `model:` keys. Unknown keys and wrong types are errors (OmegaConf structured configs).
Derived values (dp, gradient-accumulation steps, padded vocab) are computed in `derive`, never set.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

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
    `param` (the 2019 fp16 recipe: torch DDP in the parameter dtype, bf16 sums keep 8 bits)."""
    initial_loss_scale: float = 2.0**32
    loss_scale_window: int = 1000
    """Iterations without overflow before the scale doubles."""
    hysteresis: int = 2
    """Overflows tolerated before the scale is halved."""
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
    eval_interval: int = 0
    """Held-out loss every N iterations (0: only at the end)."""
    eval_iters: int = 10
    """Micro batches of held-out loss per evaluation."""
    zero_stage: int = 0
    """DeepSpeed ZeRO stage for optimizer state (0: plain trainer without DeepSpeed)."""
    device: str = "auto"
    """auto (cuda when available), cpu or cuda."""
    compile: bool = False
    """torch.compile the training objective (model forward and loss; backward through AOTAutograd).
    Plain trainer only (zero_stage 0)."""


@dataclass
class DataConfig:
    train_prefix: str = ""
    """Indexed dataset prefix (PREFIX.bin/.idx) of the training split."""
    valid_prefix: str = ""
    """Held-out split prefix; empty disables evaluation."""
    cache_dir: str = ""
    """Where sample indices are cached (default: beside the data)."""
    vocab_dir: str = ""
    """Data directory holding vocab/ (BERT samples need the WordPiece vocab); default REPRO_DATA_DIR or ./data."""


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


def _load_yaml(path: Path, seen: tuple[Path, ...] = ()) -> dict:
    if not path.exists():
        raise RunConfigError(f"config file {path} does not exist: check the path")
    if path in seen:
        raise RunConfigError(f"config {path} includes itself through {[str(s) for s in seen]}")
    raw = OmegaConf.to_container(OmegaConf.load(path)) or {}
    merged: dict = {}
    for inc in raw.pop("include", []) or []:
        merged = _merge(merged, _load_yaml((path.parent / inc).resolve(), seen + (path,)))
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


def load_config(path: str | Path | None, overrides: list[str] = ()) -> RunConfig:
    """Compose YAML (+ includes, + named size) with dotted overrides into a typed RunConfig."""
    raw = _load_yaml(Path(path).resolve()) if path else {}
    try:
        dotted = OmegaConf.to_container(OmegaConf.from_dotlist(list(overrides)))
        raw = _size_defaults(_merge(raw, dotted))
        cfg = OmegaConf.merge(OmegaConf.structured(RunConfig), raw)
        run = OmegaConf.to_object(cfg)
    except OmegaConfBaseException as err:
        msg = str(err).splitlines()[0]
        raise RunConfigError(f"{path or 'config'}: {msg}. Fix the key or the value's type "
                             "(see repro/train/config.py for every field)") from None
    if not run.run_dir:
        run.run_dir = str(Path("runs") / run.name)
    return run


def derive(cfg: RunConfig, world_size: int) -> Derived:
    """Validate the layout and batch arithmetic for `world_size` ranks; compute derived values."""
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
    if cfg.optim.lr_decay_style not in ("cosine", "linear", "constant"):
        raise RunConfigError(f"lr_decay_style={cfg.optim.lr_decay_style!r}: use cosine, linear or constant")
    if cfg.family not in ("gpt", "bert"):
        raise RunConfigError(f"family={cfg.family!r}: use gpt or bert")
    if t.compile and t.zero_stage:
        raise RunConfigError("train.compile is for the plain trainer: set train.zero_stage=0 or train.compile=false")
    if t.zero_stage not in (0, 1, 2):
        raise RunConfigError(f"zero_stage={t.zero_stage}: use 0 (no DeepSpeed), 1 or 2")
    return Derived(dims.dp, t.global_batch_size // per_step, cfg.model.padded_vocab_size(dims.tp))


def to_yaml(cfg: RunConfig) -> str:
    """The resolved config as YAML (saved with checkpoints and to MLflow)."""
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def flat_params(cfg: RunConfig) -> dict[str, str]:
    """`section.key -> value` strings for MLflow params."""
    out: dict[str, str] = {}

    def walk(prefix: str, node) -> None:
        for key, value in node.items():
            if isinstance(value, dict):
                walk(f"{prefix}{key}.", value)
            else:
                out[f"{prefix}{key}"] = str(value)

    walk("", asdict(cfg))
    return out
