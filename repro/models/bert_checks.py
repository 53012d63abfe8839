"""BERT correctness checks: TP x DP against the serial model, and tp=1 against Hugging Face.

Same conventions as repro/parallel/checks.py (relative error to the reference's max magnitude;
float32 1e-5, float64 1e-10: TP only reorders floating-point sums).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from repro.models.bert import BERT, IGNORE_INDEX, BertConfig
from repro.parallel.checks import TOLERANCE, Check, full_grads, max_grad_error, rel_error, tiny_dims
from repro.parallel.grads import all_reduce_gradients
from repro.parallel.groups import ProcessGroups
from repro.parallel.mappings import gather_from_tensor_parallel_region

TINY_BERT = BertConfig(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=16,
                       vocab_size=1000, hidden_dropout=0.0, attention_dropout=0.0)


def random_bert_batch(cfg: BertConfig, batch: int, seed: int = 7) -> dict[str, torch.Tensor]:
    """A pretraining batch in the data pipeline's layout: padding, two segments, ~20% predicted."""
    gen = torch.Generator().manual_seed(seed)
    b, s = batch, cfg.seq_length
    tokens = torch.randint(0, cfg.vocab_size, (b, s), generator=gen)
    lengths = torch.randint(s // 2, s + 1, (b,), generator=gen)
    lengths[0] = s
    padding_mask = (torch.arange(s)[None, :] < lengths[:, None]).long()  # (b, s)
    token_types = (torch.arange(s)[None, :] >= (lengths // 2)[:, None]).long() * padding_mask
    predict = (torch.rand(b, s, generator=gen) < 0.2) & padding_mask.bool()
    predict[:, 1] = True  # every row (so every DP shard) predicts at least one token
    labels = torch.randint(0, cfg.vocab_size, (b, s), generator=gen)
    labels[0, 2:4] = torch.tensor([0, cfg.vocab_size - 1])  # first and last real ids
    mlm_labels = labels.masked_fill(~predict, IGNORE_INDEX)
    sop_label = torch.randint(0, 2, (b,), generator=gen)
    return {"tokens": tokens, "token_types": token_types, "padding_mask": padding_mask,
            "mlm_labels": mlm_labels, "sop_label": sop_label}


def _slice(batch: dict[str, torch.Tensor], rows: slice) -> dict[str, torch.Tensor]:
    return {k: v[rows] for k, v in batch.items()}


def _serial_reference(cfg, batch, dp: int, per_rank: int, dtype):
    """Serial logits on the whole batch; losses and grads as the mean over the DP shards."""
    serial = BERT(cfg, seed=42).to(dtype)
    with torch.no_grad():
        out = serial(batch["tokens"], batch["token_types"], batch["padding_mask"])
    shard_losses = [serial.losses(_slice(batch, slice(r * per_rank, (r + 1) * per_rank)))
                    for r in range(dp)]
    mean = {k: sum(sl[k] for sl in shard_losses) / dp for k in ("mlm", "sop", "total")}
    mean["total"].backward()
    grads = {n: p.grad for n, p in serial.named_parameters()}
    return out, {k: v.detach() for k, v in mean.items()}, grads


def _dp_mean(x: torch.Tensor, pg: ProcessGroups) -> torch.Tensor:
    x = x.detach().clone()
    if pg.dp_size > 1:
        dist.all_reduce(x, group=pg.dp_group)
        x /= pg.dp_size
    return x


def check_bert_equivalence(pg: ProcessGroups, order: str = "pre", dtype=torch.float32,
                           per_rank: int = 2) -> list[Check]:
    """MLM/SOP logits, MLM/SOP losses and every gradient of TP x DP BERT equal the serial model's."""
    cfg = BertConfig(**{**TINY_BERT.__dict__, **tiny_dims(pg.tp_size), "layernorm_order": order})
    tol, tag = TOLERANCE[dtype], f"bert {order} tp={pg.tp_size} dp={pg.dp_size} {str(dtype)[6:]}"
    batch = random_bert_batch(cfg, per_rank * pg.dp_size)
    ref_out, ref_loss, ref_grads = _serial_reference(cfg, batch, pg.dp_size, per_rank, dtype)
    model = BERT(cfg, pg.tp_group, seed=42).to(dtype)
    rows = slice(pg.dp_rank * per_rank, (pg.dp_rank + 1) * per_rank)
    mine = _slice(batch, rows)
    out = model(mine["tokens"], mine["token_types"], mine["padding_mask"])
    logits = gather_from_tensor_parallel_region(out.mlm_logits.detach(), pg.tp_group)
    losses = model.losses(mine)
    losses["total"].backward()
    all_reduce_gradients(model.parameters(), pg.dp_group)
    grads, v = full_grads(model, pg.tp_group), cfg.vocab_size
    return [
        Check(f"{tag}: MLM logits", rel_error(logits[..., :v], ref_out.mlm_logits[rows][..., :v]), tol),
        Check(f"{tag}: SOP logits", rel_error(out.sop_logits.detach(), ref_out.sop_logits[rows]), tol),
        Check(f"{tag}: MLM loss", rel_error(_dp_mean(losses["mlm"], pg), ref_loss["mlm"]), tol),
        Check(f"{tag}: SOP loss", rel_error(_dp_mean(losses["sop"], pg), ref_loss["sop"]), tol),
        Check(f"{tag}: every gradient", max_grad_error(grads, ref_grads), tol),
    ]


def check_bert_huggingface() -> list[Check]:
    """tp=1 original-order BERT == transformers.BertForPreTraining on the same weights (float32)."""
    from repro.models.bert_hf import to_hf_bert

    cfg = BertConfig(**{**TINY_BERT.__dict__, "layernorm_order": "post"})
    model = BERT(cfg, seed=21).eval()
    hf = to_hf_bert(model).eval()
    batch = random_bert_batch(cfg, 3)
    with torch.no_grad():
        ours = model(batch["tokens"], batch["token_types"], batch["padding_mask"])
        theirs = hf(input_ids=batch["tokens"], token_type_ids=batch["token_types"],
                    attention_mask=batch["padding_mask"], labels=batch["mlm_labels"],
                    next_sentence_label=batch["sop_label"])
        total = model.losses(batch)["total"]
    v = cfg.vocab_size
    return [
        Check("tp=1 post: MLM logits == BertForPreTraining", rel_error(ours.mlm_logits[..., :v], theirs.prediction_logits), 1e-5),
        Check("tp=1 post: SOP logits == seq_relationship", rel_error(ours.sop_logits, theirs.seq_relationship_logits), 1e-5),
        Check("tp=1 post: MLM + SOP loss == HF loss", rel_error(total, theirs.loss), 1e-5),
    ]


def run_bert_checks(layouts: list[tuple[int, int]]) -> list[dict]:
    """Every BERT equivalence check for each (tp, dp) layout of the current world; rows as dicts."""
    from repro.parallel.groups import ParallelDims, build_process_groups

    rows: list[Check] = []
    for tp, dp in layouts:
        pg = build_process_groups(ParallelDims(tp, dp))
        for order in ("pre", "post"):
            for dtype in (torch.float32, torch.float64):
                rows += check_bert_equivalence(pg, order, dtype)
    return [r.as_dict() for r in rows]
