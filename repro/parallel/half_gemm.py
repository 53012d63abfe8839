"""`linear`: F.linear whose bf16/fp16 GEMMs run at fp32 speed on CPUs without native half kernels.

A GPU's half GEMM reads bf16/fp16 inputs, accumulates in fp32 and rounds its output to the half
dtype. PyTorch's CPU GEMMs do the same through oneDNN where it has half kernels for the CPU (bf16
on AVX-512 or AMX cores; fp16 on AVX512-FP16 or AMX-FP16 ones). Elsewhere a half GEMM takes a
fallback path; on an AVX2-only EPYC it measured 8-55x slower than fp32 (the tiny GPT's output
layer backward, [128 x 50304] x [50304 x 64]: 786 ms in bf16 against 14 ms in fp32, one thread).
There `linear` upcasts the half inputs, runs the fp32 GEMM and rounds the result to the half dtype:
the same arithmetic up to the order of the fp32 sums. Autograd keeps the half inputs, not fp32
copies, so saved-activation memory is unchanged. Autocast over fp32 weights is emulated the same
way (inputs rounded to the autocast dtype first, as autocast would).

Compiled graphs keep the native half GEMM: they are the graphs a GPU runs, and the ones
repro.perf.compiled_buffers reads; GPUs and CPUs with native kernels never take the fp32 path.
Within `native_half_gemm()` neither does eager code: the fp32 path's temporaries (an fp32 copy of
the logits, of the weight) are the CPU's own, so a memory measurement meant to stand for a GPU's
(repro.perf.plan_check) runs without them.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import torch
import torch.nn.functional as F

HALF_DTYPES = (torch.bfloat16, torch.float16)


def cpu_native_half_gemm_dtypes() -> frozenset[torch.dtype]:
    """The half dtypes this CPU's oneDNN build has GEMM kernels for (the checks PyTorch's own CPU
    GEMM dispatch makes); empty without oneDNN."""
    if not torch.backends.mkldnn.is_available():
        return frozenset()
    checks = {torch.bfloat16: "_is_mkldnn_bf16_supported", torch.float16: "_is_mkldnn_fp16_supported"}
    native = set()
    for dtype, check in checks.items():
        try:
            if getattr(torch.ops.mkldnn, check)():
                native.add(dtype)
        except (AttributeError, RuntimeError):  # a torch build without the check: assume none
            pass
    return frozenset(native)


CPU_NATIVE_HALF_GEMM = cpu_native_half_gemm_dtypes()
"""Fixed by the hardware at import; read (not changed) by `linear`, which also honours
`torch.backends.mkldnn.flags(enabled=False)` (PyTorch's GEMMs then skip oneDNN: no native half kernels)."""


_NATIVE_ONLY = contextvars.ContextVar("repro_native_half_gemm", default=False)


@contextlib.contextmanager
def native_half_gemm() -> Iterator[None]:
    """Within: `linear` is F.linear on every CPU (the allocations a GPU makes; slow without kernels)."""
    token = _NATIVE_ONLY.set(True)
    try:
        yield
    finally:
        _NATIVE_ONLY.reset(token)


class _HalfLinearInFp32(torch.autograd.Function):
    """y = x w^T + b for half x, w, b: every GEMM (forward, input and weight gradients) in fp32, each
    result rounded to the half dtype; saves the half x and w."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        with torch.autocast("cpu", enabled=False):
            y = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx, grad_y):
        x, weight = ctx.saved_tensors
        grad_2d = grad_y.float().reshape(-1, grad_y.shape[-1])
        grad_x = grad_weight = grad_bias = None
        with torch.autocast("cpu", enabled=False):
            if ctx.needs_input_grad[0]:
                grad_x = (grad_2d @ weight.float()).reshape(x.shape).to(x.dtype)
            if ctx.needs_input_grad[1]:
                grad_weight = (grad_2d.t() @ x.reshape(-1, x.shape[-1]).float()).to(weight.dtype)
            if ctx.has_bias and ctx.needs_input_grad[2]:
                grad_bias = grad_2d.sum(0).to(weight.dtype)
        return grad_x, grad_weight, grad_bias


def fp32_gemm_dtype(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.dtype | None:
    """The half dtype whose GEMM `linear` computes in fp32 here, or None where F.linear runs as is:
    on CPU, outside compiled graphs and `native_half_gemm()`, for a half dtype this CPU has no native
    kernels for, and only where F.linear itself would compute in that dtype (autocast's, or that of
    all three inputs)."""
    if x.device.type != "cpu" or torch.compiler.is_compiling() or _NATIVE_ONLY.get():
        return None
    if torch.is_autocast_enabled("cpu"):
        dtype = torch.get_autocast_dtype("cpu")
    elif x.dtype == weight.dtype and (bias is None or bias.dtype == x.dtype):
        dtype = x.dtype
    else:
        return None  # mixed dtypes: F.linear's own error
    native = torch.backends.mkldnn.enabled and dtype in CPU_NATIVE_HALF_GEMM
    return dtype if dtype in HALF_DTYPES and not native else None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias); on a CPU without native kernels for its half dtype, the GEMMs in fp32."""
    dtype = fp32_gemm_dtype(x, weight, bias)
    if dtype is None:
        return F.linear(x, weight, bias)
    as_half = [None if t is None else t.to(dtype) for t in (x, weight, bias)]  # autocast's casts
    return _HalfLinearInFp32.apply(*as_half)
