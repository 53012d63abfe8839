"""`repro plan`: memory per GPU and time to train of a run config on a described cluster, before launch.

Memory per rank, in the phases of a training step (n = parameters of one TP rank):

    forward/backward:  weights + masters + optimizer + gradient buffers + gradients + activations
                       (+ DeepSpeed's reduce buckets)
    DP reduction:      weights + masters + optimizer + reduce buckets + gradients at the reduction (DeepSpeed)
    optimizer step:    weights + masters + optimizer + gradient buffers + gradients

- weights: n x 4 (fp32, autocast) or n x 2 (`precision.params: half`); masters: n x 4 (half only);
  optimizer: Adam's m and v, n x 8 (the trainer's fused AdamW: no temporaries).
- gradients: `.grad` in the parameter dtype, set to None when a step starts, so they exist in the
  forward only when accumulating over micro batches, and in the backward as it makes them (below);
  a half model's step gives its masters fp32 `.grad` (n x 4). Gradient buffers live all run: torch DDP's buckets (dp > 1; the `.grad` are
  views of them, except while micro batches accumulate under no_sync()) or the fp32 main-gradient
  buffer (`main_grads: fp32`, n x 4, the masters' `.grad`). With fp32 main grads, the half gradients
  of a MainGrads bucket wait in the backward until the bucket is complete: up to one bucket's worth
  eager (2 x the largest bucket's elements: 2^24, or a larger parameter alone), all of them (n x 2)
  when the whole step is compiled (its backward hands every gradient over at its end).
- activations: repro.perf.activations for one micro batch, at the larger of: what autograd keeps
  when the forward ends, plus the most of torch's autocast weight cache and the half logits beside
  the cross-entropy's fp32 copy (while the forward runs) or the backward's first gradients (the
  logits' and the output layer's); checkpointing, the layer inputs as the backward rebuilds the
  top layer (its first), with that layer's first backward step.
- near the backward's end, gradients pile up as the activations are freed: the backward holds the
  larger of the activation peak and the gradients made so far beside the embedding's and the bottom
  layer's activations (its input and rebuild, checkpointing) and its first backward step. Those
  gradients: every `.grad` but the bottom layer's and the position (and token-type) embeddings' on
  one rank without DDP's buckets; ZeRO-1's p.grad until its reduction at the backward's end (fp16
  with fp32 main grads: their fp32 sums; none with overlap_comm or ZeRO-2, which move each into
  the reduce bucket as it is made; BF16_Optimizer: the same in bf16); MainGrads' waiting half
  gradients (fp32 main grads). Not counted: CPU-only transients of the math SDPA kernel's forward
  and of bf16 matmuls (a packed copy of the weight), which make the measured peaks of checkpointed
  bf16 models on CPU up to 2% higher than planned.
- DeepSpeed ZeRO-1/2: repro.perf.memory's partitioned weights, gradients and optimizer state (a half
  model unless precision is fp32), the fp32 gradients of this rank's partition in the step, the same
  activations, and its gradient-reduction (IPG) buffer: torch.empty(reduce_bucket_size) elements in the
  model's dtype (repro.train.engine.deepspeed_config sets the size, DeepSpeed's default 5e8), allocated
  whole whatever the model's size at a backward's first gradient and freed when the backward's
  reductions end; two with overlap_comm. A reduction adds a flat copy of what it all-reduces and the
  rank's partition of the gradients (ZeRO-1: every gradient, p.grad until moved into the bucket;
  ZeRO-2: at most a bucket), with activations when a reduction runs inside the backward (overlap_comm or
  ZeRO-2, n above a bucket). A parameter cut by a partition boundary is copied whole into the
  partition (up to that parameter more on some ranks): not counted.
  That is a half model summing its gradients in its own dtype (`main_grads: param`). With fp32 main
  grads (repro.train.engine.zero_grad_dtype) DeepSpeed sums them in fp32: ZeRO-2 into its fp32
  partition (n x 4 / dp, which the step reads; the bucket stays half and is reduced through an fp32
  copy), fp16 ZeRO-1 into an fp32 copy of every gradient (n x 4, beside a micro batch's half p.grad)
  through an fp32 bucket. bf16 ZeRO-1 runs on DeepSpeed's BF16_Optimizer instead: an fp32 buffer of
  every gradient all run (n x 4), the backward's bf16 p.grad until the step (n x 2), no IPG bucket,
  and at the boundary one all-reduce of a flat fp32 copy of every gradient (n x 4).
Not counted: the CUDA context, NCCL's buffers and allocator fragmentation: `HEADROOM_GIB` is kept
free for them (about what a CUDA context plus NCCL take on an H100-class GPU).

Time: repro.perf.scaling_model's iteration time for the rank's batch on the cluster (its
assumptions and its measured error against the paper), times the run's iterations.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from repro.perf.activations import (
    ActivationDtypes,
    ActivationMemory,
    activation_memory,
    bert_activation_memory,
    math_attention,
)
from repro.perf.memory import (
    MemoryEstimate,
    bert_params_per_rank,
    layer_params_per_rank,
    memory_per_rank,
    params_per_rank,
    zero_partition_numel,
)
from repro.perf.scaling_model import Cluster, calibrate_gemm_efficiency, iteration_time
from repro.train.config import Derived, RunConfig, derive

HEADROOM_GIB = 3.0
GIB = 2**30
DEEPSPEED_ALLREDUCE_NUMEL = 500_000_000  # deepspeed.runtime.engine.MEMORY_OPT_ALLREDUCE_SIZE


@dataclass(frozen=True)
class MemoryPlan:
    """Bytes per rank by part; `peak` is the larger of the two phases."""

    weights: int
    masters: int
    optimizer: int
    grad_buffers: int  # torch DDP's buckets or fp32 main gradients: alive all run
    grads_forward: int  # .grad alive during forward/backward (accumulation over micro batches)
    grads_step: int  # .grad the optimizer step reads
    activations: ActivationMemory
    logits_copy: int  # half logits alive beside the cross-entropy's fp32 copy
    grads_waiting: int = 0  # half gradients in MainGrads' buckets near the backward's end (fp32 main grads)
    grads_backward: int = 0  # gradients made by the backward, beside the buffers and grads_forward, at its end
    layer_activations: int = 0  # the embedding's and bottom layer's activations beside them (checkpointing: its
    # input and rebuild)
    reduce_buckets: int = 0  # DeepSpeed's gradient-reduction buffers: alive through each backward
    reduce_transient: int = 0  # gradients alive at a DeepSpeed reduction beside its buckets
    reduce_in_backward: bool = False  # a reduction can run while activations are alive

    @property
    def static(self) -> int:
        return self.weights + self.masters + self.optimizer + self.grad_buffers

    @property
    def activation_peak(self) -> int:
        a = self.activations
        return max(a.kept + max(a.autocast_cache + self.logits_copy, a.backward_start), a.rebuilding)

    @property
    def backward_end(self) -> int:
        """Beside the static memory near the backward's end: the gradients made so far (or MainGrads'
        waiting half ones), the embedding's and the bottom layer's activations and that layer's first
        backward step."""
        grads = self.grads_waiting + self.grads_backward
        return grads + self.layer_activations + self.activations.layer_backward if grads else 0

    @property
    def forward_backward(self) -> int:
        during = self.reduce_transient if self.reduce_in_backward else 0
        return (self.static + self.grads_forward + self.reduce_buckets + during
                + max(self.activation_peak, self.backward_end))

    @property
    def reduction(self) -> int:
        return self.static + self.reduce_buckets + self.reduce_transient

    @property
    def step(self) -> int:
        return self.static + self.grads_step

    @property
    def peak(self) -> int:
        return max(self.forward_backward, self.reduction, self.step)


def parameters_per_rank(cfg: RunConfig) -> int:
    """Parameters one TP rank of the config's model holds."""
    count = bert_params_per_rank if cfg.family == "bert" else params_per_rank
    return count(cfg.model, cfg.parallel.tp)


def memory_plan(cfg: RunConfig, derived: Derived, device_type: str = "cuda") -> MemoryPlan:
    """Bytes per rank of `cfg` laid out as `derived`, on a CUDA device (or "cpu")."""
    tp, dp, p = cfg.parallel.tp, derived.dp, cfg.precision
    n = parameters_per_rank(cfg)
    half = p.params == "half" and p.precision != "fp32"
    zero_half = cfg.train.zero_stage > 0 and p.precision != "fp32"  # DeepSpeed keeps a half model
    dt = ActivationDtypes.of(p.precision, "half" if half or zero_half else p.params, device_type)
    bert = cfg.family == "bert"
    acts = (bert_activation_memory if bert else activation_memory)(
        cfg.model, cfg.train.micro_batch_size, tp, dt, math_attention(device_type, cfg.model.attention_dropout))
    b, s, vocab = cfg.train.micro_batch_size, cfg.model.seq_length, cfg.model.padded_vocab_size(tp)
    # the logits beside the cross-entropy's fp32 softmax: GPT's in-place fp32 path has none, BERT's
    # -inf-filled logits live until its loss returns
    logits_copy = b * s * vocab // tp * dt.compute if bert or dt.compute < 4 else 0
    accumulating = derived.grad_accum_steps > 1
    # the last layer the backward reaches (the bottom one) and the embedding's saved tensors
    layer = acts.layers // cfg.model.num_layers + acts.rebuilt_layer + acts.embedding
    made = made_before_bottom_layer(cfg, n)  # gradients that exist near the backward's end
    if cfg.train.zero_stage:
        return _zero_plan(cfg, derived, n, zero_half, acts, logits_copy, layer, made)
    weight_bytes = 2 if half else 4
    if half and p.main_grads == "fp32":
        return MemoryPlan(n * 2, n * 4, n * 8, n * 4, 0, 0, acts, logits_copy,
                          grads_waiting=waiting_half_grad_bytes(cfg, dp, n), layer_activations=layer)
    if dp > 1:  # torch DDP's buckets hold the gradients all run (.grad are views of them), but the
        # micro batches under no_sync() accumulate into fresh .grad beside them (set to None each step)
        return MemoryPlan(n * weight_bytes, n * 4 if half else 0, n * 8, n * weight_bytes,
                          n * weight_bytes if accumulating else 0, n * 4 if half else 0, acts, logits_copy)
    grads = n * weight_bytes
    step_grads = n * 4 if half else grads  # a half model's masters get fp32 .grad for the step
    return MemoryPlan(n * weight_bytes, n * 4 if half else 0, n * 8, 0,
                      grads if accumulating else 0, step_grads, acts, logits_copy,
                      grads_backward=0 if accumulating else made * weight_bytes,
                      layer_activations=layer)


def made_before_bottom_layer(cfg: RunConfig, n: int) -> int:
    """Parameters whose gradients exist when the backward reaches the bottom layer: all of one TP
    rank's `n` but that layer's and the position (and token-type) embeddings'."""
    m = cfg.model
    return n - layer_params_per_rank(m, cfg.parallel.tp) - (m.seq_length + m.num_tokentypes) * m.hidden_size


def largest_parameter(cfg: RunConfig) -> int:
    """Elements of the largest parameter one TP rank holds: the word embedding, an MLP matrix or
    the position embedding."""
    m, tp = cfg.model, cfg.parallel.tp
    return max(m.padded_vocab_size(tp) * m.hidden_size // tp, 4 * m.hidden_size ** 2 // tp,
               m.seq_length * m.hidden_size)


def waiting_half_grad_bytes(cfg: RunConfig, dp: int, n: int) -> int:
    """Half gradients MainGrads holds in a backward until their bucket is complete: one bucket's
    worth eager (a bucket is 2^24 elements, or one larger parameter alone), all of them when the
    whole step is compiled (one backward graph hands every gradient over at its end)."""
    from repro.train.engine import compile_scope
    from repro.train.main_grads import DEFAULT_BUCKET_NUMEL

    whole = cfg.train.compile and compile_scope(cfg, dp, cfg.parallel.tp) == "objective"
    return 2 * (n if whole else min(n, max(DEFAULT_BUCKET_NUMEL, largest_parameter(cfg))))


def _zero_plan(cfg: RunConfig, derived: Derived, n: int, zero_half: bool, acts: ActivationMemory,
               logits_copy: int, layer: int, made: int) -> MemoryPlan:
    """DeepSpeed ZeRO-1/2 on one rank (see the module's docstring)."""
    from repro.train.engine import deepspeed_config, zero_grad_dtype

    dp, stage = derived.dp, cfg.train.zero_stage
    fp32_grads = zero_half and zero_grad_dtype(cfg) == "fp32"
    # zero.grads: what the micro batches are summed into (fp32 with fp32 main grads)
    zero = memory_per_rank(cfg.model, cfg.parallel.tp, dp, stage, "half" if zero_half else "fp32",
                           fp32_main_grads=fp32_grads, n=n)
    accumulating = derived.grad_accum_steps > 1
    if fp32_grads and stage == 1 and cfg.precision.precision == "bf16":
        return _bf16_optimizer_plan(n, zero, accumulating, acts, logits_copy, layer, made)
    element = 2 if zero_half else 4
    config = deepspeed_config(cfg, derived)["zero_optimization"]
    bucket, overlap = config["reduce_bucket_size"], config["overlap_comm"]
    part = zero_partition_numel(n, dp)
    all_reduced = n if stage == 1 else min(n, bucket)  # ZeRO-1: every p.grad, then their flat copy
    if fp32_grads and stage == 1:  # fp16: fp32 copies of the gradients, bucketed in fp32, beside the half p.grad
        bucket_element, transient = 4, (all_reduced + part) * 4
        forward, step = zero.grads + n * element, zero.grads + part * 4
    elif fp32_grads:  # ZeRO-2: a half bucket reduced through an fp32 copy into the fp32 partition it steps on
        bucket_element, transient = element, all_reduced * (element + 4) + part * 4
        forward, step = zero.grads, zero.grads
    else:
        bucket_element, transient = element, (all_reduced + part) * element
        # the step's fp32 gradients of this rank's partition
        forward, step = zero.grads, zero.grads + (n * 4 // dp if zero_half else 0)
    if stage == 2 or overlap:  # each p.grad is moved into the reduce bucket as the backward makes it
        waiting = 0
    elif fp32_grads:  # fp16 ZeRO-1 sums each p.grad into an fp32 copy (grad_accum) and drops it
        waiting = made * 4
    else:  # ZeRO-1: every p.grad, until the reduction at the backward's end
        waiting = made * element
    return MemoryPlan(zero.params, 0, zero.optimizer, 0, forward if accumulating else 0, step, acts, logits_copy,
                      grads_backward=0 if accumulating else waiting, layer_activations=layer,
                      reduce_buckets=bucket * bucket_element * (2 if overlap else 1), reduce_transient=transient,
                      reduce_in_backward=(stage == 2 or overlap) and n > bucket)


def _bf16_optimizer_plan(n: int, zero: MemoryEstimate, accumulating: bool, acts: ActivationMemory,
                         logits_copy: int, layer: int, made: int) -> MemoryPlan:
    """DeepSpeed's BF16_Optimizer (bf16 ZeRO-1 with fp32 gradients): an fp32 buffer of every gradient all
    run, the backward's bf16 p.grad until the step (zeroed, not freed, between micro batches), no IPG
    bucket; the boundary all-reduce flattens the parameter groups' fp32 buffers into one copy, unless
    the first group alone exceeds its 5e8-element bucket (here: n does)."""
    flat_copy = n * 4 if n <= DEEPSPEED_ALLREDUCE_NUMEL else 0
    return MemoryPlan(zero.params, 0, zero.optimizer, zero.grads, n * 2 if accumulating else 0, n * 2, acts,
                      logits_copy, grads_backward=0 if accumulating else made * 2, layer_activations=layer,
                      reduce_transient=n * 2 + flat_copy)


@dataclass(frozen=True)
class TimePlan:
    """The scaling model's iteration time for this run, and what it adds up to."""

    iteration_s: float
    parts_s: dict[str, float]
    tokens_per_s: float
    days: float
    gpu_hours: float


def dp_gradient_bytes(cfg: RunConfig) -> int:
    """Bytes per gradient element the trainer reduces over DP: 2 for a half-precision model reducing in
    its own dtype (`main_grads: param`, the paper's recipe; DeepSpeed ZeRO too, whose engine holds a
    half model); fp32 main grads (DeepSpeed's too: repro.train.engine.zero_grad_dtype) and fp32
    parameters (autocast) reduce fp32."""
    if cfg.train.zero_stage > 0:
        from repro.train.engine import zero_grad_dtype

        return 4 if zero_grad_dtype(cfg) == "fp32" else 2
    return 2 if cfg.precision.params == "half" and cfg.precision.main_grads == "param" else 4


def time_plan(cfg: RunConfig, derived: Derived, cluster: Cluster) -> TimePlan:
    """Predicted seconds per iteration and in all for `cfg` on `cluster` (see scaling_model)."""
    gpus = cfg.parallel.tp * derived.dp
    per_replica = cfg.train.global_batch_size // derived.dp
    parts = iteration_time(cfg.model, per_replica, cfg.parallel.tp, derived.dp, cluster,
                           calibrate_gemm_efficiency(cluster), recompute=cfg.model.activation_checkpointing,
                           bert=cfg.family == "bert", grad_bytes=dp_gradient_bytes(cfg))
    total_s = parts["total"] * cfg.train.train_iters
    return TimePlan(parts["total"], {k: v for k, v in parts.items() if k != "total"},
                    cfg.train.global_batch_size * cfg.model.seq_length / parts["total"],
                    total_s / 86400, total_s * gpus / 3600)


@dataclass(frozen=True)
class Plan:
    name: str
    gpus: int
    cluster: Cluster
    derived: Derived
    params_per_rank: int
    memory: MemoryPlan
    time: TimePlan

    @property
    def fits(self) -> bool:
        return self.memory.peak <= (self.cluster.memory_gib - HEADROOM_GIB) * GIB


def plan(cfg: RunConfig, gpus: int, cluster: Cluster) -> Plan:
    """Validate `cfg` at `gpus` ranks and predict its memory per GPU and time on `cluster`."""
    derived = derive(cfg, gpus)
    return Plan(cfg.name, gpus, cluster, derived, parameters_per_rank(cfg),
                memory_plan(cfg, derived), time_plan(cfg, derived, cluster))


def suggestions(p: Plan, cfg: RunConfig) -> list[str]:
    """What would bring a run that does not fit under the device's memory."""
    out = []
    if not cfg.model.activation_checkpointing:
        out.append("turn on activation checkpointing (--set model.activation_checkpointing=true)")
    if cfg.train.micro_batch_size > 1:
        out.append("halve the micro batch (train.micro_batch_size; the global batch is kept by accumulation)")
    if not cfg.train.zero_stage and p.derived.dp > 1:
        out.append("partition the optimizer state over DP (--set train.zero_stage=1)")
    out.append("raise the TP degree (parallel.tp) so each GPU holds a smaller slice")
    return out


def _gib(n: int) -> str:
    return f"{n / GIB:8.2f}"


def format_plan(p: Plan, cfg: RunConfig) -> str:
    """The plan as the terminal shows it."""
    m, t, d, cl = p.memory, p.time, p.derived, p.cluster
    a = m.activations
    usable = cl.memory_gib - HEADROOM_GIB
    lines = [
        f"{p.name}: {cfg.family.upper()} {cfg.model.num_layers} layers, h={cfg.model.hidden_size}, "
        f"{cfg.model.num_attention_heads} heads, seq {cfg.model.seq_length}; "
        f"{p.params_per_rank:,} parameters per GPU",
        f"layout: {p.gpus} GPUs = tp {cfg.parallel.tp} x dp {d.dp}; micro batch {cfg.train.micro_batch_size} "
        f"x {d.grad_accum_steps} accumulation steps x dp = global batch {cfg.train.global_batch_size}; "
        f"{cfg.precision.precision} ({cfg.precision.params} parameters), ZeRO stage {cfg.train.zero_stage}, "
        f"activation checkpointing {'on' if cfg.model.activation_checkpointing else 'off'}",
        f"cluster: {cl.name}, {cl.memory_gib:g} GiB per GPU",
        "",
        "memory per GPU (GiB)",
        f"  weights                      {_gib(m.weights)}",
        f"  fp32 master weights          {_gib(m.masters)}",
        f"  Adam state                   {_gib(m.optimizer)}",
        f"  gradient buffers             {_gib(m.grad_buffers)}",
        f"  activations kept             {_gib(a.kept)}   (one micro batch)",
        f"  + transient in the step      {_gib(m.activation_peak - a.kept)}   (rebuilt layer / autocast cache / first gradients)",
        *([f"  half gradients waiting       {_gib(m.grads_waiting)}   (MainGrads buckets, near the backward's end)"]
          if m.grads_waiting else []),
        *([f"  gradients made by then       {_gib(m.grads_backward)}   (as the backward reaches the bottom layer)"]
          if m.grads_backward else []),
        *([f"  DeepSpeed reduce buckets     {_gib(m.reduce_buckets)}   (through each backward)",
           f"  peak, DP reduction           {_gib(m.reduction)}"] if m.reduce_buckets else []),
        f"  peak, forward/backward       {_gib(m.forward_backward)}",
        f"  peak, optimizer step         {_gib(m.step)}",
        f"  peak                         {_gib(m.peak)}  of {usable:g} usable "
        f"({cl.memory_gib:g} less {HEADROOM_GIB:g} for the CUDA context, NCCL, fragmentation): "
        + ("fits" if p.fits else "DOES NOT FIT"),
    ]
    if not p.fits:
        lines += ["  to fit:"] + [f"    - {s}" for s in suggestions(p, cfg)]
    lines += [
        "",
        "time (analytic scaling model, repro/perf/scaling_model.py; its error against the paper is in "
        "results/scaling_model/table.md)",
        f"  iteration      {t.iteration_s:.3f} s  (" + ", ".join(f"{k.replace('_', ' ')} {v:.3f}"
                                                           for k, v in t.parts_s.items()) + ")",
        f"  throughput     {t.tokens_per_s:,.0f} tokens/s",
        f"  {cfg.train.train_iters:,} iterations: {t.days:.2f} days, {t.gpu_hours:,.0f} GPU-hours",
    ]
    if cfg.precision.precision == "fp32":
        lines.append("  note: the model times half-precision GEMMs at the cluster's fp16/bf16 peak; this config "
                     "computes in fp32, several times slower on tensor-core GPUs: read the time as a lower bound")
    return "\n".join(lines)


def plan_dict(p: Plan) -> dict:
    """The plan as JSON-ready data."""
    m = p.memory
    return {"name": p.name, "gpus": p.gpus, "cluster": p.cluster.name, "dp": p.derived.dp,
            "grad_accum_steps": p.derived.grad_accum_steps, "params_per_rank": p.params_per_rank,
            "memory_bytes": {**{k: v for k, v in asdict(m).items() if k != "activations"},
                             "activations": asdict(m.activations), "forward_backward": m.forward_backward,
                             "reduction": m.reduction, "step": m.step, "peak": m.peak},
            "fits": p.fits, "headroom_gib": HEADROOM_GIB, "time": asdict(p.time)}


GPT2_RUNS = {"gpt2-355m": 64, "gpt2-2.5b": 128, "gpt2-8.3b": 512}  # Table 2's GPU counts (PAPER.md §3)


def paper_table2(cluster: Cluster) -> list[dict]:
    """Out of sample: days per epoch (68,507 iterations) of the shipped GPT-2 configs on `cluster`,
    predicted by the scaling model, against Table 2's."""
    from repro.analysis.paper import paper_value, paper_values
    from repro.data.summary import PAPER_ITERS_PER_EPOCH
    from repro.tracking.store import project_root
    from repro.train.config import load_config

    frame, rows = paper_values(), []
    for name, gpus in GPT2_RUNS.items():
        cfg = load_config(project_root() / "experiments" / "gpt2" / f"{name.replace('-', '_')}.yaml")
        t = time_plan(cfg, derive(cfg, gpus), cluster)
        days = t.iteration_s * PAPER_ITERS_PER_EPOCH / 86400
        paper = paper_value(frame, "gpt2", name, "days_per_epoch")
        rows.append({"cluster": cluster.name, "config": name, "gpus": gpus, "iteration_s": t.iteration_s,
                     "predicted_days": days, "paper_days": paper, "error": days / paper - 1})
    return rows


def paper_config_rows(clusters: dict[str, Cluster] | None = None) -> list[dict]:
    """Every training script's config in slurm/ at its GPU count, planned on each of `clusters`
    (default: the two built in)."""
    from repro.launch.scripts import job_scripts
    from repro.perf.clusters import BUILT_IN
    from repro.tracking.store import project_root
    from repro.train.config import load_config

    rows = []
    for script in job_scripts():
        if not script.config or "launch_train" not in script.path.read_text():
            continue
        cfg = load_config(project_root() / script.config)
        for key, cluster in (clusters or BUILT_IN).items():
            p = plan(cfg, script.ntasks, cluster)
            rows.append({"script": script.path.name, "config": script.config, "gpus": script.ntasks,
                         "tp": cfg.parallel.tp, "dp": p.derived.dp, "micro_batch": cfg.train.micro_batch_size,
                         "cluster": key, "params_per_gpu": p.params_per_rank,
                         "activations_gib": p.memory.activation_peak / GIB, "peak_gib": p.memory.peak / GIB,
                         "usable_gib": cluster.memory_gib - HEADROOM_GIB, "fits": p.fits,
                         "iteration_s": p.time.iteration_s, "train_iters": cfg.train.train_iters,
                         "days": p.time.days, "gpu_hours": p.time.gpu_hours})
    return rows


def paper_config_markdown(rows: list[dict]) -> str:
    keys = list(dict.fromkeys(r["cluster"] for r in rows))
    where = ("on the paper's DGX-2H (V100 32 GB) and on an H200 cluster" if keys == ["dgx2h", "h200"]
             else f"on {', '.join(keys)} (the cluster column)")
    lines = ["# Every paper config, planned before launch (`repro plan --paper`)\n",
             f"Each slurm/ training script's config at the script's GPU count, {where}. "
             "Memory: repro.perf.plan (checked against measured peaks in "
             "memory_check.md); time: the analytic scaling model (its error against the paper in "
             "../scaling_model/table.md; BERT's counts its heads too, repro.perf.flops). No measurement involved.\n",
             "| script | GPUs | TP x DP | micro batch | cluster | params/GPU | activations GiB | peak GiB | "
             "of usable | fits | iter s | iterations | days | GPU-hours |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['script']} | {r['gpus']} | {r['tp']} x {r['dp']} | {r['micro_batch']} | {r['cluster']} | "
                     f"{r['params_per_gpu'] / 1e6:,.0f}M | {r['activations_gib']:.2f} | {r['peak_gib']:.2f} | "
                     f"{r['usable_gib']:.1f} | {'yes' if r['fits'] else 'NO'} | {r['iteration_s']:.3f} | "
                     f"{r['train_iters']:,} | {r['days']:.2f} | {r['gpu_hours']:,.0f} |")
    return "\n".join(lines) + "\n"
