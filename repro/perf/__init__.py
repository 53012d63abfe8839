"""Performance accounting: FLOPs and MFU, benchmarks, memory, and an analytic scaling model."""
