"""One training iteration: gradient accumulation over micro batches, then one optimizer step."""

from __future__ import annotations

import math
import re
import warnings
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist

from repro.parallel.grads import clip_grad_norm, global_grad_norm
from repro.train.engine import Engine
from repro.train.objectives import to_device


@dataclass
class StepResult:
    loss: float
    """Mean per-token loss over the global batch (all DP ranks, all micro batches)."""
    grad_norm: float
    lr: float
    loss_scale: float
    skipped: bool


def _dp_mean(value: torch.Tensor, eng: Engine) -> float:
    if eng.pg.dp_size > 1:
        dist.all_reduce(value, group=eng.pg.dp_group)
        value = value / eng.pg.dp_size
    return value.item()


def _plain_step(eng: Engine, micro_batches) -> StepResult:
    eng.optimizer.zero_grad(set_to_none=True)
    total = torch.zeros((), device=eng.device)
    scale = eng.scaler.scale if eng.scaler else 1.0
    last = len(micro_batches) - 1
    for i, batch in enumerate(micro_batches):
        accumulate = i < last and hasattr(eng.wrapped, "no_sync")
        with eng.wrapped.no_sync() if accumulate else nullcontext():  # DP all-reduce only on the last
            with eng.autocast():
                loss = eng.wrapped(to_device(batch, eng.device)) / len(micro_batches)
            (loss * scale).backward()
        total += loss.detach()
    if eng.masters is not None:
        params = eng.masters.grads_to_masters()
    else:
        params = [p for p in eng.model.parameters() if p.grad is not None]
    overflow = False
    if eng.scaler:
        for p in params:
            p.grad.div_(scale)
        overflow = eng.scaler.found_overflow(params)
    clip = eng.cfg.optim.clip_grad
    norm = float("nan") if overflow else (
        clip_grad_norm(params, clip, eng.pg.tp_group) if clip > 0 else global_grad_norm(params, eng.pg.tp_group)).item()
    lr = eng.optimizer.param_groups[0]["lr"]
    if not overflow:
        eng.optimizer.step()
        if eng.masters is not None:
            eng.masters.masters_to_model()
    if eng.scaler:
        eng.scaler.update(overflow)
    with warnings.catch_warnings():  # a skipped (overflow) step still advances the schedule, as Megatron's
        warnings.filterwarnings("ignore", message=re.escape("Detected call of `lr_scheduler.step()`"))
        eng.scheduler.step()
    return StepResult(_dp_mean(total, eng), norm, lr, scale, overflow)


def _deepspeed_step(eng: Engine, micro_batches) -> StepResult:
    total = torch.zeros((), device=eng.device)
    lr = eng.optimizer.param_groups[0]["lr"]
    skipped_before = getattr(eng.wrapped, "skipped_steps", 0)
    for batch in micro_batches:
        loss = eng.wrapped(to_device(batch, eng.device)).float()
        eng.wrapped.backward(loss)
        eng.wrapped.step()
        total += loss.detach() / len(micro_batches)
    norm = eng.wrapped.get_global_grad_norm()
    norm = float(norm) if norm is not None else float("nan")
    scale = float(getattr(eng.optimizer, "cur_scale", getattr(eng.optimizer, "loss_scale", 1.0)) or 1.0)
    skipped = getattr(eng.wrapped, "skipped_steps", 0) > skipped_before
    return StepResult(_dp_mean(total, eng), norm, lr, scale, skipped)


def train_step(eng: Engine, micro_batches: list) -> StepResult:
    """Forward/backward every micro batch of this DP rank, then step (skipped on fp16 overflow)."""
    eng.wrapped.train()
    return _deepspeed_step(eng, micro_batches) if eng.deepspeed else _plain_step(eng, micro_batches)


@torch.no_grad()
def evaluate(eng: Engine, micro_batches) -> dict[str, float]:
    """Held-out metrics (`valid_loss`, and for BERT `valid_mlm_loss`, `valid_mlm_ppl`, ...) averaged
    over the given micro batches and all DP ranks."""
    eng.model.eval()
    sums: dict[str, torch.Tensor] = {}
    for batch in micro_batches:
        with eng.autocast():
            for name, value in eng.objective.metrics(to_device(batch, eng.device)).items():
                sums[name] = sums.get(name, 0.0) + value.detach().float()
    eng.model.train()
    out = {f"valid_{k}": _dp_mean(v / max(len(micro_batches), 1), eng) for k, v in sums.items()}
    if "valid_mlm_loss" in out:
        out["valid_mlm_ppl"] = math.exp(min(out["valid_mlm_loss"], 50.0))
    return out
