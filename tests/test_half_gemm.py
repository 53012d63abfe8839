"""repro.parallel.half_gemm.linear: half-precision GEMMs computed in fp32 on CPUs without native kernels.

Turning oneDNN off (`torch.backends.mkldnn.enabled = False`) takes its half kernels away on any CPU, so the fp32
path runs here for both dtypes whatever the machine has. Reference: the same linear in float64 with
the inputs in the half dtype, rounded once to it. A half GEMM that accumulates in fp32 (a GPU's, or
oneDNN's) is within one unit in the last place of that: products of half inputs are exact in fp32 and
a sum of under 50 of them is off by at most ~2^-18 relative, far below a half ulp (2^-8 in bf16, 2^-11 in
fp16), so only the final rounding can differ.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F

from repro.parallel.half_gemm import CPU_NATIVE_HALF_GEMM, HALF_DTYPES, fp32_gemm_dtype, linear, native_half_gemm



@contextlib.contextmanager
def onednn(enabled: bool):
    """torch.backends.mkldnn.flags(enabled=...) without its TF32 setting (and that setting's warning)."""
    before = torch.backends.mkldnn.enabled
    torch.backends.mkldnn.enabled = enabled
    try:
        yield
    finally:
        torch.backends.mkldnn.enabled = before


def no_native_half_kernels():
    return onednn(False)


def _inputs(dtype, m=24, k=48, n=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, m // 2, k, generator=g).to(dtype).requires_grad_()
    w = (torch.randn(n, k, generator=g) * 0.1).to(dtype).requires_grad_()
    b = torch.randn(n, generator=g).to(dtype).requires_grad_()
    grad_y = torch.randn(2, m // 2, n, generator=g).to(dtype)
    return x, w, b, grad_y


def _one_ulp(reference: torch.Tensor, dtype: torch.dtype) -> dict:
    """assert_close tolerances of one unit in the last place of `dtype` (plus a floor near zero)."""
    return {"rtol": torch.finfo(dtype).eps, "atol": torch.finfo(dtype).eps * reference.abs().max().item() / 64}


def _float64_reference(x, w, b, grad_y):
    x64, w64, b64 = (t.detach().double().requires_grad_() for t in (x, w, b))
    y = F.linear(x64, w64, b64)
    y.backward(grad_y.double())
    return y, x64.grad, w64.grad, b64.grad


@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=str)
def test_forward_and_gradients_are_the_float64_result_rounded_once(dtype):
    x, w, b, grad_y = _inputs(dtype)
    with no_native_half_kernels():
        assert fp32_gemm_dtype(x, w, b) == dtype
        y = linear(x, w, b)
        y.backward(grad_y)
    for got, want in zip((y, x.grad, w.grad, b.grad), _float64_reference(x, w, b, grad_y)):
        assert got.dtype == dtype and got.shape == want.shape
        torch.testing.assert_close(got.double(), want, **_one_ulp(want, dtype))


@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=str)
def test_autograd_keeps_the_half_inputs_not_float32_copies(dtype):
    x, w, b, _ = _inputs(dtype)
    saved = []
    with no_native_half_kernels(), torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        linear(x, w, b)
    assert [(t.dtype, tuple(t.shape)) for t in saved] == [(dtype, tuple(x.shape)), (dtype, tuple(w.shape))]


@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=str)
def test_autocast_over_float32_weights_is_emulated_with_its_casts(dtype):
    """Autocast rounds x, w and b to the half dtype before its GEMM and returns half; the fp32
    weights get fp32 gradients. Same values as the native autocast computes (both are one rounding of
    the same half-input products)."""
    x, w, b, grad_y = (t.detach().float().requires_grad_(t.requires_grad) for t in _inputs(dtype))
    results = {}
    for native in (True, False):
        for t in (x, w, b):
            t.grad = None
        with onednn(native), torch.autocast("cpu", dtype=dtype):
            assert fp32_gemm_dtype(x, w, b) == (None if native and dtype in CPU_NATIVE_HALF_GEMM else dtype)
            y = linear(x, w, b)
        y.backward(grad_y.to(dtype))
        results[native] = [y, x.grad, w.grad, b.grad]
    emulated, native = results[False], results[True]
    assert [t.dtype for t in emulated] == [dtype, torch.float32, torch.float32, torch.float32]
    for got, want in zip(emulated, native):
        assert got.dtype == want.dtype
        torch.testing.assert_close(got.double(), want.double(), **_one_ulp(want.double(), dtype))


def test_float32_mixed_dtypes_and_native_kernels_go_to_f_linear_unchanged():
    x32, w32 = torch.randn(3, 4), torch.randn(5, 4)
    with no_native_half_kernels():
        assert fp32_gemm_dtype(x32, w32, None) is None
        torch.testing.assert_close(linear(x32, w32), F.linear(x32, w32), rtol=0, atol=0)
        with pytest.raises(RuntimeError, match="dtype"):  # F.linear's own error for bf16 x with fp32 w
            linear(x32.bfloat16(), w32)
    with onednn(True):
        for dtype in CPU_NATIVE_HALF_GEMM:
            assert fp32_gemm_dtype(x32.to(dtype), w32.to(dtype), None) is None


def test_native_half_gemm_turns_the_fp32_path_off_for_its_extent():
    """For memory measurements that stand for a GPU's (repro.perf.plan_check)."""
    x, w, b, _ = _inputs(torch.float16)
    with no_native_half_kernels():
        with native_half_gemm():
            assert fp32_gemm_dtype(x, w, b) is None
            assert type(linear(x, w, b).grad_fn).__name__ == "ViewBackward0"  # F.linear: addmm, then a view to 3-D
        assert type(linear(x, w, b).grad_fn).__name__ == "_HalfLinearInFp32Backward"
        assert fp32_gemm_dtype(x, w, b) == torch.float16


def test_a_compiled_graph_keeps_the_native_half_linear():
    """Compiled graphs are what a GPU runs (and what repro.perf.compiled_buffers reads): no fp32 path."""
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    x, w, b, _ = _inputs(torch.bfloat16)
    with no_native_half_kernels():
        y = torch.compile(linear, backend=capture, fullgraph=True)(x, w, b)
    assert y.dtype == torch.bfloat16
    code = graphs[0].code
    assert "linear" in code and "float32" not in code and "Function" not in code, code
