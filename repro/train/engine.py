"""The pieces a training step needs: model, optimizer, schedule, scaler, and the DP wrapper.

Plain trainer (zero_stage 0): torch DDP over the DP group (bucketed all-reduce overlapped with
backward; for a half model with fp32 main grads, `MainGrads` does the same in fp32), torch AdamW,
TP-aware clipping, our fp16 loss scaler. ZeRO (stage 1/2): DeepSpeed owns the optimizer state
sharding, gradient averaging, clipping and loss scaling; it learns the TP/DP layout from the
ProcessGroups object passed as `mpu`.
"""

from __future__ import annotations

import os
from contextlib import nullcontext
from dataclasses import dataclass

import torch
from torch.nn.parallel import DistributedDataParallel

from repro.parallel.groups import ProcessGroups, cuda_index
from repro.parallel.random import RNGTracker, seed_default_generators
from repro.train.config import Derived, RunConfig
from repro.train.flat_adamw import FlatMasterAdamW
from repro.train.main_grads import MainGrads
from repro.train.mixed_precision import MasterWeights
from repro.train.objectives import build_model, build_objective
from repro.train.optim import DynamicLossScaler, build_optimizer, lr_lambda
from repro.versions import WHOLE_TP_GRAPH_TORCH, release

HALF = {"bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class Engine:
    """Everything stateful about training on one rank."""

    cfg: RunConfig
    derived: Derived
    pg: ProcessGroups
    device: torch.device
    model: torch.nn.Module  # the bare GPT or BERT (checkpoints save its state dict)
    objective: torch.nn.Module  # forward(batch) -> (scalar loss, detached parts), around the model
    wrapped: torch.nn.Module  # DDP / DeepSpeed engine around the objective, or the objective
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    scaler: DynamicLossScaler | None
    rng: RNGTracker
    deepspeed: bool = False
    masters: MasterWeights | None = None
    """fp32 master weights of a half-precision model (precision.params: half), else None."""
    main_grads: MainGrads | None = None
    """fp32 gradient accumulation and DP all-reduce of a half model (precision.main_grads: fp32)."""
    flat_step: FlatMasterAdamW | None = None
    """The masters' AdamW step over the main-grad buckets, rounding into the model (optim.flat_step)."""

    def autocast(self):
        """Autocast for bf16/fp16 over fp32 parameters (a half model and DeepSpeed need none)."""
        precision = self.cfg.precision.precision
        if precision == "fp32" or self.deepspeed or self.masters is not None:
            return nullcontext()
        return torch.autocast(self.device.type, dtype=HALF[precision])

    def no_sync(self):
        """Accumulate gradients without the DP all-reduce (every micro batch but a step's last)."""
        if self.main_grads is not None:
            return self.main_grads.no_sync()
        return self.wrapped.no_sync() if hasattr(self.wrapped, "no_sync") else nullcontext()


def pick_device(setting: str, local_rank: int) -> torch.device:
    """`train.device` (auto | cuda | cpu) for this rank; a GPU is chosen by `cuda_index`."""
    if setting == "cuda" or (setting == "auto" and torch.cuda.is_available()):
        return torch.device("cuda", cuda_index(local_rank, torch.cuda.device_count()))
    return torch.device("cpu")


def zero_grad_dtype(cfg: RunConfig) -> str:
    """The dtype DeepSpeed ZeRO sums gradients over micro batches and DP ranks in: fp32 for
    `precision.main_grads: fp32` (as the plain trainer's MainGrads) and for an fp32 run, the half
    dtype for `main_grads: param` (the 2019 recipe; DeepSpeed's default)."""
    p = cfg.precision
    return p.precision if p.precision != "fp32" and p.main_grads == "param" else "fp32"


def deepspeed_config(cfg: RunConfig, derived: Derived) -> dict:
    """DeepSpeed's JSON config for the run (ZeRO block, precision, gradient dtype, batch arithmetic).

    The gradient dtype is set, not left to DeepSpeed, whose default (the model's bf16/fp16) silently
    ignored `main_grads: fp32`. DeepSpeed 0.19.8 sums fp32 gradients of a half model in its ZeRO
    optimizer (fp16 ZeRO-1/2, bf16 ZeRO-2) or, for bf16 ZeRO-1, in its BF16_Optimizer (a full fp32
    gradient buffer, no IPG bucket); repro.perf.plan counts each.
    The gradient-reduction (IPG) bucket is set here, not left to DeepSpeed's defaults, because
    repro.perf.plan counts it: torch.empty(reduce_bucket_size) per rank (two with overlap_comm) while
    contiguous_gradients is on, in the model's dtype (fp32 for fp16 ZeRO-1 summing in fp32). 5e8
    elements is DeepSpeed's default. allgather_bucket_size is left alone: it allocates nothing
    (all_gather_into_tensor)."""
    p = cfg.precision
    grad_dtype = zero_grad_dtype(cfg)
    zero = {"stage": cfg.train.zero_stage, "overlap_comm": cfg.train.zero_overlap_comm,
            "contiguous_gradients": True, "reduce_bucket_size": 500_000_000}
    return {
        "train_micro_batch_size_per_gpu": cfg.train.micro_batch_size,
        "gradient_accumulation_steps": derived.grad_accum_steps,
        "train_batch_size": cfg.train.global_batch_size,
        "gradient_clipping": cfg.optim.clip_grad,
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        "data_types": {"grad_accum_dtype": grad_dtype},
        "communication_data_type": grad_dtype,
        "bf16": {"enabled": p.precision == "bf16"},
        "fp16": {"enabled": p.precision == "fp16", "initial_scale_power": int(round(torch.log2(torch.tensor(p.initial_loss_scale)).item())),
                 "loss_scale_window": p.loss_scale_window, "hysteresis": p.hysteresis,
                 "min_loss_scale": p.min_loss_scale},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


def compile_scope(cfg: RunConfig, dp_size: int, tp_size: int = 1, torch_version: str = torch.__version__) -> str:
    """`train.compile_scope` with auto resolved: per block when gradients are all-reduced over DP, at
    TP > 1 on a torch too old to compile the whole TP step (repro.versions.WHOLE_TP_GRAPH_TORCH), and
    with activation checkpointing and attention dropout: the checkpoint that replays the TP-region RNG
    tracker runs eagerly at TP > 1 (repro.parallel.random.checkpoint), so in one graph the layers inside
    it would not be compiled at all; per block they are, inside it. (At TP = 1 the models do not fork:
    random.tp_region_tracker.)"""
    scope = cfg.train.compile_scope
    if scope != "auto":
        return scope
    old_for_tp = tp_size > 1 and release(torch_version) < WHOLE_TP_GRAPH_TORCH
    eager_checkpoints = cfg.model.activation_checkpointing and cfg.model.attention_dropout > 0 and tp_size > 1
    return "blocks" if dp_size > 1 or old_for_tp or eager_checkpoints else "objective"


def transformer_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The GPT's or BERT's stack of transformer layers."""
    return model.transformer.h if hasattr(model, "transformer") else model.layers


def compiled(objective: torch.nn.Module, model: torch.nn.Module, scope: str) -> torch.nn.Module:
    """The objective compiled as one graph, or (scope `blocks`) with each transformer layer compiled
    in place, the embedding, head and loss between them eager."""
    if scope == "objective":
        return torch.compile(objective)
    for layer in transformer_layers(model):
        layer.compile()
    return objective


def import_deepspeed():
    """DeepSpeed, without the CPU shared-memory comm op its comm backend JIT-compiles at initialize.

    That op serves only DeepSpeed's inference all-reduce, which training never calls. Building it costs a
    minute on a fresh machine, and torch guards the build with a lock file that a process killed during
    it leaves behind: every later DeepSpeed run on CPU then waits for that lock forever, silently (seen
    after a killed test and a full disk). Marking the op incompatible makes DeepSpeed skip it, as it does
    on accelerators that have none (CUDA). And on a CPU without native fp16 kernels, fp16 allowed (below)."""
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    shm_builder = accelerator.get_op_builder("ShareMemCommBuilder")
    if shm_builder is not None:
        deepspeed.ops.__compatible_ops__[shm_builder.NAME] = False
    if accelerator.device_name() == "cpu" and not accelerator.is_fp16_supported():
        # DeepSpeed's CPU accelerator offers fp16 only where oneDNN has native fp16 kernels (AVX512-FP16,
        # AMX: recent Intel CPUs) and refuses `fp16.enabled` elsewhere ("Type fp16 is not supported on
        # your device", seen on an AMD EPYC). torch computes fp16 on every CPU, more slowly, and the CPU
        # runs are the tests' and the demo's: the same fp16 ZeRO recipe runs on any CPU.
        accelerator.is_fp16_supported = lambda: True
    return deepspeed


def build_engine(cfg: RunConfig, derived: Derived, pg: ProcessGroups, local_rank: int = 0) -> Engine:
    """Seed, build the model at this TP rank, and wrap it for data parallelism."""
    device = pick_device(cfg.train.device, local_rank)
    seed_default_generators(cfg.train.seed, device)  # identical on every rank: replicated dropout
    rng = RNGTracker(cfg.train.seed, pg.tp_rank, device)
    model = build_model(cfg, pg, rng, device)
    objective = build_objective(cfg, model)
    half_params = cfg.precision.params == "half" and cfg.train.zero_stage == 0
    masters = MasterWeights(model, HALF[cfg.precision.precision]) if half_params else None
    optimizer = build_optimizer(masters or model, cfg.optim)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg.optim, cfg.train.train_iters))
    if cfg.train.zero_stage > 0:
        deepspeed = import_deepspeed()
        # DeepSpeed asserts LOCAL_RANK and takes it as its GPU's index: the one this rank uses (0 when the
        # task sees one GPU, --gpus-per-task=1, though slurm/task.sh exports the node-local task index)
        os.environ["LOCAL_RANK"] = str(device.index if device.type == "cuda" else local_rank)
        wrapped, optimizer, _, scheduler = deepspeed.initialize(
            model=objective, optimizer=optimizer, lr_scheduler=scheduler, mpu=pg,
            config=deepspeed_config(cfg, derived), dist_init_required=False)
        if hasattr(getattr(optimizer, "loss_scaler", None), "raise_error_at_min_scale"):
            optimizer.loss_scaler.raise_error_at_min_scale = False  # refuse_divergence stops it, as ours
        return Engine(cfg, derived, pg, device, model, objective, wrapped, optimizer, scheduler, None, rng, True)
    wrapped = compiled(objective, model, compile_scope(cfg, pg.dp_size, pg.tp_size)) if cfg.train.compile else objective
    main_grads = flat_step = None
    if masters is not None and cfg.precision.main_grads == "fp32":
        main_grads = MainGrads(masters.pairs(), pg.dp_group)
        if cfg.optim.flat_step:  # before the compiled objective's first call: parameters move into flat buffers
            flat_step = FlatMasterAdamW(optimizer, masters, main_grads)
    elif pg.dp_size > 1:
        wrapped = DistributedDataParallel(wrapped, process_group=pg.dp_group, gradient_as_bucket_view=True,
                                          device_ids=[device.index] if device.type == "cuda" else None)
        # gradient_as_bucket_view: .grad are views of DDP's buckets, not a second copy of every gradient
    scaler = DynamicLossScaler.from_config(cfg.precision) if cfg.precision.precision == "fp16" else None
    return Engine(cfg, derived, pg, device, model, objective, wrapped, optimizer, scheduler, scaler, rng,
                  masters=masters, main_grads=main_grads, flat_step=flat_step)
