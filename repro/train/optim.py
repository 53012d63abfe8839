"""AdamW with the paper's parameter groups, the learning-rate schedule, and dynamic loss scaling."""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Callable

import torch
import torch.distributed as dist

from repro.parallel.grads import clip_coefficient, clip_grad_norm, global_grad_norm, uncounted_sum_of_squares
from repro.train.config import OptimConfig, PrecisionConfig

if TYPE_CHECKING:
    from repro.train.flat_adamw import FlatMasterAdamW


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Weight decay on weight matrices only: none on biases, layer norms (any 1-D parameter)."""
    decay, no_decay = [], []
    for _, p in model.named_parameters():
        if p.requires_grad:
            (no_decay if p.ndim < 2 else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(model: torch.nn.Module, cfg: OptimConfig) -> torch.optim.AdamW:
    """torch AdamW (decoupled weight decay), also handed to DeepSpeed as its client optimizer: the
    fused kernel (one launch for the whole step, as timed by gpu_bench) unless `cfg.fused` is off."""
    return torch.optim.AdamW(param_groups(model, cfg.weight_decay), lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2),
                             eps=cfg.adam_eps, fused=True if cfg.fused else None)


def uses_fused_kernel(optimizer: torch.optim.Optimizer) -> bool:
    return bool(optimizer.defaults.get("fused"))


def clip_and_step(optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter], clip: float, tp_group=None,
                  scaler: "DynamicLossScaler | None" = None, world_group=None,
                  fold: bool | None = None, flat: "FlatMasterAdamW | None" = None) -> tuple[torch.Tensor | None, bool]:
    """Unscale the gradients of `params` (fp16), clip them to the TP-aware global norm `clip` (0: no
    clip) and step, unless a gradient overflowed on some rank of `world_group`. Returns the norm before
    clipping (None on overflow) and whether the step was skipped.

    `fold`: hand a fused optimizer the loss scale and the clip coefficient as its kernel's gradient
    divisor (`grad_scale`, the input GradScaler unscales through) instead of foreach passes over the
    gradients before the step. Both round alike to within a few ulps. By default (None) only on CPU:
    on an H200 the fused AdamW with a `grad_scale` took about 3 ms more over 1.2B parameters than
    without, more than the clip pass it saves (results/bench/gpu_h200_2026-12-04).

    `flat`: step `optimizer`'s masters by this flat kernel instead (repro.train.flat_adamw), which
    divides by the folded scale at no extra cost and also rounds the masters into the half model."""
    if flat is not None:
        return _fused_clip_and_step(flat.step, partial(flat.grad_norm, tp_group),
                                    partial(flat.uncounted_sum_of_squares, tp_group), clip, scaler, world_group)
    device = params[0].grad.device if params else torch.device("cpu")
    if fold is None:
        fold = device.type == "cpu"
    if fold and uses_fused_kernel(optimizer):
        return _fused_clip_and_step(partial(_step_with_grad_scale, optimizer),
                                    partial(global_grad_norm, params, tp_group),
                                    partial(uncounted_sum_of_squares, params, tp_group), clip, scaler, world_group)
    if scaler is not None and scaler.unscale_and_check(params, device, world_group):
        return None, True
    norm = clip_grad_norm(params, clip, tp_group) if clip > 0 else global_grad_norm(params, tp_group)
    optimizer.step()
    return norm, False


def _step_with_grad_scale(optimizer: torch.optim.Optimizer, grad_scale: torch.Tensor) -> None:
    """A fused torch optimizer's step with its kernel dividing every gradient by `grad_scale`."""
    optimizer.grad_scale = grad_scale
    try:
        optimizer.step()
    finally:
        del optimizer.grad_scale


def _fused_clip_and_step(step: Callable[[torch.Tensor], None], grad_norm: Callable[[], torch.Tensor],
                         uncounted: Callable[[], torch.Tensor], clip: float, scaler,
                         world_group) -> tuple[torch.Tensor | None, bool]:
    """The TP-aware norm, the overflow check (with the sum of squares the norm leaves out on this
    rank), then `step(loss_scale / clip coefficient)`."""
    loss_scale = scaler.scale if scaler is not None else 1.0
    norm = grad_norm() / loss_scale  # inf/nan if a counted gradient overflowed
    if scaler is not None and scaler.non_finite(torch.stack([norm.float(), uncounted()]), world_group):
        return None, True
    coefficient = clip_coefficient(norm, clip) if clip > 0 else torch.ones_like(norm)
    step((loss_scale / coefficient).float())
    return norm, False


def _on_any_rank(found: torch.Tensor, group: dist.ProcessGroup | None) -> bool:
    """True if the one-element flag `found` is nonzero on any rank of `group` (one host sync)."""
    if group is not None:
        dist.all_reduce(found, op=dist.ReduceOp.MAX, group=group)
    return bool(found.item())


def lr_at(iteration: int, cfg: OptimConfig, train_iters: int) -> float:
    """The lr of 0-based `iteration`: linear warm-up to lr over lr_warmup_iters, then cosine or linear
    decay to min_lr, reached on the last of lr_decay_iters (default train_iters).

    Megatron-LM's AnnealingLR shifted one iteration earlier: it runs its first iteration at lr 0;
    here warm-up runs lr/W, ..., lr (the peak once, as there) and the decay ends on the last iteration.
    """
    done, warmup = iteration + 1, cfg.lr_warmup_iters
    if warmup and done <= warmup:
        return cfg.lr * done / warmup
    if cfg.lr_decay_style == "constant":
        return cfg.lr
    decay_iters = (cfg.lr_decay_iters or train_iters) - warmup
    progress = min((done - warmup) / max(decay_iters, 1), 1.0)
    if cfg.lr_decay_style == "cosine":
        factor = 0.5 * (1.0 + math.cos(math.pi * progress))
    else:
        factor = 1.0 - progress
    return cfg.min_lr + (cfg.lr - cfg.min_lr) * factor


def lr_lambda(cfg: OptimConfig, train_iters: int):
    """Multiplier of cfg.lr for torch's LambdaLR (so the schedule is checkpointed with it)."""
    return lambda it: lr_at(it, cfg, train_iters) / cfg.lr


def resync_lr(scheduler: torch.optim.lr_scheduler.LambdaLR) -> None:
    """Set every group's lr from the schedule at the restored step. Loading a checkpoint restores
    the step count and the lr saved beside it, which the old train_iters gave: a resumed run that
    raised train.train_iters would take one step at the old schedule's lr."""
    groups = scheduler.optimizer.param_groups
    for group, base, multiplier in zip(groups, scheduler.base_lrs, scheduler.lr_lambdas):
        group["lr"] = base * multiplier(scheduler.last_epoch)
    scheduler._last_lr = [group["lr"] for group in groups]  # what get_last_lr() reports, as step() sets it


@dataclass
class DynamicLossScaler:
    """fp16 dynamic loss scaling (Megatron-LM's defaults, as the paper states none: start 2^32, window 1000,
    hysteresis 2, minimum 1).

    An overflow skips the step. The `hysteresis`-th overflow halves the scale, and so does every
    overflow after it until `window` clean iterations double the scale, which restores the hysteresis.
    This is Megatron-LM's rule (`DynamicGradScaler.update` in megatron/core/optimizer/grad_scaler.py;
    in 2019 `DynamicLossScaler.update_scale` in megatron/fp16/loss_scaler.py, `delayed_shift`). DeepSpeed's
    `DynamicLossScaler` (the ZeRO path) keeps the hysteresis (`consecutive_hysteresis: false`, its default)
    but doubles one iteration later after the start and after each overflow: after window + 1 clean
    iterations (its `stable_interval` counts from the iteration after the last overflow), then every window.
    """

    scale: float = 2.0**32
    window: int = 1000
    hysteresis: int = 2
    min_scale: float = 1.0
    clean_iters: int = 0
    overflows_left: int = 2
    skipped: int = 0

    @classmethod
    def from_config(cls, cfg: PrecisionConfig) -> "DynamicLossScaler":
        return cls(cfg.initial_loss_scale, cfg.loss_scale_window, cfg.hysteresis, cfg.min_loss_scale,
                   overflows_left=cfg.hysteresis)

    def unscale_and_check(self, params, device: torch.device, group: dist.ProcessGroup | None) -> bool:
        """Divide every gradient by the scale; True if any, on any rank of `group`, is inf/nan (all
        ranks then skip the same step). One fused kernel (GradScaler's) and one host sync per step."""
        grads = [p.grad for p in params if p.grad is not None]
        found = torch.zeros(1, device=device)
        if grads:
            torch._amp_foreach_non_finite_check_and_unscale_(grads, found, torch.full((1,), 1.0 / self.scale,
                                                                                     device=device))
        return _on_any_rank(found, group)

    def non_finite(self, values: torch.Tensor, group: dist.ProcessGroup | None) -> bool:
        """True if any of `values` (gradient norms) is inf/nan on any rank of `group` (one host sync)."""
        return _on_any_rank((~torch.isfinite(values)).any().float().reshape(1), group)

    def floored(self, overflow: bool) -> bool:
        """True if this step's overflow cannot lower the scale: it is at min_scale and the hysteresis
        is used up. The run has diverged (DeepSpeed's scaler stops the run here; Megatron-LM's would
        skip every step after it)."""
        return overflow and self.scale <= self.min_scale and self.overflows_left <= 1

    def update(self, overflow: bool) -> None:
        """Advance the scale after a step (skipped or not)."""
        if overflow:
            self.skipped += 1
            self.clean_iters = 0
            self.overflows_left -= 1
            if self.overflows_left <= 0:  # not restored here: only growth restores it
                self.scale = max(self.scale / 2.0, self.min_scale)
            return
        self.clean_iters += 1
        if self.clean_iters % self.window == 0:
            self.scale *= 2.0
            self.overflows_left = self.hysteresis

    def state_dict(self) -> dict:
        return {k: getattr(self, k) for k in ("scale", "clean_iters", "overflows_left", "skipped")}

    def load_state_dict(self, state: dict) -> None:
        for key, value in state.items():
            setattr(self, key, value)
