"""AdamW on flat buffers that also rounds the masters into the half model: one kernel where there were two.

With half-precision parameters the optimizer phase after the clip makes two passes over the model:
torch's fused AdamW (reads the fp32 main grad, master, exp_avg and exp_avg_sq; writes the last three)
and `MasterWeights.masters_to_model` (reads every master again, writes its half copy): about 41 GB a
step at 1.2B parameters, 13.2 ms on an H200 (results/bench/gpu_h200_2026-12-04/optimizer). Here the
masters, both moments and the half parameters are views of flat buffers laid out like the main-grad
buckets (`repro.train.main_grads`), and one elementwise kernel per contiguous run of parameters of one
param group reads each input once and writes the four outputs: about 36 GB. The kernel is
torch.compile'd once with a dynamic length (the runs differ in size); on CPU the same function runs
eagerly unless asked.

The TP-aware gradient norm before it is taken over the same flat runs (a few large reductions,
not one per parameter). The optimizer stays a `torch.optim.AdamW`: its param groups carry lr (the
scheduler's), betas, eps and weight decay, and its state holds the moments as views of the flat
buffers and the step count (written into it as it is saved), so `state_dict()` and checkpoints are
those of the plain step. Loading a state dict re-adopts the loaded moments into the flat buffers.
The arithmetic is torch AdamW's (decoupled decay, bias corrections from the host's step count),
reordered by the compiler within fp32 rounding.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from repro.parallel.grads import sum_of_squares
from repro.parallel.layers import is_tensor_parallel
from repro.parallel.mappings import group_rank, group_size
from repro.train.main_grads import MainGrads
from repro.train.mixed_precision import MasterWeights


def adamw_and_round(master, grad, exp_avg, exp_avg_sq, half, scalars, grad_scale) -> None:
    """One AdamW step of a flat run in place, and its rounding into the half copy.

    `scalars` (fp32, on the device): 1 - lr*weight_decay, 1 - beta1, beta2, 1 - beta2, eps,
    lr / (1 - beta1^t), sqrt(1 - beta2^t). The gradient is divided by `grad_scale` (loss scale over
    clip coefficient) as torch's fused AdamW divides by its `grad_scale`."""
    decay, one_minus_beta1, beta2, one_minus_beta2, eps, step_size, bias2_sqrt = scalars.unbind()
    g = grad / grad_scale
    m = torch.lerp(exp_avg, g, one_minus_beta1)
    v = exp_avg_sq * beta2 + g * g * one_minus_beta2
    p = master * decay - step_size * (m / (v.sqrt() / bias2_sqrt + eps))
    exp_avg.copy_(m)
    exp_avg_sq.copy_(v)
    master.copy_(p)
    half.copy_(p)


@dataclass(frozen=True)
class _Run:
    """A contiguous run of parameters with one key (param group, or TP-sharded) in one bucket."""

    bucket: int
    group: int
    start: int
    end: int


class FlatMasterAdamW:
    """The AdamW step of a half model's fp32 masters over MainGrads' flat buckets, rounding into the model."""

    def __init__(self, optimizer: torch.optim.AdamW, masters: MasterWeights, main: MainGrads,
                 compile: bool | None = None) -> None:
        """Moves the masters, their moments and the model's half parameters into flat buffers aligned
        with `main`'s buckets (their values kept). `compile`: torch.compile the kernel (default: on
        a GPU)."""
        _check_supported(optimizer, masters)
        self.optimizer, self.masters, self.main = optimizer, masters, main
        device = main.buckets[0].flat.device
        self.kernel = torch.compile(adamw_and_round, dynamic=True, fullgraph=True) if (
            device.type != "cpu" if compile is None else compile) else adamw_and_round
        self.master_of = dict(masters.pairs())  # half parameter -> its fp32 master
        self.flat = [self._flatten_bucket(bucket) for bucket in main.buckets]
        group_of = {p: i for i, g in enumerate(optimizer.param_groups) for p in g["params"]}
        self.runs = self._runs(lambda half: group_of[self.master_of[half]])
        self.norm_runs = self._runs(lambda half: is_tensor_parallel(half))  # group: 1 if TP-sharded
        self.adopt_state()
        optimizer.register_load_state_dict_post_hook(lambda _: self.adopt_state())
        optimizer.register_state_dict_pre_hook(lambda _: self._record_steps())

    def _flatten_bucket(self, bucket) -> dict[str, torch.Tensor]:
        """Flat master, half and moment buffers for one bucket; the parameters become views of them."""
        flat = {"master": torch.empty_like(bucket.flat),
                "half": torch.empty_like(bucket.flat, dtype=bucket.params[0].dtype),
                "exp_avg": torch.zeros_like(bucket.flat), "exp_avg_sq": torch.zeros_like(bucket.flat)}
        for half in bucket.params:
            offset = self.main.slots[half].offset
            for name, param in (("master", self.master_of[half]), ("half", half)):
                view = flat[name][offset:offset + half.numel()].view_as(half)
                view.copy_(param.detach())
                param.data = view
        return flat

    def _runs(self, key: Callable[[torch.nn.Parameter], int]) -> list[_Run]:
        """Maximal runs of consecutive parameters with one `key`, bucket by bucket (MainGrads lays out
        the decayed matrices first, each kind TP-sharded before replicated: two runs a bucket by param
        group, four by sharding at most)."""
        runs: list[_Run] = []
        for b, bucket in enumerate(self.main.buckets):
            for half in bucket.params:
                start, group = self.main.slots[half].offset, int(key(half))
                last = runs[-1] if runs else None
                if last and last.bucket == b and last.group == group and last.end == start:
                    runs[-1] = _Run(b, group, last.start, start + half.numel())
                else:
                    runs.append(_Run(b, group, start, start + half.numel()))
        return runs

    def _grad_slices(self, counted: bool, tp_group) -> list[torch.Tensor]:
        """The main-grad runs the TP-aware norm counts on this rank (the sharded ones, and on TP rank 0
        the replicated ones too), or those it leaves out (`counted` False)."""
        first = group_rank(tp_group) == 0
        return [self.main.buckets[r.bucket].flat[r.start:r.end] for r in self.norm_runs
                if (r.group == 1 or first) == counted]

    @torch.no_grad()
    def grad_norm(self, tp_group=None) -> torch.Tensor:
        """`repro.parallel.grads.global_grad_norm` of the masters' gradients, over the flat runs (a few
        large reductions instead of one per parameter)."""
        grads = self._grad_slices(True, tp_group)
        total = sum_of_squares(grads, torch.float32, foreach=grads[0].device.type != "cpu") if grads else \
            torch.zeros((), device=self.main.buckets[0].flat.device)
        if group_size(tp_group) > 1:
            dist.all_reduce(total, group=tp_group)
        return total.sqrt()

    @torch.no_grad()
    def uncounted_sum_of_squares(self, tp_group=None) -> torch.Tensor:
        """`repro.parallel.grads.uncounted_sum_of_squares` over the flat runs (the fp16 overflow check)."""
        grads = self._grad_slices(False, tp_group)
        if not grads:
            return torch.zeros((), device=self.main.buckets[0].flat.device)
        return sum_of_squares(grads, torch.float32, foreach=grads[0].device.type != "cpu")

    @torch.no_grad()
    def adopt_state(self) -> None:
        """Make the optimizer's moments views of the flat buffers (copying in any it holds, as after
        `load_state_dict`) and take its step count."""
        self.steps = _step_count(self.optimizer, self.masters.parameters())
        bucket_index = {id(b): i for i, b in enumerate(self.main.buckets)}
        for half, master in self.master_of.items():
            slot = self.main.slots[half]
            flat = self.flat[bucket_index[id(slot.bucket)]]
            state = self.optimizer.state[master]
            for name in ("exp_avg", "exp_avg_sq"):
                view = flat[name][slot.offset:slot.offset + half.numel()].view_as(master)
                if name in state:
                    view.copy_(state[name])
                state[name] = view
        self._record_steps()

    def _record_steps(self) -> None:
        """Write the step count into every master's state (before `state_dict()`: the count lives in
        `self.steps` between), one CPU tensor each as torch's unfused AdamW keeps it (a shared one
        would be stepped once per parameter by a plain AdamW that loads the state)."""
        for master in self.master_of.values():
            self.optimizer.state[master]["step"] = torch.tensor(float(self.steps))

    @torch.no_grad()
    def step(self, grad_scale: torch.Tensor | None = None) -> None:
        """One AdamW step of every master from its main grad (divided by `grad_scale`, a one-element
        tensor, if given), rounded into the half model."""
        self.steps += 1
        device = self.flat[0]["master"].device
        scalars = [self._scalars(g).to(device, non_blocking=True) for g in self.optimizer.param_groups]
        divisor = torch.ones((), device=device) if grad_scale is None else grad_scale.reshape(()).float()
        for run in self.runs:
            flat, grad = self.flat[run.bucket], self.main.buckets[run.bucket].flat
            part = slice(run.start, run.end)
            self.kernel(flat["master"][part], grad[part], flat["exp_avg"][part], flat["exp_avg_sq"][part],
                        flat["half"][part], scalars[run.group], divisor)

    def _scalars(self, group: dict) -> torch.Tensor:
        """The kernel's scalars for one param group at the current step (host fp64, sent as fp32)."""
        lr, (beta1, beta2), eps, decay = group["lr"], group["betas"], group["eps"], group["weight_decay"]
        values = [1 - lr * decay, 1 - beta1, beta2, 1 - beta2, eps, lr / (1 - beta1**self.steps),
                  (1 - beta2**self.steps) ** 0.5]
        return torch.tensor(values, dtype=torch.float32)


def _check_supported(optimizer: torch.optim.Optimizer, masters: MasterWeights) -> None:
    if not isinstance(optimizer, torch.optim.AdamW):
        raise TypeError(f"FlatMasterAdamW steps a torch.optim.AdamW, got {type(optimizer).__name__}")
    for group in optimizer.param_groups:
        for option in ("amsgrad", "maximize", "capturable", "differentiable"):
            if group.get(option):
                raise ValueError(f"FlatMasterAdamW does not implement AdamW's {option}=True")
        if torch.is_tensor(group["lr"]):
            raise ValueError("FlatMasterAdamW reads lr as a number (the trainer's LambdaLR sets one)")
    stepped = {id(p) for g in optimizer.param_groups for p in g["params"]}
    if stepped != {id(p) for p in masters.parameters()}:
        raise ValueError("FlatMasterAdamW: the optimizer must step exactly the fp32 masters")


def _step_count(optimizer: torch.optim.Optimizer, params: list[torch.Tensor]) -> int:
    """The step count the optimizer's state records (0 before the first step); one for all."""
    counts = {int(optimizer.state[p]["step"]) for p in params if "step" in optimizer.state.get(p, {})}
    if len(counts) > 1:
        raise ValueError(f"FlatMasterAdamW needs one step count for all parameters, found {sorted(counts)}")
    return counts.pop() if counts else 0
