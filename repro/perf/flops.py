"""FLOP accounting: the paper-era analytic formulas, a direct count, and per-interval throughput.

Formulas (Narayanan et al. 2021, eq. 3; ../shared/PAPER.md §2), per iteration of B sequences:

    with activation recomputation:    96 B s l h^2 (1 + s/(6h) + V/(16 l h))
    without:                          72 B s l h^2 (1 + s/(6h) + V/(12 l h))

Derivation (forward, per layer): QKV 6Bsh^2 + scores 2Bs^2h + attention x V 2Bs^2h + output
projection 2Bsh^2 + MLP 16Bsh^2 = 24Bsh^2 (1 + s/(6h)); logits 2BshV once. Backward costs twice the
forward; recomputation adds one more forward of every layer (not of the logits). Only matrix
multiplications are counted; the full s x s score matrix is counted (no causal halving).

BERT (repro.models.bert) runs the same layers and scores every position against the vocabulary, so
it is the same formula plus its heads, which are not recomputed: the MLM head's dense layer 2Bsh^2,
the pooler 2Bh^2 and the sentence-order head 4Bh per forward (`bert_head_flops`; 0.29% of BERT-336M's total).

MFU uses the model FLOPs (72-formula: work the model needs); HFU uses the hardware FLOPs (the
96-formula when recomputing: work the device actually does). Megatron's reported TFLOP/s are HFU.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch

from repro.models.config import ModelConfig


def _terms(cfg: ModelConfig, vocab: int | None) -> tuple[int, int, int, int]:
    v = vocab if vocab is not None else cfg.padded_vocab_size(1)
    return cfg.seq_length, cfg.num_layers, cfg.hidden_size, v


def flops_per_iteration(cfg: ModelConfig, batch: int, recompute: bool, vocab: int | None = None,
                        seq: int | None = None, bert: bool = False) -> float:
    """The paper-era formula: FLOPs of one forward+backward of `batch` sequences (96- or 72-form);
    `bert` adds BERT's heads (forward and backward, never recomputed)."""
    s, l, h, v = _terms(cfg, vocab)
    s = seq or s
    heads = 3 * bert_head_flops(cfg, batch, s) if bert else 0.0
    if recompute:
        return 96.0 * batch * s * l * h * h * (1 + s / (6 * h) + v / (16 * l * h)) + heads
    return 72.0 * batch * s * l * h * h * (1 + s / (6 * h) + v / (12 * l * h)) + heads


def forward_flops(cfg: ModelConfig, batch: int, vocab: int | None = None, seq: int | None = None,
                  bert: bool = False) -> float:
    """Matmul FLOPs of one forward pass: 24 B s l h^2 (1 + s/(6h)) + 2 B s h V (+ BERT's heads)."""
    s, l, h, v = _terms(cfg, vocab)
    s = seq or s
    heads = bert_head_flops(cfg, batch, s) if bert else 0.0
    return 24.0 * batch * s * l * h * h * (1 + s / (6 * h)) + 2.0 * batch * s * h * v + heads


def bert_head_flops(cfg: ModelConfig, batch: int, seq: int | None = None) -> float:
    """Forward matmul FLOPs of BERT's heads beyond the GPT formula: MLM dense 2Bsh^2 (every position),
    pooler 2Bh^2 and sentence-order head 2Bh*2 (the [CLS] position only)."""
    s, h = seq or cfg.seq_length, cfg.hidden_size
    return 2.0 * batch * s * h * h + 2.0 * batch * h * h + 4.0 * batch * h


def elementwise_flops_estimate(cfg: ModelConfig, batch: int, seq: int | None = None) -> float:
    """Rough forward FLOPs the formula leaves out (softmax, layer norms, GeLU, residual adds, biases).

    Per layer: softmax ~5 B nh s^2, two layer norms ~16 B s h, GeLU(tanh) ~8 x 4 B s h,
    biases and residuals ~13 B s h. An order-of-magnitude figure used only to explain the gap.
    """
    s = seq or cfg.seq_length
    h, nh, l = cfg.hidden_size, cfg.num_attention_heads, cfg.num_layers
    return float(l * batch * (5 * nh * s * s + (16 + 32 + 13) * s * h))


def count_flops(model: torch.nn.Module, ids: torch.Tensor | dict, labels: torch.Tensor | None = None,
                math_attention: bool = True) -> dict[str, int]:
    """Count FLOPs of one forward+backward with torch.utils.flop_counter.FlopCounterMode: a GPT's
    `loss(ids, labels)`, or a BERT's `losses(batch)["total"]` when `ids` is its batch dict.

    FlopCounterMode counts matmuls and the CUDA SDPA kernels; the CPU flash-attention kernel is not
    registered, so `math_attention` forces SDPA's math path (explicit bmm ops) to count attention.
    """
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    backend = sdpa_kernel(SDPBackend.MATH) if math_attention else nullcontext()
    with backend:
        with FlopCounterMode(display=False) as fwd:
            loss = model.losses(ids)["total"] if isinstance(ids, dict) else model.loss(ids, labels).mean()
        with FlopCounterMode(display=False) as bwd:
            loss.backward()
    return {"forward": fwd.get_total_flops(), "backward": bwd.get_total_flops(),
            "total": fwd.get_total_flops() + bwd.get_total_flops()}


def throughput(cfg: ModelConfig, batch_tokens: int, seconds: float, world_size: int = 1,
               device_name: str = "cpu", dtype: str = "bf16", recompute: bool = False,
               peak_tflops: float | None = None, bert: bool = False, tp: int = 1) -> dict[str, float]:
    """Tokens/s, TFLOP/s per device (model and hardware) and MFU/HFU for one logging interval.

    `batch_tokens` is the number of tokens processed by all devices in `seconds` (all ranks of the
    world; with tensor parallelism the same tokens count once per TP group, pass the global count).
    The logits count the vocabulary as padded for `tp` ranks, the rows the model computes, as
    Megatron-LM's count does (GPT-2's 50,257 ids: 50,304 rows at TP = 1, 2, 4 or 8, 50,560 at TP = 5).
    """
    from repro.perf.peaks import peak_tflops as lookup_peak

    seqs, vocab = batch_tokens / cfg.seq_length, cfg.padded_vocab_size(tp)
    model = flops_per_iteration(cfg, 1, recompute=False, vocab=vocab, bert=bert) * seqs
    hardware = flops_per_iteration(cfg, 1, recompute=recompute, vocab=vocab, bert=bert) * seqs
    per_dev = 1e12 * seconds * world_size
    peak = peak_tflops if peak_tflops is not None else lookup_peak(device_name, dtype)
    out = {"tokens_per_s": batch_tokens / seconds, "model_tflops_per_device": model / per_dev,
           "hardware_tflops_per_device": hardware / per_dev, "peak_tflops": peak}
    out["mfu"] = out["model_tflops_per_device"] / peak if peak else float("nan")
    out["hfu"] = out["hardware_tflops_per_device"] / peak if peak else float("nan")
    return out
