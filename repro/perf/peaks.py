"""Peak dense TFLOP/s of the accelerators this project targets, by dtype, and MFU against them.

All values are dense (no 2:4 sparsity), boost clock, from NVIDIA's datasheets:
  V100:  "NVIDIA Tesla V100 GPU Accelerator" datasheet (SXM2: 125 fp16 tensor, 15.7 fp32;
         PCIe: 112 / 14). The paper calls its 39 TFLOP/s baseline "30% of peak" without the peak:
         125 gives 31%; the DGX-2H's 450 W V100 SXM3 is rated 2.1 PFLOP/s / 16 = 131 (30%). Issue 9
         sets 125 for the DGX-2H, as here.
  A100:  "NVIDIA A100 Tensor Core GPU" datasheet: 312 bf16/fp16, 156 tf32, 19.5 fp32 (SXM and PCIe).
  H100:  "NVIDIA H100 Tensor Core GPU" datasheet: SXM 989 bf16/fp16, 494.7 tf32, 66.9 fp32;
         PCIe 756 / 378 / 51.2; NVL 835 / 417.5 / 60 (the datasheet's sparse figures halved).
  H200:  "NVIDIA H200 Tensor Core GPU" datasheet: SXM 989 / 494 / 67; NVL 835 / 417.5 / 60.
On CPU there is no datasheet value: `measure_cpu_peak` times a float32 matmul.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class DevicePeak:
    """Peak dense TFLOP/s of one device by dtype ("fp16", "bf16", "tf32", "fp32")."""

    name: str
    patterns: tuple[str, ...]  # all must occur in the lower-cased torch device name
    tflops: dict[str, float] = field(default_factory=dict)
    source: str = ""


def _peaks(name, patterns, half, tf32, fp32, source) -> DevicePeak:
    table = {"fp16": half, "bf16": half, "fp32": fp32}
    if tf32 is not None:
        table["tf32"] = tf32
    else:  # V100: no bf16 or tf32 tensor cores; bf16 runs at fp32 speed
        table["bf16"] = fp32
    return DevicePeak(name, patterns, table, source)


_V100 = "NVIDIA Tesla V100 datasheet"
_A100 = "NVIDIA A100 Tensor Core GPU datasheet"
_H100 = "NVIDIA H100 Tensor Core GPU datasheet"
_H200 = "NVIDIA H200 Tensor Core GPU datasheet"

# Most specific first: the first entry whose patterns all match a device name wins.
PEAKS: tuple[DevicePeak, ...] = (
    _peaks("H200 NVL", ("h200", "nvl"), 835.0, 417.5, 60.0, _H200),
    _peaks("H200 SXM", ("h200",), 989.0, 494.0, 67.0, _H200),
    _peaks("H100 NVL", ("h100", "nvl"), 835.0, 417.5, 60.0, _H100),
    _peaks("H100 PCIe", ("h100", "pcie"), 756.0, 378.0, 51.2, _H100),
    _peaks("H100 SXM", ("h100",), 989.0, 494.7, 66.9, _H100),
    _peaks("A100", ("a100",), 312.0, 156.0, 19.5, _A100),
    _peaks("V100S PCIe", ("v100s",), 130.0, None, 16.4, _V100),
    _peaks("V100 PCIe", ("v100", "pcie"), 112.0, None, 14.0, _V100),
    _peaks("V100 SXM", ("v100",), 125.0, None, 15.7, _V100),
)

DTYPE_NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}


def dtype_name(dtype: torch.dtype | str) -> str:
    """torch.bfloat16 -> "bf16"; strings pass through lower-cased ("float16" -> "fp16")."""
    if isinstance(dtype, torch.dtype):
        return DTYPE_NAMES[dtype]
    aliases = {"float16": "fp16", "half": "fp16", "bfloat16": "bf16", "float32": "fp32", "float": "fp32"}
    return aliases.get(dtype.lower(), dtype.lower())


def match_device(device_name: str) -> DevicePeak | None:
    """The table entry for a torch device name ("NVIDIA H100 80GB HBM3" -> H100 SXM), or None."""
    lowered = device_name.lower()
    for entry in PEAKS:
        if all(p in lowered for p in entry.patterns):
            return entry
    return None


def measure_cpu_peak(size: int = 1024, repeats: int = 5, dtype: torch.dtype = torch.float32) -> float:
    """Best achieved TFLOP/s of a size^3 matmul on this CPU with the current thread count."""
    a = torch.randn(size, size, dtype=dtype)
    b = torch.randn(size, size, dtype=dtype)
    torch.mm(a, b)  # warm-up: allocator and BLAS dispatch
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - start)
    return 2.0 * size**3 / best / 1e12


def peak_tflops(device_name: str, dtype: torch.dtype | str = "bf16") -> float | None:
    """Peak dense TFLOP/s of a device for a dtype; CPU is measured (fp32 matmul); unknown -> None."""
    if device_name.lower() == "cpu":
        return measure_cpu_peak()
    entry = match_device(device_name)
    return entry.tflops.get(dtype_name(dtype)) if entry else None


def mfu(tflops: float, device_name: str, dtype: torch.dtype | str = "bf16") -> float | None:
    """Achieved TFLOP/s as a fraction of the device's peak for the dtype (None if unknown)."""
    peak = peak_tflops(device_name, dtype)
    return tflops / peak if peak else None
