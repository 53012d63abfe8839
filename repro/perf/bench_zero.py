"""DeepSpeed ZeRO-1/2 memory per rank for `repro bench` (part c): parameters, Adam state, and the
gradient buffers DeepSpeed holds at each point of one step, against zero_grad_lifecycle's formulas."""

from __future__ import annotations

from typing import Any, Callable

import torch

from repro.models.config import ModelConfig
from repro.perf.memory import zero_partition_numel, zero_staged_numel


def nbytes(tensors) -> int:
    """Bytes of `tensors`, each counted by its own elements."""
    return sum(t.numel() * t.element_size() for t in tensors)


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors` (views of one buffer count once, whole)."""
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())


def param_numels(cfg: ModelConfig) -> list[int]:
    """Parameter sizes in model.parameters() order, the order of DeepSpeed's flat buffer."""
    from repro.models.gpt import GPT

    with torch.device("meta"):
        return [p.numel() for p in GPT(cfg).parameters()]


def zero_grad_lifecycle(numels: list[int], dp: int, rank: int, reduce_bucket_size: int) -> dict[str, int]:
    """Expected fp32 bytes of each `_watch_zero_grads` entry under DeepSpeed 0.19.8's ZeRO-1/2 defaults
    (contiguous_gradients, no overlap_comm), for a model that fits one reduce bucket."""
    n, size = sum(numels), zero_partition_numel(sum(numels), dp)
    assert n <= reduce_bucket_size, "several reduce buckets: bucket_used / allreduce_copy differ"
    pad = min(size, max(0, (rank + 1) * size - n))  # averaged_gradients' zero tensor on the last rank(s)
    return {"unreduced": 4 * n, "bucket_reserved": 4 * reduce_bucket_size, "bucket_used": 4 * n,
            "allreduce_copy": 4 * n, "staged": 4 * (zero_staged_numel(numels, dp, rank) + pad),
            "stepped": 4 * size}


def zero_memory(model, pg, ids, stage: int) -> dict:
    """Bytes per rank under DeepSpeed ZeRO-`stage` (fp32): params, Adam state, and its gradients at each
    point of one step (`_watch_zero_grads`). `grads` is what the stage keeps: ZeRO-1 all unreduced
    gradients until the boundary reduction, ZeRO-2 only the fp32 partition its optimizer steps on."""
    from repro.train.engine import import_deepspeed

    deepspeed = import_deepspeed()
    config = {"train_micro_batch_size_per_gpu": ids.shape[0], "train_batch_size": ids.shape[0] * pg.dp_size,
              "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True,
              "steps_per_print": 10**9}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    engine, zopt, _, _ = deepspeed.initialize(model=model, optimizer=opt, mpu=pg, config=config,
                                              dist_init_required=False)
    seen = _watch_zero_grads(engine, zopt, list(model.parameters()))
    engine.backward(engine(ids, ids).mean())
    seen["staged"] = storage_bytes(t for g in zopt.averaged_gradients.values() for t in g)
    engine.step()
    state = nbytes(v for s in zopt.optimizer.state.values() for k, v in s.items() if k != "step")
    master = nbytes(getattr(zopt, "single_partition_of_fp32_groups", []))
    return {"params": nbytes(model.parameters()), "optimizer": state + master,
            "grads": seen["unreduced"] if stage == 1 else seen["stepped"],
            "grad_lifecycle": seen, "deepspeed": _zero_layout(zopt, dict(model.named_parameters()))}


def _tap(obj, name: str, before: Callable[[], None] | None = None,
         after: Callable[[Any], None] | None = None) -> None:
    """Replace the bound method obj.name by one that calls before() first and after(result) last."""
    fn = getattr(obj, name)

    def wrapped(*args, **kwargs):
        if before:
            before()
        out = fn(*args, **kwargs)
        if after:
            after(out)
        return out

    setattr(obj, name, wrapped)


def _watch_zero_grads(engine, zopt, params: list) -> dict[str, int]:
    """Gradient bytes DeepSpeed holds during one step, filled in as it runs:
    unreduced (p.grad when the boundary reduction starts), bucket_reserved / bucket_used (the ipg
    reduce bucket: allocated, filled when reduced), allreduce_copy (the flat tensor it all-reduces),
    stepped (the fp32 gradient partition handed to the inner optimizer)."""
    seen = {"bucket_used": 0, "allreduce_copy": 0}

    def at_reduction() -> None:
        seen["unreduced"] = nbytes(p.grad for p in params if p.grad is not None)
        seen["bucket_reserved"] = nbytes(b for bucket in zopt.ipg_buckets.values() for b in bucket.buffer)

    def at_bucket() -> None:
        used = sum(b.elements * b.buffer[b.index].element_size() for b in zopt.ipg_buckets.values() if b.buffer)
        seen["bucket_used"] = max(seen["bucket_used"], used)

    def at_allreduce(flat: torch.Tensor) -> None:
        seen["allreduce_copy"] = max(seen["allreduce_copy"], nbytes([flat]))

    def at_step() -> None:
        seen["stepped"] = nbytes(g.grad for g in zopt.single_partition_of_fp32_groups)

    _tap(engine, "allreduce_gradients", before=at_reduction)
    _tap(zopt, "reduce_ipg_grads", before=at_bucket)
    _tap(zopt, "allreduce_bucket", after=at_allreduce)
    _tap(zopt.optimizer, "step", before=at_step)
    return seen


def _zero_layout(zopt, named: dict) -> dict:
    """DeepSpeed's partition of the single parameter group and the settings its buffers follow."""
    from deepspeed import comm as dist

    assert len(zopt.bit16_groups) == 1, "one parameter group expected"
    first = zopt.params_in_partition[0][0]
    return {"partition_size": zopt.partition_size[0], "first_offset": zopt.first_offset[0],
            "first_param": next(n for n, p in named.items() if p is first), "first_param_numel": first.numel(),
            "params_in_partition": len(zopt.params_in_partition[0]), "padding": zopt.groups_padding[0],
            "reduce_bucket_size": zopt.reduce_bucket_size, "allgather_bucket_size": zopt.allgather_bucket_size,
            "contiguous_gradients": zopt.contiguous_gradients, "overlap_comm": zopt.overlap_comm,
            "all_gather_into_tensor": dist.has_all_gather_into_tensor()}


def md_zero_grads(rows: list[dict]) -> list[str]:
    """DeepSpeed's gradient buffers through one step, each against zero_grad_lifecycle's formula."""
    if not rows:
        return []
    keys = ("unreduced", "bucket_reserved", "bucket_used", "allreduce_copy", "staged", "stepped")
    lines = ["\n### DeepSpeed's gradient buffers during one ZeRO step (bytes)\n",
             "| layout | p.grad at reduction | bucket allocated | bucket filled | all-reduce copy | "
             "grads_in_partition | partition stepped on | params overlapping (first offset) | = formula |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        got, ds = r["grad_lifecycle"], r["deepspeed"]
        lines.append(f"| {r['layout']} | " + " | ".join(str(got[k]) for k in keys) +
                     f" | {ds['params_in_partition']} ({ds['first_offset']}) | {got == r['grad_lifecycle_formula']} |")
    ds = rows[0]["deepspeed"]
    lines.append(
        f"\nN parameters, fp32; DeepSpeed keeps one flat buffer of them in model.parameters() order, padded to "
        f"a multiple of 2 dp, rank r owning elements [r P, (r+1) P) with P = {ds['partition_size']} "
        f"(padding {ds['padding']}). p.grad at reduction = 4 N: all gradients (ZeRO-1: autograd's own tensors; "
        f"ZeRO-2: views into the bucket, whose hooks copy each gradient in as it is produced). The ipg bucket "
        f"is torch.empty(reduce_bucket_size = {ds['reduce_bucket_size']}) fp32 = 4 x reduce_bucket_size, "
        f"allocated at the first gradient hook (on CPU only the written pages become resident) and released "
        f"after the reduction; N <= reduce_bucket_size, so all 4 N go into one bucket (ZeRO-1 at the boundary, "
        f"ZeRO-2 during backward) and one all-reduce of a flat 4 N copy. allgather_bucket_size "
        f"({ds['allgather_bucket_size']}) allocates nothing: with all_gather_into_tensor "
        f"({ds['all_gather_into_tensor']}) the updated partitions are gathered straight into the flat "
        f"parameter buffer. grads_in_partition (its views are averaged_gradients, what a measurement after "
        f"backward sees) copies whole every parameter that overlaps the rank's partition (a zero tensor stands "
        f"for any padding), so it is at least 4 P and differs between ranks when a boundary cuts a parameter (a nonzero first offset: the rank's "
        f"first parameter starts that many elements before its partition{_md_cut(rows)}). step() flattens it into the 4 P "
        f"partition both stages step on, then frees it. DeepSpeed's ZeRO-1 thus also steps on a 1/dp gradient; "
        f"its extra memory is the full gradient held until the boundary (across micro-batches with "
        f"accumulation).")
    return lines


def _md_cut(rows: list[dict]) -> str:
    """Which parameter a partition boundary cuts, from the rows whose partition starts inside one."""
    cut = {(d["first_param"], d["first_param_numel"], d["first_offset"], r["layout"].rsplit(" ", 1)[-1])
           for r in rows for d in [r["deepspeed"]] if d["first_offset"]}
    return "".join(f"; rank {rank}: {name}, {numel} elements, starts {off} before"
                   for name, numel, off, rank in sorted(cut))
