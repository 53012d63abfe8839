"""Activation memory of this project's GPT: what the backward keeps, by formula and by direct count.

Per transformer layer and TP rank, with b micro-batch sequences of s tokens, hidden h, a heads, TP
degree t (bytes per element: r residual stream, c compute, m dropout mask; tensors as saved by
repro.models.gpt on torch 2.13):

    replicated:  b s h (2 r + 2 c + 2 m) + 4 b s f      layer-norm inputs (the residual stream) and
                                                        outputs (the QKV and MLP matmul inputs), the
                                                        two hidden-dropout masks (none at hidden
                                                        dropout 0: torch then returns its input),
                                                        LN mean and rstd (f)
    sharded:     b s h (4 c + 8 c) / t                  QKV (q, k, v share one buffer) and the attention
                                                        output; GeLU input and output (4h wide each)
               + b a s 4 / t                            fused attention: the fp32 log-sum-exp
               or (b s h (3 x 4 - 3 c) + b a s^2 3 x 4) / t  math attention (CPU with attention dropout):
                                                        fp32 q, k, v, softmax, dropped probabilities
                                                        and mask, whatever the input dtype

Outside the layers: the embedding's dropout mask (and, at t > 1, its mask of ids outside this
rank's vocabulary slice), the final layer norm's input and output, the
fp32 softmax the vocab-parallel cross-entropy keeps (b s V/t x 4), token ids. Under autocast
(`precision.params: fp32` with bf16/fp16) every matmul weight is also kept as a half copy until
the backward: 2 bytes per matrix parameter. With activation checkpointing a layer keeps only its
input (b s h r), its full set is rebuilt once in the backward, and autograd keeps only the output
layer's half weight; the layers' half weights live in torch's autocast cache until the forward ends.

The backward adds gradients before it frees activations (peaks the tests hold to measured ones):
- its first steps (`backward_start_bytes`): the cross-entropy's gradient is the softmax's own
  buffer, but half logits get a copy in their dtype; on the rank holding padded vocab columns the
  -inf fill's backward makes a new gradient of the logits; the output layer makes its weight and
  input gradients; BERT's pooler first adds a gradient of the whole last hidden state (zeros but
  for [CLS]) and its head's weight gradients;
- each layer's first steps (`layer_backward_bytes`): the incoming gradient, the hidden dropout's
  (less the mask it frees; its cast under autocast) and the MLP output matmul's input and weight
  gradients;
- checkpointing, rebuilding a layer (`rebuilt_bytes`) allocates its full set but its input (the
  checkpoint keeps it), with its half weights under autocast; as the top layer, the first the
  backward reaches, is rebuilt, the tied output layer's weight gradient waits for the embedding's.

These follow the eager backward; a compiled step's differ (it fuses the cross-entropy's gradient
with the cast, for one) and are planned as the eager ones.

Dtypes: on CUDA a dropout mask is a bool (1 byte) and attention is fused (flash or memory-efficient
SDPA); on CPU a mask has its input's dtype and SDPA falls back to the math kernel when attention
dropout is on. Layer-norm statistics are fp32 on CUDA and in the input dtype on CPU.

`count_saved_bytes` counts what autograd actually keeps (every distinct storage handed to a
saved-tensor hook, parameters excluded); the tests hold the formula to it exactly on small models.
"""

from __future__ import annotations

import ctypes
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from repro.models.config import ModelConfig


@dataclass(frozen=True)
class ActivationDtypes:
    """Bytes per element of what the backward keeps."""

    residual: int  # the residual stream: layer inputs, layer-norm inputs
    compute: int  # matmul inputs, attention tensors, GeLU input and output
    mask: int  # one hidden-dropout mask element
    stats: int  # layer-norm mean and rstd
    autocast: bool  # half copies of the matmul weights are kept until the backward
    half_norm: int  # a layer norm's saved copy of a compute-dtype input (CUDA autocast runs it in fp32)

    @classmethod
    def of(cls, precision: str, params: str, device_type: str) -> "ActivationDtypes":
        """The dtypes a run with `precision` (fp32/bf16/fp16) and `params` (fp32/half) keeps."""
        cuda = device_type == "cuda"
        if precision == "fp32":
            return cls(4, 4, 1 if cuda else 4, 4, False, 4)
        if params == "half":
            return cls(2, 2, 1 if cuda else 2, 4 if cuda else 2, False, 2)
        return cls(4, 2, 1 if cuda else 4, 4, True, 4 if cuda else 2)  # autocast: fp32 residual, half matmuls


@dataclass(frozen=True)
class ActivationMemory:
    """Bytes one TP rank keeps for the backward of one micro batch, by part."""

    layers: int  # all transformer layers as kept (their inputs only, when checkpointing)
    outside_layers: int  # embedding, final layer norm, cross-entropy softmax, ids
    autocast_weights: int  # half copies of matmul weights autograd keeps (autocast only)
    autocast_cache: int  # the other half copies, alive until the forward ends (autocast only)
    rebuilt_layer: int  # one layer's set rebuilt in the backward, less its kept input (checkpointing only)
    backward_start: int = 0  # the loss's and output layer's gradients, before any layer's are freed
    layer_backward: int = 0  # a layer's first backward step: its incoming and the MLP output matmul's gradients
    rebuilding: int = 0  # as the top layer is rebuilt: the layers' inputs, the embedding's, that layer's set,
    # its first backward step and the tied output layer's weight gradient (checkpointing only; the loss's
    # and final norm's are freed by then)
    embedding: int = 0  # the embedding's saved tensors (part of outside_layers; BERT post-LN: with its layer
    # norm's), alive to the backward's end

    @property
    def kept(self) -> int:
        """What autograd holds when the forward ends."""
        return self.layers + self.outside_layers + self.autocast_weights


def math_attention(device_type: str, attention_dropout: float) -> bool:
    """Whether SDPA runs its unfused math kernel (saves s x s tensors): CPU with attention dropout."""
    return device_type != "cuda" and attention_dropout > 0


def hidden_mask(cfg: ModelConfig, dt: ActivationDtypes) -> int:
    """Bytes per element of a hidden-dropout mask: none at dropout 0, where torch returns the input."""
    return dt.mask if cfg.hidden_dropout > 0 else 0


def backward_start_bytes(cfg: ModelConfig, batch: int, tp: int, dt: ActivationDtypes, bert: bool = False) -> int:
    """Bytes beyond what autograd keeps, at the most, in the backward's first steps: the vocab-parallel
    cross-entropy's gradient (the fp32 softmax's buffer, kept) through the output layer, on the TP rank
    holding padded vocab columns (the larger), before any transformer layer's activations are freed.

    Step by step (e logits' bytes, S = b s V/t x 4 the fp32 gradient, kept): half logits get the
    gradient cast to their dtype beside S, then S is freed; the padded columns' -inf fill (GPT's in place,
    BERT's masked_fill) makes a new gradient of the logits beside the incoming one (GPT also clones and
    zeroes the padded slice); the output layer makes its weight and input gradients (and, under
    autocast, the weight's fp32 copy) beside the logits' gradient. BERT's pooler runs first: a
    gradient of the whole last hidden state (zeros but for [CLS]) and its head's weight gradients,
    alive through the rest."""
    b, s, h = batch, cfg.seq_length, cfg.hidden_size
    vocab = cfg.padded_vocab_size(tp)
    local, padded = vocab // tp, min(vocab - cfg.vocab_size, vocab // tp)
    e, half = dt.compute, dt.compute < 4
    logits_grad, fp32_grad = b * s * local * e, b * s * local * 4
    incoming = logits_grad - fp32_grad if half else 0  # the incoming gradient's bytes beyond S
    pooler = b * s * h * dt.residual + (h * h + 3 * h + 2) * dt.residual if bert else 0
    padded_slice = 0 if bert else 2 * b * s * padded * e  # GPT's clone and zeros of the padded columns
    fill = incoming + pooler + logits_grad + padded_slice if padded else 0
    weights = local * h * (e + (4 if dt.autocast else 0))
    output_layer = incoming + pooler + weights + b * s * h * e
    return max(logits_grad if half else 0, fill, output_layer, 0)


def layer_backward_bytes(cfg: ModelConfig, batch: int, tp: int, dt: ActivationDtypes) -> int:
    """Bytes a transformer layer's backward adds in its first steps beside the layer's activations:
    the gradient coming in (b s h r; the post-LN order's final layer norm adds its own) and the
    hidden dropout's (b s h r, less the mask it frees), then the MLP output matmul's weight gradient
    (4h h/t c) and input gradient (b s 4h/t c), the matmul's output gradient alive with them. Under
    autocast the fp32 bias made that output fp32: its gradient is cast to c (b s h c) and the
    dropout's freed before the matmul; the weight gradient's fp32 copy (4h h/t 4) comes after the
    matmul frees the cast and its saved input (the size of the input gradient)."""
    b, s, h = batch, cfg.seq_length, cfg.hidden_size
    incoming = b * s * h * dt.residual * (2 if cfg.layernorm_order == "post" else 1)
    dropout = b * s * h * (dt.residual - hidden_mask(cfg, dt)) if cfg.hidden_dropout > 0 else 0
    weight_grad, input_grad = 4 * h * h // tp * dt.compute, b * s * 4 * h // tp * dt.compute
    if not dt.autocast:
        return incoming + dropout + weight_grad + input_grad
    cast, fp32_copy = b * s * h * dt.compute, 4 * h * h // tp * 4
    return incoming + max(dropout + cast, weight_grad + max(cast + input_grad, fp32_copy))


def rebuilt_bytes(full_layer: int, cfg: ModelConfig, batch: int, tp: int, dt: ActivationDtypes) -> int:
    """What rebuilding one layer allocates: its full set less its input, which the checkpoint already
    keeps (the first layer norm, or post-LN the QKV matmul, saves that same tensor unless autocast
    casts it first); under autocast, the half copies of the layer's matrices its matmuls save."""
    h = cfg.hidden_size
    shared = cfg.layernorm_order == "pre" or not dt.autocast
    input_bytes = batch * cfg.seq_length * h * dt.residual if shared else 0
    return full_layer - input_bytes + (12 * h * h // tp * dt.compute if dt.autocast else 0)


def _backward_fields(cfg: ModelConfig, batch: int, tp: int, dt: ActivationDtypes, recompute: bool, full_layer: int,
                     layers: int, embedding: int, bert: bool = False) -> dict[str, int]:
    """ActivationMemory's backward parts (see the module's docstring)."""
    rebuilt, layer_backward = rebuilt_bytes(full_layer, cfg, batch, tp, dt), layer_backward_bytes(cfg, batch, tp, dt)
    # in the parameters' dtype (the residual stream's in every recipe); it waits for the embedding's
    tied_grad = cfg.padded_vocab_size(tp) * cfg.hidden_size // tp * dt.residual
    return {"rebuilt_layer": rebuilt if recompute else 0,
            "backward_start": backward_start_bytes(cfg, batch, tp, dt, bert), "layer_backward": layer_backward,
            "rebuilding": layers + embedding + rebuilt + layer_backward + tied_grad if recompute else 0,
            "embedding": embedding}


def layer_bytes(cfg: ModelConfig, batch: int, tp: int, dt: ActivationDtypes, math: bool) -> int:
    """Bytes one TP rank keeps for one transformer layer's backward (no checkpointing)."""
    b, s, h, a = batch, cfg.seq_length, cfg.hidden_size, cfg.num_attention_heads
    replicated = b * s * h * (2 * dt.residual + 2 * dt.compute + 2 * hidden_mask(cfg, dt)) + 4 * b * s * dt.stats
    mlp = b * s * h * 8 * dt.compute
    if math:  # fp32 copies of q, k, v and fp32 scores whatever the input dtype; the output cast back
        attention = b * s * h * (3 * 4 + dt.compute) + b * a * s * s * 3 * 4
    else:
        attention = b * s * h * 4 * dt.compute + b * a * s * 4
    return replicated + (mlp + attention) // tp


def activation_memory(cfg: ModelConfig, batch: int, tp: int, dt: ActivationDtypes, math: bool = False,
                      recompute: bool | None = None) -> ActivationMemory:
    """Activation bytes per TP rank for one micro batch of `batch` sequences of this GPT."""
    recompute = cfg.activation_checkpointing if recompute is None else recompute
    b, s, h, l = batch, cfg.seq_length, cfg.hidden_size, cfg.num_layers
    vocab = cfg.padded_vocab_size(tp)
    full_layer = layer_bytes(cfg, batch, tp, dt, math)
    layers = l * b * s * h * dt.residual if recompute else l * full_layer
    embedding = 8 * b * s + 8 * s + b * s * h * hidden_mask(cfg, dt) + (b * s if tp > 1 else 0)  # tp > 1: ids off this slice
    final_norm = b * s * h * (dt.residual + dt.compute) + 2 * b * s * dt.stats
    loss = b * s * vocab // tp * 4 + b * s + 8 * b * s  # fp32 softmax, outside-slice mask, local targets
    layer_matrices = l * 12 * h * h // tp * (dt.compute if dt.autocast else 0)
    output_matrix = vocab * h // tp * (dt.compute if dt.autocast else 0)
    return ActivationMemory(layers=layers, outside_layers=embedding + final_norm + loss,
                            autocast_weights=output_matrix + (0 if recompute else layer_matrices),
                            autocast_cache=layer_matrices if recompute else 0,
                            **_backward_fields(cfg, batch, tp, dt, recompute, full_layer, layers, embedding))


def bert_activation_memory(cfg: ModelConfig, batch: int, tp: int, dt: ActivationDtypes, math: bool = False,
                           recompute: bool | None = None) -> ActivationMemory:
    """Activation bytes per TP rank for one micro batch of repro.models.bert.BERT with its MLM and
    SOP heads: GPT's layers (either layer-norm order keeps the same bytes) plus the additive
    attention mask SDPA makes of the padding mask in each layer (b s c); outside the layers the
    token types, an embedding layer norm (original order) or a final one (rearranged), the MLM
    head over every position (dense input, GeLU input, layer-norm input in fp32 under autocast,
    output-layer input), its fp32 softmax, the pooler and the SOP head."""
    recompute = cfg.activation_checkpointing if recompute is None else recompute
    b, s, h, l = batch, cfg.seq_length, cfg.hidden_size, cfg.num_layers
    vocab = cfg.padded_vocab_size(tp)
    full_layer = layer_bytes(cfg, batch, tp, dt, math) + (0 if math else b * s * dt.compute)
    layers = l * b * s * h * dt.residual + b * s if recompute else l * full_layer  # + the bool padding mask
    embedding = 16 * b * s + 8 * s + b * s * h * hidden_mask(cfg, dt) + (b * s if tp > 1 else 0)
    norm = b * s * h * dt.residual + 2 * b * s * dt.stats  # the embedding's (post) or the final one (pre)
    mlm_head = b * s * h * (3 * dt.compute + dt.half_norm) + 2 * b * s * dt.stats
    loss = b * s * vocab // tp * 4 + b * s + 8 * b * s + 4 * b * s  # softmax, outside mask, targets, predicted
    padded_rows = vocab // tp if cfg.vocab_size < vocab else 0  # the -inf fill's mask (bool)
    sop = b * h * dt.compute * (2 if dt.autocast else 1) + 16 * b + 8  # tanh (and its input's half copy)
    head_matrices = (2 * h * h + 2 * h) * dt.compute if dt.autocast else 0  # MLM dense, pooler, SOP
    output_matrix = vocab * h // tp * (dt.compute if dt.autocast else 0)
    layer_matrices = l * 12 * h * h // tp * (dt.compute if dt.autocast else 0)
    outside = embedding + norm + mlm_head + loss + padded_rows + sop
    return ActivationMemory(layers=layers, outside_layers=outside,
                            autocast_weights=head_matrices + output_matrix + (0 if recompute else layer_matrices),
                            autocast_cache=layer_matrices if recompute else 0,
                            **_backward_fields(cfg, batch, tp, dt, recompute, full_layer, layers,
                                               embedding + (norm if cfg.layernorm_order == "post" else 0), bert=True))


def count_saved_bytes(module: torch.nn.Module, run) -> int:
    """Bytes of the distinct storages autograd saves while `run()` executes, parameters excluded."""
    params = {p.untyped_storage().data_ptr() for p in module.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            saved.setdefault(storage.data_ptr(), storage.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = run()
    del out
    return sum(saved.values())


def peak_bytes_during(run, device: torch.device = torch.device("cpu")) -> tuple[int, int]:
    """(bytes allocated when `run()` starts, highest bytes allocated while it runs) on `device`.

    CUDA: torch.cuda's allocator statistics. CPU, which has no peak counter: c10's running total of
    CPU allocations at each allocation and free torch.profiler records, less the total when `run()`
    starts (CPU blocks allocated before `run()` are not seen, so the start is 0: build what is
    measured inside `run`). The total counts frees on every thread (see `_cpu_frees_on_every_thread`).
    """
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        start = torch.cuda.memory_allocated(device)
        run()
        torch.cuda.synchronize(device)
        return start, torch.cuda.max_memory_allocated(device)
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with _cpu_frees_on_every_thread() as every_thread, profile(activities=[ProfilerActivity.CPU],
                                                                 profile_memory=True) as prof:
        run()
    events = [e.typed[1] for e in sorted(_walk(prof.profiler.kineto_results.experimental_event_tree()),
                                         key=lambda e: e.start_time_ns)
              if e.typed[0] == _EventType.Allocation and e.typed[1].device.type == "cpu"]
    if not events:
        return 0, 0
    if every_thread:
        start = events[0].total_allocated - events[0].alloc_size
        return 0, max(0, max(e.total_allocated for e in events) - start)
    current = peak = 0
    for event in events:
        current += event.alloc_size
        peak = max(peak, current)
    return 0, peak


@contextmanager
def _cpu_frees_on_every_thread():
    """Yields whether c10 counts CPU frees on every thread while the block runs.

    The profiler records a free only on a thread it profiles, and so does c10's running total,
    unless FLAGS_caffe2_report_cpu_memory_usage is set. gloo's worker thread holds a collective's
    Work, and with it its buffer, a moment past the wait: when it drops the last reference, the
    free was lost and the peak came out a whole buffer too high (DeepSpeed's flat gradient bucket,
    on 1 rank in 12 on 2 busy cores). The flag is set through its exported symbol in libc10;
    without it (another torch build), a warning and the profiled threads' running sum.
    """
    try:
        flag = ctypes.c_bool.in_dll(ctypes.CDLL(str(_libc10())), "FLAGS_caffe2_report_cpu_memory_usage")
    except (OSError, ValueError) as err:
        warnings.warn(f"CPU frees on threads the profiler does not record (gloo's) are not counted: {err}",
                      stacklevel=3)
        yield False
        return
    before = flag.value
    flag.value = True
    try:
        yield True
    finally:
        flag.value = before


def _libc10() -> Path:
    lib = Path(torch.__file__).parent / "lib"
    return next(lib.glob("libc10.*"), lib / "libc10.so")


def _walk(nodes):
    for node in nodes:
        yield node
        yield from _walk(node.children)
