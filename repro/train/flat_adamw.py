"""AdamW on flat buffers that also rounds the masters into the half model: one kernel where there were two.

With half-precision parameters the optimizer phase after the clip makes two passes over the model:
torch's fused AdamW (reads the fp32 main grad, master, exp_avg and exp_avg_sq; writes the last three)
and `MasterWeights.masters_to_model` (reads every master again, writes its half copy): about 41 GB a
step at 1.2B parameters, 13.2 ms on an H200 (results/bench/gpu_h200_2026-12-04/optimizer). Here the
masters, both moments and the half parameters are views of flat buffers laid out like the main-grad
buckets (`repro.train.main_grads`), and one elementwise kernel per bucket reads each input once and
writes the four outputs: about 36 GB. A bucket holds two runs, its weight matrices (decayed) and then
its 1-D parameters (not): the kernel picks each element's param-group scalars by its index. It is
torch.compile'd once with a dynamic length (the buckets differ in size), its arguments sliced once up
front, so a step costs one call a bucket; on CPU an eager function runs instead, one call a run.

The TP-aware gradient norm before it is taken over the same flat runs (a few large reductions,
not one per parameter). The optimizer stays a `torch.optim.AdamW`: its param groups carry lr (the
scheduler's), betas, eps and weight decay, and its state holds the moments as views of the flat
buffers and the step count (written into it as it is saved), so `state_dict()` and checkpoints are
those of the plain step. Loading a state dict copies its moments straight into the flat buffers.
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
    _update(master, grad, exp_avg, exp_avg_sq, half, scalars.unbind(), grad_scale)


def adamw_and_round_two_runs(master, grad, exp_avg, exp_avg_sq, half, table, layout, grad_scale) -> None:
    """`adamw_and_round` over two adjacent runs of different param groups in one pass (compiled: one
    kernel a bucket, not two). `table`: the scalars of every param group, a row each; `layout` (int64):
    the first run's row, the second's, and the index where the second starts. Eagerly this would
    materialise every element's scalars; the compiler selects them in registers."""
    rows = table.index_select(0, layout[:2])
    first = torch.arange(master.numel(), device=master.device) < layout[2]
    scalars = [torch.where(first, a, b) for a, b in zip(rows[0].unbind(), rows[1].unbind())]
    _update(master, grad, exp_avg, exp_avg_sq, half, scalars, grad_scale)


def _update(master, grad, exp_avg, exp_avg_sq, half, scalars, grad_scale) -> None:
    """torch AdamW's arithmetic (decoupled decay, bias-corrected moments), written in place."""
    decay, one_minus_beta1, beta2, one_minus_beta2, eps, step_size, bias2_sqrt = scalars
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
        with `main`'s buckets (their values kept). `compile`: torch.compile the kernel, one call a
        bucket (default: on a GPU); eagerly one call a run."""
        _check_supported(optimizer, masters)
        self.optimizer, self.masters, self.main = optimizer, masters, main
        device = main.buckets[0].flat.device
        self.compiled = device.type != "cpu" if compile is None else compile
        self.master_of = dict(masters.pairs())  # half parameter -> its fp32 master
        self._moment_views: dict[torch.Tensor, dict[str, torch.Tensor]] = {}  # master -> its moments in `flat`
        self.flat = [self._flatten_bucket(bucket) for bucket in main.buckets]
        group_of = {p: i for i, g in enumerate(optimizer.param_groups) for p in g["params"]}
        self.runs = self._runs(lambda half: group_of[self.master_of[half]])
        self.norm_runs = self._runs(lambda half: is_tensor_parallel(half))  # group: 1 if TP-sharded
        self.calls = self._pair_calls(device) if self.compiled else self._run_calls()
        self.kernel = torch.compile(adamw_and_round_two_runs, dynamic=True, fullgraph=True) if self.compiled \
            else adamw_and_round
        self.adopt_state()
        optimizer.register_load_state_dict_pre_hook(lambda _, state_dict: self._load_moments(state_dict))
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
            self._moment_views[self.master_of[half]] = {
                name: flat[name][offset:offset + half.numel()].view_as(half) for name in ("exp_avg", "exp_avg_sq")}
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

    def _views(self, bucket: int, start: int, end: int) -> tuple[torch.Tensor, ...]:
        """The kernel's tensor arguments for elements [start, end) of a bucket: master, main grad, the
        moments and the half copy, sliced once here rather than every step."""
        flat, part = self.flat[bucket], slice(start, end)
        return (flat["master"][part], self.main.buckets[bucket].flat[part], flat["exp_avg"][part],
                flat["exp_avg_sq"][part], flat["half"][part])

    def _run_calls(self) -> list[tuple[tuple[torch.Tensor, ...], int]]:
        """Eager calls: each run's views and its param group."""
        return [(self._views(r.bucket, r.start, r.end), r.group) for r in self.runs]

    def _pair_calls(self, device: torch.device) -> list[tuple[tuple[torch.Tensor, ...], torch.Tensor]]:
        """Compiled calls: the runs of a bucket two by two (one pair a bucket with the trainer's two
        param groups), each with its layout for `adamw_and_round_two_runs` (a lone run takes its row twice)."""
        calls = []
        for b in range(len(self.main.buckets)):
            runs = [r for r in self.runs if r.bucket == b]
            for first, second in zip(runs[::2], runs[1::2] + [None]):
                end = (second or first).end
                boundary = second.start if second else end
                layout = torch.tensor([first.group, (second or first).group, boundary - first.start], device=device)
                calls.append((self._views(b, first.start, end), layout))
        return calls

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

    def _load_moments(self, state_dict: dict) -> dict | None:
        """Before `load_state_dict`: copy the saved moments straight into the flat buffers and hand torch
        the views instead (its load would otherwise first copy every moment onto the device, 8 bytes a
        parameter more at the peak). The caller's dict is left as it was; a dict whose groups do not
        match is passed on for torch to refuse."""
        saved = [g["params"] for g in state_dict["param_groups"]]
        ours = [g["params"] for g in self.optimizer.param_groups]
        if [len(g) for g in saved] != [len(g) for g in ours]:
            return None
        state = dict(state_dict["state"])
        with torch.no_grad():
            for saved_id, master in zip((i for g in saved for i in g), (p for g in ours for p in g)):
                if saved_id in state:
                    state[saved_id] = {**state[saved_id], **self._adopt_moments(master, state[saved_id])}
        return {**state_dict, "state": state}

    @torch.no_grad()
    def adopt_state(self) -> None:
        """Make the optimizer's moments views of the flat buffers (copying in any it holds, zeroing those
        it lacks, as after `load_state_dict`) and take its step count; check the loaded options."""
        _check_supported(self.optimizer, self.masters)
        self.steps = _step_count(self.optimizer, self.masters.parameters())
        for master in self.master_of.values():
            state = self.optimizer.state[master]
            state.update(self._adopt_moments(master, state))
        self._record_steps()

    def _adopt_moments(self, master: torch.Tensor, state: dict) -> dict[str, torch.Tensor]:
        """A master's two moments as views of the flat buffers, holding `state`'s values (zero where
        `state` has none)."""
        views = {}
        for name, view in self._moment_views[master].items():
            if name not in state:
                view.zero_()
            elif state[name] is not view:
                view.copy_(state[name])
            views[name] = view
        return views

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
        self.optimizer._opt_called = True  # what torch's step would mark for the LR scheduler's order check
        device = self.flat[0]["master"].device
        table = torch.stack([self._scalars(g) for g in self.optimizer.param_groups]).to(device, non_blocking=True)
        divisor = torch.ones((), device=device) if grad_scale is None else grad_scale.reshape(()).float()
        for views, which in self.calls:  # compiled: `which` is the layout, eagerly the param group
            if self.compiled:
                self.kernel(*views, table, which, divisor)
            else:
                self.kernel(*views, table[which], divisor)

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
