"""import-megatron against megatron-core itself: a GPTModel built from megatron-core's own layers (the
local layer spec, learned absolute positions, tied output layer) at TP=1 and TP=2 over gloo is saved
as Megatron-LM's training loop saves its `torch` format (saved arguments, checkpoint_version 3.0, each
rank's `state_dict_for_save_checkpoint()` in iter_NNNNNNN/mp_rank_TT/model_optim_rng.pt), imported,
and evaluated by our GPT: its logits equal megatron-core's own forward (1e-5 relative).

megatron-core's forward assumes a GPU in three places that do not concern the model's arithmetic; on
CPU its scratch buffer is allocated with torch.empty, its dropout RNG tracker (no dropout here) is a
no-op, and the causal mask is passed explicitly. The weights, names, QKV layout and the computation
are megatron-core's.
"""

from __future__ import annotations

import argparse
import contextlib

import pytest
import torch

from repro.parallel.groups import ProcessGroups
from repro.parallel.spawn import run_ranks
from repro.train import checkpoint as ck
from repro.train import reshard as rs

VOCAB, SEQ = 50257, 16
IDS = torch.arange(2 * SEQ).view(2, SEQ) * 997 % VOCAB


def _on_cpu() -> None:
    """megatron-core's GPU-only helpers replaced by CPU ones (see the module docstring)."""
    from megatron.core import tensor_parallel, utils

    class NoDropoutRNG:
        def fork(self, *args, **kwargs):
            return contextlib.nullcontext()

    utils.GlobalMemoryBuffer.get_tensor = lambda self, shape, dtype, name, **kw: torch.empty(shape, dtype=dtype)
    tensor_parallel.get_cuda_rng_tracker = lambda *args, **kwargs: NoDropoutRNG()


def _perturb(model, rank: int) -> None:
    """Non-trivial layer norms and biases, GeLU inputs of order 1 (where its forms differ): replicated
    tensors alike on every rank, TP shards each their own."""
    with torch.no_grad():
        for i, (name, p) in enumerate(model.named_parameters()):
            gen = torch.Generator().manual_seed(1000 * i + (rank if getattr(p, "tensor_model_parallel", False) else 0))
            if name.endswith("bias") or "layernorm" in name:
                p.add_(torch.randn(p.shape, generator=gen) * 0.1)
            if name.endswith("linear_fc1.weight"):
                p.mul_(30)


def _megatron_core_rank(root: str, tp: int) -> list:
    """Build, save (as Megatron-LM's `torch` format) and run a megatron-core GPT on this rank."""
    import torch.distributed as dist
    import torch.nn.functional as F
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    _on_cpu()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    torch.manual_seed(0)  # use_cpu_initialization draws each master weight, then keeps this rank's slice
    cfg = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, use_cpu_initialization=True,
                            hidden_dropout=0.0, attention_dropout=0.0, activation_func=F.gelu,
                            bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
                            gradient_accumulation_fusion=False, persist_layer_norm=False, apply_rope_fusion=False)
    rows = -(-VOCAB // (128 * tp)) * 128 * tp  # Megatron-LM's vocabulary padding
    model = GPTModel(cfg, get_gpt_layer_local_spec(), vocab_size=rows, max_sequence_length=SEQ,
                     position_embedding_type="learned_absolute", share_embeddings_and_output_weights=True,
                     parallel_output=True).eval()
    rank = parallel_state.get_tensor_model_parallel_rank()
    _perturb(model, rank)
    args = argparse.Namespace(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=128,
                              max_position_embeddings=SEQ, tensor_model_parallel_size=tp,
                              pipeline_model_parallel_size=1, tokenizer_type="GPT2BPETokenizer",
                              openai_gelu=False, bias_gelu_fusion=False, position_embedding_type="learned_absolute",
                              untie_embeddings_and_output_weights=False, layernorm_epsilon=cfg.layernorm_epsilon)
    path = f"{root}/iter_0000010/mp_rank_{rank:02d}/model_optim_rng.pt"
    __import__("os").makedirs(path.rsplit("/", 1)[0])
    torch.save({"args": args, "checkpoint_version": 3.0, "iteration": 10,
                "model": model.state_dict_for_save_checkpoint()}, path)
    if dist.get_rank() == 0:
        open(f"{root}/latest_checkpointed_iteration.txt", "w").write("10")
    causal = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), 1)[None, None]  # True: masked
    with torch.no_grad():
        shard = model(IDS, torch.arange(SEQ).expand(2, SEQ), attention_mask=causal)  # this rank's vocab slice
        shards = [torch.empty_like(shard) for _ in range(tp)]
        dist.all_gather(shards, shard, group=parallel_state.get_tensor_model_parallel_group())
    parallel_state.destroy_model_parallel()
    return torch.cat(shards, dim=-1)[..., :VOCAB].tolist()


@pytest.mark.parametrize("tp", [1, 2])
def test_a_megatron_core_gpt_imports_to_megatron_cores_own_logits(tmp_path, tp):
    reference = torch.tensor(run_ranks(_megatron_core_rank, tp, str(tmp_path / "megatron"), tp, timeout=240)[0])
    rs.import_megatron(tmp_path / "megatron", tmp_path / "ck", tp=2)
    meta = ck.read_meta(tmp_path / "ck")
    assert (meta["megatron_tp"], meta["megatron_iteration"], meta["model"]["gelu"]) == (tp, 10, "erf")
    with torch.no_grad():
        ours = rs.load_model_for_eval(tmp_path / "ck", ProcessGroups.single())(IDS)[..., :VOCAB]
    assert (ours - reference).abs().max() / reference.abs().max() < 1e-5
