"""Loading a checkpoint at another TP degree holds one full tensor at a time, not the whole model.

Measured as the peak growth of this process's anonymous memory (RssAnon, sampled every millisecond
by a thread while torch's copies run without the GIL). File-backed pages of the memory-mapped shards
are page cache, shared and reclaimable, so they are not counted. A ~200 MB fp32 model with a small
vocabulary: its largest tensor is 17 MB, so merging everything first (what both paths did before)
would exceed the bound by ~200 MB, and sampling that misses a short peak can only make a pass easier,
never a fail spurious.
"""

from __future__ import annotations

import ctypes
import dataclasses
import threading
import time
from pathlib import Path

import torch

from repro.models.bert import BertConfig
from repro.models.config import ModelConfig
from repro.parallel.spawn import run_ranks
from repro.train import reshard as rs

SHAPE = dict(num_layers=4, hidden_size=1024, num_attention_heads=16, seq_length=64, vocab_size=1000)


def _anon_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon in /proc/self/status")


def _fixed_mmap_threshold() -> None:
    """glibc raises its mmap threshold to each freed mmapped block's size (up to 32 MB), then keeps
    later freed tensors of that size in its heap: RssAnon would count the allocator's cache, not live
    tensors. A fixed threshold maps every block over 128 kB and returns it to the OS when freed."""
    ctypes.CDLL("libc.so.6").mallopt(-3, 128 * 1024)  # M_MMAP_THRESHOLD


class PeakAnonGrowth:
    """Context manager: `.bytes` is the peak RssAnon above the value at entry."""

    def __enter__(self) -> "PeakAnonGrowth":
        _fixed_mmap_threshold()
        self.start, self.peak, self._done = _anon_bytes(), 0, threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._done.is_set():
            self.peak = max(self.peak, _anon_bytes())
            time.sleep(0.001)

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join()
        self.peak = max(self.peak, _anon_bytes())
        self.bytes = self.peak - self.start


def _write_tp2_checkpoint(ckpt: Path, cfg: ModelConfig, family: str) -> dict:
    """A model-only TP=2 checkpoint of random weights (the layout `repro train` writes); its meta."""
    ckpt.mkdir(parents=True, exist_ok=True)
    with torch.device("meta"):
        shapes = {n: t.shape for n, t in rs._build(cfg, family).state_dict().items()}
    gen = torch.Generator().manual_seed(0)
    full = {n: torch.randn(s, generator=gen) for n, s in shapes.items()}
    full = {n: t[:cfg.vocab_size] if n in rs.VOCAB_ROWS else t for n, t in full.items()}
    spec = rs.partition_spec(cfg, family)
    meta = {"model": dataclasses.asdict(cfg), "family": family}
    rs._write_model_only(ckpt, (rs.shard_state(full, spec, r, 2, cfg.padded_vocab_size(2)) for r in range(2)),
                         meta, 2)
    return {**meta, "tp": 2, "full_bytes": sum(t.numel() * 4 for t in full.values()),
            "largest_bytes": max(t.numel() * 4 for t in full.values())}


def _reshard_to_tp4(ckpt: str, meta: dict) -> dict:
    with PeakAnonGrowth() as growth:
        state = rs.resharded_state(Path(ckpt), meta, 0, 4)
    return {"growth": growth.bytes, "result": sum(t.numel() * t.element_size() for t in state.values())}


def test_resharding_a_rank_holds_its_slice_and_one_full_tensor(tmp_path):
    """TP=2 -> TP=4 (eval at another TP, `repro checkpoint reshard`): the growth is the rank's
    quarter plus a few full tensors, not the whole model."""
    meta = _write_tp2_checkpoint(tmp_path, ModelConfig(**SHAPE), "gpt")
    [got] = run_ranks(_reshard_to_tp4, 1, str(tmp_path), meta)
    assert got["result"] < meta["full_bytes"] / 3
    assert got["growth"] < got["result"] + 4 * meta["largest_bytes"], (got, meta)


def _load_bert_slice(run_dir: str) -> dict:
    import torch.distributed as dist

    from repro.models.bert import BERT
    from repro.models.bert_checkpoint import load_full_state_dict, read_bert
    from repro.parallel.layers import to_empty_keeping_markers

    _fixed_mmap_threshold()
    cfg = read_bert(run_dir)[0]  # the weights are read again below, inside the measurement
    with torch.device("meta"):
        model = BERT(cfg, tp_group=dist.group.WORLD, pretraining_heads=False)  # as RACE builds it
    model = to_empty_keeping_markers(model, "cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()  # resident before the measurement: empty tensors' pages are first touched on write
    with PeakAnonGrowth() as growth:
        load_full_state_dict(model, read_bert(run_dir)[1], skip=("lm_head.", "sop_head."))
    params = dict(model.named_parameters())
    return {"growth": growth.bytes, "model": sum(p.numel() * 4 for p in params.values()),
            "word_rows": params["embeddings.word.weight"].detach().clone()}


def test_a_bert_rank_loads_its_tp_slice_of_a_run_without_the_whole_model(tmp_path):
    """What `repro finetune race --checkpoint RUN_DIR` does on each TP rank: read_bert gives the run's
    TP=2 shards merged lazily, load_full_state_dict copies this rank's slice, tensor by tensor. The
    weights are the checkpoint's; the growth is about the rank's half, not the whole model."""
    meta = _write_tp2_checkpoint(tmp_path / "checkpoints" / "iter_0000001", BertConfig(**SHAPE), "bert")
    (tmp_path / "checkpoints" / "latest").write_text("iter_0000001")
    got = run_ranks(_load_bert_slice, 2, str(tmp_path))
    words = rs.load_full_model_state(tmp_path / "checkpoints" / "iter_0000001")[1]["embeddings.word.weight"]
    assert torch.equal(torch.cat([r["word_rows"] for r in got])[:len(words)], words)  # rank 0's rows, then 1's
    for rank in got:
        assert rank["model"] < meta["full_bytes"] * 0.6
        assert rank["growth"] < rank["model"] + 4 * meta["largest_bytes"], (rank, meta)


def _export_hf(ckpt: str, out: str) -> int:
    from transformers import GPT2LMHeadModel  # noqa: F401  (its import's own memory is not the export's)

    from repro.cli import main

    with PeakAnonGrowth() as growth:
        assert main(["checkpoint", "export-hf", ckpt, "--out", out]) == 0
    return growth.bytes


def test_export_hf_holds_one_copy_of_the_weights(tmp_path):
    """`repro checkpoint export-hf` merges the TP shards tensor by tensor into a GPT2LMHeadModel built
    on the meta device: the growth is about the model once (its float32 weights must all be in memory
    for save_pretrained), not the four copies a random-initialised model of ours, a random-initialised
    GPT2LMHeadModel and the transposed state dict between them came to (an 8.3B export: 33 GB, not
    over 120 GB). The exported weights themselves: test_import_hf.py's bit-identical round trip."""
    from safetensors.torch import load_file

    meta = _write_tp2_checkpoint(tmp_path / "ck", ModelConfig(**SHAPE), "gpt")
    [growth] = run_ranks(_export_hf, 1, str(tmp_path / "ck"), str(tmp_path / "hf"))
    assert growth < 1.3 * meta["full_bytes"], (growth, meta)
    exported = load_file(tmp_path / "hf" / "model.safetensors")
    assert sum(t.numel() * 4 for t in exported.values()) == meta["full_bytes"]
