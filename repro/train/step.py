"""One training iteration: gradient accumulation over micro batches, then one optimizer step."""

from __future__ import annotations

import math
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from repro.train.engine import Engine
from repro.train.objectives import to_device
from repro.train.optim import clip_and_step


@dataclass
class StepResult:
    loss: float
    """Mean per-token loss over the global batch (all DP ranks, all micro batches)."""
    grad_norm: float
    lr: float
    loss_scale: float
    skipped: bool
    parts: dict[str, float] = field(default_factory=dict)
    """The objective's loss components (BERT: mlm_loss, sop_loss), averaged like `loss`."""
    floored: bool = False
    """fp16: the step overflowed at the minimum loss scale with the hysteresis used up."""


def _dp_means(values: dict[str, torch.Tensor], eng: Engine) -> dict[str, float]:
    """Scalars averaged over DP ranks with one all-reduce and one host copy."""
    stacked = torch.stack([v.float() for v in values.values()])
    if eng.pg.dp_size > 1:
        dist.all_reduce(stacked, group=eng.pg.dp_group)
        stacked = stacked / eng.pg.dp_size
    return dict(zip(values, stacked.tolist()))


def _accumulate(sums: dict[str, torch.Tensor], loss: torch.Tensor, parts: dict, n: int) -> None:
    """Add one micro batch's detached loss and parts, each divided by the micro-batch count."""
    for name, value in {"loss": loss, **parts}.items():
        sums[name] = sums.get(name, 0.0) + value.detach().float() / n


def _result(sums: dict[str, torch.Tensor], eng: Engine, norm: float, lr: float, scale: float,
            skipped: bool, floored: bool) -> StepResult:
    means = _dp_means(sums, eng)
    return StepResult(means.pop("loss"), norm, lr, scale, skipped, means, floored)


def _stepped_grads(eng: Engine) -> list[torch.nn.Parameter]:
    """The parameters the optimizer steps, with this step's (DP-averaged) gradients in `.grad`."""
    if eng.main_grads is not None:
        return eng.main_grads.finish()
    if eng.masters is not None:
        return eng.masters.grads_to_masters()
    return [p for p in eng.model.parameters() if p.grad is not None]


def _plain_step(eng: Engine, micro_batches) -> StepResult:
    if eng.main_grads is None:  # main grads are overwritten by the step's first gradient instead
        eng.optimizer.zero_grad(set_to_none=True)
    sums: dict[str, torch.Tensor] = {}
    scale = eng.scaler.scale if eng.scaler else 1.0
    n, last = len(micro_batches), len(micro_batches) - 1
    for i, batch in enumerate(micro_batches):
        with eng.no_sync() if i < last else nullcontext():  # DP all-reduce only on the last
            with eng.autocast():
                loss, parts = eng.wrapped(to_device(batch, eng.device))
            (loss / n * scale).backward()
        _accumulate(sums, loss, parts, n)
    lr = eng.optimizer.param_groups[0]["lr"]
    norm, overflow = clip_and_step(eng.optimizer, _stepped_grads(eng), eng.cfg.optim.clip_grad, eng.pg.tp_group,
                                   eng.scaler, eng.pg.world_group, flat=eng.flat_step)
    if not overflow:  # a skipped (overflow) step leaves the schedule where it is, as Megatron's and DeepSpeed's
        if eng.masters is not None and eng.flat_step is None:  # the flat step rounded them in already
            eng.masters.masters_to_model()
        eng.scheduler.step()
    floored = bool(eng.scaler and eng.scaler.floored(overflow))
    if eng.scaler:
        eng.scaler.update(overflow)
    # the norm is read after the optimizer's kernels are queued: no device sync between clip and step
    return _result(sums, eng, float("nan") if norm is None else norm.item(), lr, scale, overflow, floored)


def _deepspeed_at_floor(optimizer) -> bool:
    """True if DeepSpeed's fp16 scaler cannot lower its scale at the next overflow (its
    DynamicLossScaler: at min_scale, hysteresis used up). repro.train.engine turns off its own raise
    there, so that the run stops with refuse_divergence's DivergedError, as our scaler's runs do."""
    scaler = getattr(optimizer, "loss_scaler", None)
    try:
        return scaler.cur_scale <= scaler.min_scale and (scaler.delayed_shift == 1 or scaler.cur_hysteresis == 1)
    except AttributeError:  # bf16/fp32, or a static scale
        return False


def _deepspeed_step(eng: Engine, micro_batches) -> StepResult:
    sums: dict[str, torch.Tensor] = {}
    lr = eng.optimizer.param_groups[0]["lr"]
    skipped_before = getattr(eng.wrapped, "skipped_steps", 0)
    at_floor = _deepspeed_at_floor(eng.optimizer)
    # the scale this step's losses are multiplied by, as _plain_step reports it: DeepSpeed's step updates it
    scale = float(getattr(eng.optimizer, "cur_scale", getattr(eng.optimizer, "loss_scale", 1.0)) or 1.0)
    for batch in micro_batches:
        loss, parts = eng.wrapped(to_device(batch, eng.device))
        eng.wrapped.backward(loss.float())
        eng.wrapped.step()
        _accumulate(sums, loss, parts, len(micro_batches))
    norm = eng.wrapped.get_global_grad_norm()
    norm = float(norm) if norm is not None else float("nan")
    skipped = getattr(eng.wrapped, "skipped_steps", 0) > skipped_before
    return _result(sums, eng, norm, lr, scale, skipped, skipped and at_floor)


class DivergedError(RuntimeError):
    """A non-finite loss or gradient norm that no loss scaler will recover from."""


def refuse_divergence(result: StepResult, iteration: int, saved_at: int, eng: Engine) -> None:
    """Stop the run at a non-finite loss or gradient norm, unless fp16's loss scaler skipped the step
    (it lowers the scale and goes on). bf16 and fp32 have no scale to lower: a step taken has left
    inf/nan weights, and one DeepSpeed skipped only wastes the iterations after it, so the run stops
    before the iteration's evaluation and save (Megatron-LM's --check-for-nan-in-loss-and-grad).
    fp16 stops at an overflow its scale can no longer answer (at precision.min_loss_scale, hysteresis
    used up), where DeepSpeed's scaler stops too. Every rank holds the same DP-averaged loss, global
    norm and overflow, so all ranks stop together."""
    fp16 = eng.cfg.precision.precision == "fp16"
    finite = math.isfinite(result.loss) and math.isfinite(result.grad_norm)
    if not result.floored and (finite or (result.skipped and fp16)):
        return
    gentler = "a lower optim.lr or a longer optim.lr_warmup_iters"
    last, fix = ((f"{eng.cfg.run_dir}/checkpoints holds iteration {saved_at}, saved before it",
                  f"resume from it (or from an earlier one, if its losses were already climbing: echo "
                  f"iter_NNNNNNN > {eng.cfg.run_dir}/checkpoints/latest) with {gentler} and --set "
                  "optim.override_schedule=true (a resume keeps the saved schedule without it)") if saved_at >= 0 else
                 ("no checkpoint was saved before it", f"run again with {gentler}"))
    why = (f"fp16, overflowing at the minimum loss scale (precision.min_loss_scale="
           f"{eng.cfg.precision.min_loss_scale:g}), which cannot go lower" if result.floored else
           f"{eng.cfg.precision.precision}, which has no loss scale to lower")
    raise DivergedError(
        f"iteration {iteration}: loss {result.loss}, gradient norm {result.grad_norm} in {why}: training "
        f"diverged (or this iteration's data is bad), so the run stops without saving this iteration; {last}. "
        f"Fix: {fix}")


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
    means = _dp_means({k: v / len(micro_batches) for k, v in sums.items()}, eng) if sums else {}
    out = {f"valid_{k}": v for k, v in means.items()}
    if "valid_mlm_loss" in out:
        out["valid_mlm_ppl"] = math.exp(min(out["valid_mlm_loss"], 50.0))
    return out
