"""Where the GPU waits: idle gaps between kernels in a torch.profiler chrome trace, by the host op
that launched the kernel after each gap.

A step whose kernels add up to less than its wall time leaves the GPU idle in between. A gap whose
next kernel was launched after the GPU had gone idle is the host's (Python, dispatch, a hook, a
sync); one whose kernel was queued before is the device's own (a dependency, an event wait). The
summary sums gap time per launching host op, so the few ops that starve the GPU stand out.
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from dataclasses import dataclass

DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


@dataclass
class GapSummary:
    span_us: float
    busy_us: float
    host_gap_us: float
    device_gap_us: float
    by_host_op: list[tuple[str, float, int]]
    """(launching host op, gap microseconds, gaps), largest first."""

    def text(self, top: int = 15) -> str:
        idle = self.span_us - self.busy_us
        lines = [f"GPU timeline {self.span_us / 1e3:.1f} ms: busy {self.busy_us / 1e3:.1f} ms, idle {idle / 1e3:.1f} ms "
                 f"({100 * idle / max(self.span_us, 1e-9):.1f}%): {self.host_gap_us / 1e3:.1f} ms waiting for the host "
                 f"to launch, {self.device_gap_us / 1e3:.1f} ms with work queued", "",
                 "idle ms before kernels launched late, by launching host op:"]
        lines += [f"{us / 1e3:9.2f} ms  x{n:<5} {name[:100]}" for name, us, n in self.by_host_op[:top]]
        return "\n".join(lines) + "\n"


def _host_op_at(ops: list[dict], starts: list[float], ts: float, lookback: int = 5000) -> str:
    """'outermost > innermost' host op (cpu_op event) whose span holds `ts`."""
    last = bisect.bisect_right(starts, ts) - 1
    holding = [ops[i] for i in range(last, max(-1, last - lookback), -1)
               if ops[i]["ts"] + ops[i].get("dur", 0) >= ts]
    if not holding:
        return "(no host op)"
    outer, inner = holding[-1]["name"], holding[0]["name"]
    return outer if outer == inner else f"{outer} > {inner}"


def gap_summary(trace: dict, min_gap_us: float = 2.0) -> GapSummary:
    """Idle gaps of the GPU in a chrome trace (torch.profiler's export_chrome_trace)."""
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    device = sorted((e for e in events if e.get("ph") == "X" and e.get("cat") in DEVICE_CATEGORIES),
                    key=lambda e: e["ts"])
    if not device:
        raise ValueError("the trace holds no GPU kernels: profile with ProfilerActivity.CUDA on a GPU")
    launches = {e["args"]["correlation"]: e for e in events
                if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}
    ops = sorted((e for e in events if e.get("ph") == "X" and e.get("cat") == "cpu_op"), key=lambda e: e["ts"])
    starts = [op["ts"] for op in ops]
    busy = host = queued = 0.0
    by_op: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    end = device[0]["ts"]
    for e in device:
        gap = e["ts"] - end
        if gap > min_gap_us:
            launch = launches.get(e.get("args", {}).get("correlation"))
            if launch is not None and launch["ts"] > end:  # launched after the GPU went idle
                host += gap
                name = _host_op_at(ops, starts, launch["ts"])
                by_op[name][0] += gap
                by_op[name][1] += 1
            else:
                queued += gap
        busy += max(0.0, e["ts"] + e["dur"] - max(end, e["ts"]))
        end = max(end, e["ts"] + e["dur"])
    ranked = sorted(((k, v[0], int(v[1])) for k, v in by_op.items()), key=lambda x: -x[1])
    return GapSummary(end - device[0]["ts"], busy, host, queued, ranked)
