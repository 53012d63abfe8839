"""Megatron's mixed precision: half-precision parameters and activations, fp32 master weights.

With `precision.params: half` the model itself is bf16/fp16 and runs without autocast, so every
matmul reads its weight as stored (no per-step fp32 -> half cast of the weights) and the residual
stream, layer norms and GELU move half the bytes. The optimizer never sees the half parameters: it
steps on an fp32 copy of each (the master weights) with fp32 gradients, and after the step the
masters are rounded back into the model. Small updates therefore accumulate in fp32, as with
autocast over fp32 weights.

Gradients of a step are accumulated over micro batches and all-reduced over the DP group either in
fp32 (`precision.main_grads: fp32`, the default: `repro.train.main_grads`, Megatron-LM's main_grad)
or in the parameter dtype by torch DDP (`param`: Megatron's 2019 fp16 recipe), then cast to fp32
once per step (`grads_to_masters`).

Checkpoints store the masters in the model file, so a checkpoint has the same format and values
whichever recipe wrote it: resharding, export and evaluation need not know.
"""

from __future__ import annotations

import torch
from torch import nn

TENSOR_PARALLEL_ATTRS = ("tensor_model_parallel", "partition_dim", "partition_stride")


def _master_of(param: nn.Parameter) -> nn.Parameter:
    """An fp32 copy of `param` that carries its tensor-parallel attributes (for the TP-aware norm)."""
    master = nn.Parameter(param.detach().clone().float())
    for attr in TENSOR_PARALLEL_ATTRS:
        if hasattr(param, attr):
            setattr(master, attr, getattr(param, attr))
    return master


class MasterWeights:
    """The fp32 master copy of a half-precision model's parameters, by parameter name."""

    def __init__(self, model: nn.Module, dtype: torch.dtype) -> None:
        """Casts `model` to `dtype` in place, keeping the fp32 values it had as the masters."""
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.masters = {n: _master_of(p) for n, p in named}
        model.to(dtype)
        self.model_params = dict(model.named_parameters())
        self.names = [n for n, _ in named]

    def named_parameters(self):
        """(name, fp32 master) pairs, in the model's order (what the optimizer is built on)."""
        return ((n, self.masters[n]) for n in self.names)

    def parameters(self) -> list[nn.Parameter]:
        return [self.masters[n] for n in self.names]

    def pairs(self) -> list[tuple[nn.Parameter, nn.Parameter]]:
        """(half model parameter, fp32 master) pairs, in the model's order."""
        return [(self.model_params[n], self.masters[n]) for n in self.names]

    def grads_to_masters(self) -> list[nn.Parameter]:
        """Move each model gradient into its master as fp32; returns the masters that got one."""
        with_grad = []
        for n in self.names:
            p, master = self.model_params[n], self.masters[n]
            master.grad = None if p.grad is None else p.grad.float()
            p.grad = None
            if master.grad is not None:
                with_grad.append(master)
        return with_grad

    @torch.no_grad()
    def masters_to_model(self) -> None:
        """Round the (just updated) masters into the half-precision model."""
        model = [self.model_params[n] for n in self.names]
        torch._foreach_copy_(model, self.parameters())

    def state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """`model.state_dict()` with every trained parameter replaced by its fp32 master."""
        state = model.state_dict()
        # no copy: torch.save serialises them at once, and a clone would hold 4 more bytes per
        # parameter of GPU memory during every save
        return {k: self.masters[k].detach() if k in self.masters else v for k, v in state.items()}

    @torch.no_grad()
    def load_state_dict(self, model: nn.Module, state: dict[str, torch.Tensor]) -> None:
        """Load a (fp32) model state dict into the masters and, rounded, into the model."""
        model.load_state_dict(state)  # casts to the model's dtype; checks names and shapes
        for n in self.names:
            self.masters[n].copy_(state[n])
