"""Issue 2: every TP (x DP) layout reproduces the serial model; collectives; RNG; bad configs."""

from __future__ import annotations

import pytest
import torch

from repro.models.config import ConfigError, ModelConfig
from repro.parallel import checks
from repro.parallel.groups import LayoutError, ParallelDims, ProcessGroups, discover_launch_env, spawns_ranks
from repro.parallel.layers import pad_vocab_size
from repro.parallel.spawn import run_ranks


def _rank_checks(layouts: list[tuple[int, int]]) -> list[dict]:
    return checks.run_all(layouts, include_hf=False)


def _failures(rows: list[dict]) -> list[dict]:
    return [r for r in rows if not r["passed"]]


@pytest.fixture(scope="module")
def two_ranks() -> list[dict]:
    """TP=2 (and TP=1 x DP=2) on 2 gloo ranks: every check of every rank."""
    return [row for rows in run_ranks(_rank_checks, 2, [(1, 2), (2, 1)]) for row in rows]


@pytest.fixture(scope="module")
def four_ranks() -> list[dict]:
    """TP=4 and TP=2 x DP=2 on 4 gloo ranks."""
    return [row for rows in run_ranks(_rank_checks, 4, [(4, 1), (2, 2)]) for row in rows]


def _named(rows, fragment):
    picked = [r for r in rows if fragment in r["name"]]
    assert picked, f"no check named like {fragment!r}"
    return picked


def test_single_process_layout_builds_the_serial_model_deterministically():
    """The equivalence check at tp=1 dp=1 (ProcessGroups.single(), no process group): a second model
    from the same seed has the same logits, loss and gradients. This checks deterministic init and
    forward and the check's own plumbing, not correctness: the serial model is checked against an
    independent implementation in test_serial_gradients_equal_huggingface_gpt2."""
    rows = [c.as_dict() for dt in (torch.float32, torch.float64)
            for c in checks.check_equivalence(ProcessGroups.single(), dt)]
    assert not _failures(rows), rows


@pytest.mark.parametrize("layout", ["tp=2 dp=1", "tp=1 dp=2"])
def test_two_rank_layouts_reproduce_serial(two_ranks, layout):
    rows = _named(two_ranks, layout)
    assert len(rows) == 2 * 2 * 5  # 2 ranks x (fp32, fp64) x (logits, padding, loss, grads, grad norm)
    assert not _failures(rows), _failures(rows)


@pytest.mark.parametrize("layout", ["tp=4 dp=1", "tp=2 dp=2"])
def test_four_rank_layouts_reproduce_serial(four_ranks, layout):
    rows = _named(four_ranks, layout)
    assert not _failures(rows), _failures(rows)


def test_float32_and_float64_tolerances_are_the_stated_ones(four_ranks):
    for row in _named(four_ranks, "float64: every gradient"):
        assert row["tolerance"] == 1e-10 and row["max_error"] < 1e-10
    for row in _named(four_ranks, "float32: every gradient"):
        assert row["tolerance"] == 1e-5 and row["max_error"] < 1e-5


def test_global_gradient_norm_equals_serial(two_ranks, four_ranks):
    """The TP-aware norm that clipping uses counts sharded parameters once and replicated ones once:
    at every layout it equals the serial model's norm (1e-5 fp32, 1e-10 fp64, as the gradients)."""
    rows = _named(two_ranks, "global gradient norm") + _named(four_ranks, "global gradient norm")
    assert rows and not _failures(rows), rows
    assert {r["tolerance"] for r in rows} == {1e-5, 1e-10}


def test_grad_norm_and_clipping_over_mixed_dtypes():
    """The foreach norm equals the per-tensor sum of squares, half gradients reduced in fp32 (their own
    bf16 sum of squares would round the norm to 3 digits), and clipping scales each gradient in place,
    in its own dtype, to the bound."""
    from repro.parallel.grads import clip_grad_norm, global_grad_norm

    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.zeros(n, dtype=dt)) for n, dt in
              ((1000, torch.bfloat16), (37, torch.float32), (5, torch.float64), (3000, torch.bfloat16),
               (2_000_000, torch.float32))]  # a flat fp32 sum would drift ~1e-5 at this size
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen, dtype=torch.float64).to(p.dtype)
    params.append(torch.nn.Parameter(torch.zeros(2)))  # no gradient: left out
    reference = sum(p.grad.double().pow(2).sum() for p in params if p.grad is not None).sqrt()
    norm = global_grad_norm(params)
    assert norm.dtype == torch.float64 and abs(norm.item() - reference.item()) / reference.item() < 1e-7
    before = [p.grad.clone() for p in params if p.grad is not None]
    assert clip_grad_norm(params, 1.0).item() == pytest.approx(norm.item())
    assert [p.grad.dtype for p in params[:5]] == [torch.bfloat16, torch.float32, torch.float64, torch.bfloat16,
                                                  torch.float32]
    assert global_grad_norm(params).item() == pytest.approx(1.0, rel=1e-2)  # bf16 rounding of the scaled values
    assert torch.allclose(params[2].grad, before[2] / (reference + 1e-6), rtol=1e-12)
    assert clip_grad_norm(params, 10.0).item() == pytest.approx(1.0, rel=1e-2)  # under the bound: unchanged
    assert global_grad_norm(params).item() == pytest.approx(1.0, rel=1e-2)


def test_the_gpu_foreach_sum_of_squares_equals_the_per_tensor_one():
    """The foreach kernel the GPU path takes (run here on CPU tensors small enough for its flat sum)."""
    from repro.parallel.grads import sum_of_squares

    gen = torch.Generator().manual_seed(1)
    for dtype in (torch.bfloat16, torch.float16, torch.float32, torch.float64):
        grads = [torch.randn(n, generator=gen).to(dtype) for n in (7, 300, 4096)]
        fused, looped = sum_of_squares(grads, dtype, foreach=True), sum_of_squares(grads, dtype, foreach=False)
        assert fused.dtype == looped.dtype == torch.promote_types(dtype, torch.float32)
        # fp32 rounding: a flat sum of 4k squares, then the norm's square root squared again
        assert abs(fused.item() - looped.item()) / looped.item() < 1e-5, dtype


def _bucketed_dp_average() -> tuple[list[list[float]], list[tuple[str, int]]]:
    """DP=2: gradients 1..n times (rank + 1) in fp32 and bf16, averaged in buckets of 64 bytes."""
    import torch.distributed as dist

    from repro.parallel.accounting import count_collectives
    from repro.parallel.grads import all_reduce_gradients

    rank = dist.get_rank()
    params = [torch.nn.Parameter(torch.zeros(n, dtype=dt)) for n, dt in
              ((4, torch.float32), (20, torch.float32), (3, torch.bfloat16), (2, torch.float32), (5, torch.bfloat16))]
    for p in params:
        p.grad = (torch.arange(p.numel()) + 1.0).to(p.dtype) * (rank + 1)
    with count_collectives() as log:
        all_reduce_gradients(params, dist.group.WORLD, bucket_bytes=64)
    return [p.grad.float().tolist() for p in params], [(op, n) for _, op, n, _ in log.calls]


def test_dp_gradient_average_in_buckets():
    """Each rank ends with the mean gradient, in its dtype; fp32 in buckets of at most 64 bytes (a
    20-element tensor is its own bucket), bf16 apart from fp32."""
    ranks = run_ranks(_bucketed_dp_average, 2)
    assert ranks[0] == ranks[1]
    grads, calls = ranks[0]
    assert grads == [[1.5 * (i + 1) for i in range(n)] for n in (4, 20, 3, 2, 5)]
    assert calls == [("all_reduce", 4), ("all_reduce", 20), ("all_reduce", 2), ("all_reduce", 8)]


def test_collective_counts_match_the_paper(two_ranks):
    assert not _failures(_named(two_ranks, "collectives"))
    assert not _failures(_named(two_ranks, "no all-gather"))


@pytest.mark.parametrize("fragment", ["parallel cross-entropy loss", "parallel cross-entropy grad"])
def test_vocab_parallel_cross_entropy(two_ranks, four_ranks, fragment):
    assert not _failures(_named(two_ranks, fragment) + _named(four_ranks, fragment))


@pytest.mark.parametrize("fragment", ["hidden dropout", "replicated activations", "TP-region dropout", "checkpointing"])
def test_dropout_rng_scheme(two_ranks, four_ranks, fragment):
    assert not _failures(_named(two_ranks, fragment) + _named(four_ranks, fragment))


def test_matches_huggingface_gpt2():
    rows = [c.as_dict() for c in checks.check_huggingface()]
    assert not _failures(rows), rows


def test_serial_gradients_equal_huggingface_gpt2():
    """The serial GPT's loss and gradients equal transformers.GPT2LMHeadModel's on the same weights
    (mapped by repro.models.hf.to_hf_state_dict, the export path) and the same batch, in float64 with
    dropout off. Every gradient is compared, the tied embedding's (input lookup plus output layer)
    first: a detached output-layer weight in our model (the serial and TP models alike) would leave
    it the lookup's share only. Tolerance 1e-10 relative: the two compute the same sums in another
    order (fused qkv vs Conv1D, their own softmax and layer norm), ~1e-15 each in float64."""
    import torch.nn.functional as F

    from repro.models.gpt import GPT
    from repro.models.hf import to_hf_gpt2, to_hf_state_dict

    cfg = checks.TINY
    assert cfg.hidden_dropout == cfg.attention_dropout == 0.0
    ours = GPT(cfg, seed=5)
    theirs = to_hf_gpt2(ours).double().eval()
    ours = ours.double().eval()
    ids, labels = checks.random_batch(cfg, 2, "cpu", seed=11)

    loss = ours.loss(ids, labels).mean()
    loss.backward()
    logits = theirs(ids).logits
    hf_loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
    hf_loss.backward()
    assert logits.dtype == torch.float64 and logits.shape[-1] == cfg.vocab_size
    assert checks.rel_error(loss.detach(), hf_loss.detach()) < 1e-10

    grads = to_hf_state_dict({n: p.grad for n, p in ours.named_parameters()}, cfg)  # HF names and layout
    hf_grads = {n: p.grad for n, p in theirs.named_parameters()}
    del grads["lm_head.weight"]  # tied: HF accumulates the head's share into transformer.wte.weight
    assert sorted(grads) == sorted(hf_grads) and "transformer.wte.weight" in grads
    errors = {n: checks.rel_error(grads[n], hf_grads[n]) for n in grads}
    assert errors["transformer.wte.weight"] < 1e-10, errors["transformer.wte.weight"]
    assert max(errors.values()) < 1e-10, {n: e for n, e in errors.items() if e >= 1e-10}
    padded = ours.transformer.wte.weight.grad[cfg.vocab_size:]
    assert padded.shape[0] > 0 and not padded.any()  # padded vocab rows: never looked up, never predicted


def _forward_counts_with_and_without_an_extra_all_reduce() -> tuple[bool, bool]:
    """At TP=2: does the intercepted forward equal the paper's count, as is and with one all-reduce more?"""
    import torch.distributed as dist

    from repro.models.gpt import GPT
    from repro.parallel.accounting import count_collectives
    from repro.parallel.groups import build_process_groups

    pg = build_process_groups(ParallelDims(tp=2, dp=1))
    cfg = checks.tiny_config(2)
    model = GPT(cfg, pg.tp_group, seed=1)
    ids, labels = checks.random_batch(cfg, 2, "cpu")
    want = checks.expected_tp_collectives(cfg.num_layers, 2, cfg.seq_length, cfg.hidden_size)["forward"]
    equal = []
    for extra in (False, True):
        with count_collectives() as log:
            model.loss(ids, labels).mean()
            if extra:  # e.g. a needless gather or a second reduction of the output
                dist.all_reduce(torch.ones(cfg.hidden_size), group=pg.tp_group)
        equal.append(log.counts("forward") == want)
    return tuple(equal)


def test_collective_counter_sees_a_mismatch():
    """The counting check can fail: one all-reduce more than the paper's count is a mismatch."""
    assert run_ranks(_forward_counts_with_and_without_an_extra_all_reduce, 2) == [(True, False)] * 2


def test_rank_grid_is_the_papers():
    dims = ParallelDims(tp=2, dp=4)
    assert dims.tp_groups() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert dims.dp_groups() == [[0, 2, 4, 6], [1, 3, 5, 7]]


def test_padded_vocab_reaches_51200_at_every_tp():
    for tp in (1, 2, 4, 8):
        assert pad_vocab_size(50257, 1024, tp) == 51200
    assert pad_vocab_size(1000, 128, 1) == 1024
    assert pad_vocab_size(1000, 128, 3) == 1152  # lcm(128, 3) = 384


@pytest.mark.parametrize("cfg, tp, needle", [
    (ModelConfig(num_attention_heads=4), 3, "num_attention_heads=4 is not divisible by tp=3"),
    (ModelConfig(hidden_size=64, num_attention_heads=6), 1, "hidden_size=64 is not divisible by num_attention_heads=6"),
])
def test_bad_model_configs_name_the_numbers(cfg, tp, needle):
    with pytest.raises(ConfigError, match=needle):
        cfg.validate(tp)


def test_bad_layout_names_the_numbers():
    with pytest.raises(LayoutError, match=r"tp=2 x dp=3 = 6 ranks, but the world size is 4"):
        ParallelDims(2, 3).validate(4)
    with pytest.raises(LayoutError, match=r"tp=3 does not divide world size 4"):
        ParallelDims.from_world(3, 4)


def test_rank_discovery_prefers_torchrun_then_slurm():
    torchrun = discover_launch_env({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "SLURM_PROCID": "0",
                                    "MASTER_ADDR": "h1", "MASTER_PORT": "1234"})
    assert (torchrun.rank, torchrun.world_size, torchrun.local_rank, torchrun.master_port) == (3, 4, 1, 1234)
    slurm = discover_launch_env({"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1",
                                 "SLURM_STEP_ID": "0", "MASTER_ADDR": "node7"})
    assert (slurm.rank, slurm.world_size, slurm.local_rank, slurm.master_addr) == (5, 8, 1, "node7")
    assert torchrun.launched and slurm.launched and not discover_launch_env({"LOCAL_RANK": "1"}).launched
    assert slurm.device() == (torch.device("cuda", 1) if torch.cuda.is_available() else torch.device("cpu"))


def test_a_one_task_step_is_a_world_of_one_and_its_nproc_spawns(monkeypatch):
    """`srun --preserve-env` (salloc's interactive step) keeps the allocation's SLURM_NTASKS: the step's
    own task count is the world. A `repro train --nproc N` started as the one rank of such a step (or of
    torchrun) spawns its ranks, so it does not take stop signals as a rank would (they were recorded and
    never acted on while the spawned ranks trained on)."""
    from repro.cli import _launched_train

    step = {"SLURM_PROCID": "0", "SLURM_NTASKS": "8", "SLURM_STEP_NUM_TASKS": "1", "SLURM_STEP_ID": "0"}
    assert discover_launch_env(step).world_size == 1
    two_tasks = discover_launch_env({**step, "SLURM_STEP_NUM_TASKS": "2"})
    assert spawns_ranks(discover_launch_env(step), 2) and spawns_ranks(discover_launch_env({}), 2)
    assert not spawns_ranks(two_tasks, 2) and not spawns_ranks(discover_launch_env(step), None)
    for var in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_STEP_ID", "SLURM_NTASKS", "SLURM_STEP_NUM_TASKS"):
        monkeypatch.delenv(var, raising=False)
    for key, value in step.items():
        monkeypatch.setenv(key, value)
    assert not _launched_train(["train", "cfg.yaml", "--nproc", "2"])
    assert _launched_train(["train", "cfg.yaml"])
    monkeypatch.setenv("SLURM_STEP_NUM_TASKS", "2")  # a rank of a two-task step: --nproc is not for it
    assert _launched_train(["train", "cfg.yaml", "--nproc=2"])
    monkeypatch.delenv("SLURM_STEP_ID")  # a batch script's own shell
    assert not _launched_train(["train", "cfg.yaml"])


def test_slurm_rendezvous_without_launch_sh_derives_the_port_and_never_guesses_the_master(monkeypatch):
    """Under plain `srun repro ...` (no launch.sh): the port comes from the job id like launch.sh's,
    and a failed `scontrol show hostnames` is an error, not each node electing itself master."""
    slurm = {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_JOB_ID": "123456", "SLURM_STEP_ID": "0", "MASTER_ADDR": "n1"}
    assert discover_launch_env(slurm).master_port == 15000 + 123456 % 15000 < 32768
    assert discover_launch_env({**slurm, "MASTER_PORT": "4242"}).master_port == 4242
    monkeypatch.setenv("SLURM_JOB_NODELIST", "n[1-2]")
    monkeypatch.setenv("PATH", "/nonexistent")  # no scontrol
    with pytest.raises(RuntimeError, match="MASTER_ADDR is not set.*slurm/launch.sh"):
        discover_launch_env({k: v for k, v in slurm.items() if k != "MASTER_ADDR"})
    alone = discover_launch_env({"SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_STEP_ID": "0"})  # one task: no master
    assert alone.master_addr == "127.0.0.1" and alone.world_size == 1


def test_gpu_index_follows_what_the_task_sees():
    from repro.parallel.groups import cuda_index

    assert [cuda_index(r, 8) for r in range(8)] == list(range(8))  # every task sees the node's 8 GPUs
    assert cuda_index(5, 1) == 0  # --gpus-per-task=1: the task's one GPU
    with pytest.raises(LayoutError, match="local rank 5 but this task sees 4 GPUs.*--gpu-bind=none"):
        cuda_index(5, 4)  # a NUMA-bound half of the node


def test_collective_timeout_is_configurable_and_checked():
    from repro.parallel.groups import collective_timeout_s

    assert collective_timeout_s({}) == 600 and collective_timeout_s({"REPRO_DIST_TIMEOUT_S": "3600"}) == 3600
    for bad in ("0", "30m", "-5"):
        with pytest.raises(LayoutError, match="REPRO_DIST_TIMEOUT_S.*whole number of seconds"):
            collective_timeout_s({"REPRO_DIST_TIMEOUT_S": bad})


def test_checkpointing_without_a_tracker_is_bit_identical():
    """The tracker-free checkpoint path (used when no TP-region stream exists) replays dropout too."""
    from dataclasses import replace

    from repro.models.gpt import GPT

    cfg = replace(checks.TINY, hidden_dropout=0.1, attention_dropout=0.1)
    ids = torch.randint(0, 1000, (2, 16), generator=torch.Generator().manual_seed(0))
    grads = []
    for recompute in (False, True):
        model = GPT(replace(cfg, activation_checkpointing=recompute), seed=3).train()
        torch.manual_seed(5)
        model.loss(ids, ids).mean().backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*grads))


def test_compiled_checkpointing_with_a_tracker():
    """torch.compile traces activation checkpointing with a TP-region tracker (it used to fail on the
    checkpoint's context_fn). Without dropout the compiled, checkpointed gradients equal eager ones
    (float32 within 1e-5: the compiler fuses and reorders sums); with dropout it trains finitely.
    At TP = 1 attention dropout forks no tracker, so the checkpoint is traced with it; at TP > 1 the
    tracker's checkpoint runs eagerly, replaying the masks (that the gradient is the forward's
    derivative in both: tests/test_compile_checkpoint_dropout.py)."""
    from dataclasses import replace

    from repro.models.gpt import GPT
    from repro.parallel.random import RNGTracker

    ids = torch.randint(0, 1000, (2, 16), generator=torch.Generator().manual_seed(0))

    def grads(cfg, compiled: bool) -> list[torch.Tensor]:
        model = GPT(cfg, rng=RNGTracker(1, 0), seed=3).train()
        loss_fn = torch.compile(model.loss) if compiled else model.loss
        loss_fn(ids, ids).mean().backward()
        return [p.grad for p in model.parameters()]

    eager = grads(checks.TINY, compiled=False)
    compiled = grads(replace(checks.TINY, activation_checkpointing=True), compiled=True)
    assert max((a - b).abs().max().item() / (a.abs().max().item() + 1e-12) for a, b in zip(eager, compiled)) < 1e-5
    dropout = replace(checks.TINY, activation_checkpointing=True, hidden_dropout=0.1, attention_dropout=0.1)
    assert all(torch.isfinite(g).all() and g.abs().sum() > 0 for g in grads(dropout, compiled=True))


def test_per_layer_compile_replays_dropout_under_checkpointing():
    """train.compile_scope blocks (each layer compiled, the checkpoint around it eager, so our
    context_fn replays the TP-region tracker): with dropout, checkpointed gradients equal the
    non-checkpointed ones exactly; without dropout they equal eager's within 1e-5 (fused sums)."""
    from dataclasses import replace

    from repro.models.gpt import GPT
    from repro.parallel.random import RNGTracker
    from repro.train.engine import compiled

    ids = torch.randint(0, 1000, (2, 16), generator=torch.Generator().manual_seed(0))

    def grads(cfg, per_layer: bool) -> list[torch.Tensor]:
        model = GPT(cfg, rng=RNGTracker(1, 0), seed=3).train()
        if per_layer:
            compiled(model, model, "blocks")
        torch.manual_seed(12)
        model.loss(ids, ids).mean().backward()
        return [p.grad for p in model.parameters()]

    dropout = replace(checks.TINY, hidden_dropout=0.1, attention_dropout=0.1)
    plain, recomputed = grads(dropout, True), grads(replace(dropout, activation_checkpointing=True), True)
    assert all(torch.equal(a, b) for a, b in zip(plain, recomputed))
    eager, per_layer = grads(checks.TINY, False), grads(replace(checks.TINY, activation_checkpointing=True), True)
    assert max((a - b).abs().max().item() / (a.abs().max().item() + 1e-12) for a, b in zip(eager, per_layer)) < 1e-5


@pytest.mark.parametrize("setting", [{"layernorm_order": "post"}, {"num_tokentypes": 2}, {"lm_head_gelu": "erf"}])
def test_a_gpt_refuses_bert_only_settings_by_name(setting):
    """A GPT is pre-LN, without token types or an MLM head: these used to be ignored silently (a 'post'
    GPT trained pre-LN curves labelled post)."""
    from repro.models.gpt import GPT

    name, value = next(iter(setting.items()))
    with pytest.raises(ConfigError, match=f"{name}={value!r}: BERT-only .* or train family: bert"):
        GPT(ModelConfig(num_layers=1, hidden_size=16, num_attention_heads=2, vocab_size=100, seq_length=8, **setting))


def test_an_unknown_layernorm_order_is_refused_for_every_family():
    with pytest.raises(ConfigError, match="layernorm_order='bogus' is not one of"):
        ModelConfig(layernorm_order="bogus").validate()


def test_gpt_and_bert_refuse_inputs_they_have_no_positions_for_alike():
    from repro.models.bert import BERT
    from repro.models.bert_checks import TINY_BERT
    from repro.models.gpt import GPT

    gpt, bert = GPT(checks.TINY, seed=1), BERT(TINY_BERT, seed=1)
    long = torch.zeros(1, checks.TINY.seq_length + 1, dtype=torch.long)
    for run in (lambda: gpt(long), lambda: bert.encode(long, long, torch.ones_like(long))):
        with pytest.raises(ValueError, match=r"sequence length 17 exceeds the model's seq_length 16: truncate"):
            run()
    with pytest.raises(ValueError, match=r"token ids of shape \(5,\): .* batch"):
        gpt(torch.zeros(5, dtype=torch.long))


def test_strided_column_split_names_tp_times_stride():
    from repro.parallel.layers import ColumnParallelLinear

    with pytest.raises(ValueError, match=r"out_features=10 must be divisible by tp\*stride = 1\*3"):
        ColumnParallelLinear(8, 10, stride=3)


def _reduce_results() -> dict:
    import torch.distributed as dist

    from repro.parallel.mappings import reduce_from_tensor_parallel_region

    group, rank = dist.group.WORLD, dist.get_rank()
    x = torch.full((3,), float(rank + 1))
    y = reduce_from_tensor_parallel_region(x, group)
    leaf = torch.full((3,), float(rank + 1), requires_grad=True)
    try:
        reduce_from_tensor_parallel_region(leaf, group).mul(2).sum().backward()
    except RuntimeError as err:
        return {"x": x.tolist(), "y": y.tolist(), "leaf": str(err).splitlines()[0]}
    return {"x": x.tolist(), "y": y.tolist(), "leaf_grad": leaf.grad.tolist()}


def _in_place_reduce() -> bool:
    import torch.distributed as dist

    from repro.parallel.mappings import reduce_from_tensor_parallel_region_

    fresh = torch.full((3,), float(dist.get_rank() + 1))
    return reduce_from_tensor_parallel_region_(fresh, dist.group.WORLD).data_ptr() == fresh.data_ptr() and \
        fresh.tolist() == [3.0] * 3


def test_public_g_leaves_its_input_while_the_layers_reduce_in_place():
    """TP=2: reduce_from_tensor_parallel_region sums into a new tensor (it used to overwrite the caller's,
    and a leaf that requires grad raised); the layers' hot path keeps Megatron's in-place sum."""
    for rank, got in enumerate(run_ranks(_reduce_results, 2)):
        assert got == {"x": [rank + 1.0] * 3, "y": [3.0] * 3, "leaf_grad": [2.0] * 3}, got
    assert run_ranks(_in_place_reduce, 2) == [True, True]


def test_compiled_cross_entropy_backward_is_one_pass_with_eager_gradients():
    """Compiled, the cross-entropy backward goes from the saved half logits to the half gradient in one
    fused loop: the generated code allocates no (tokens, vocab) buffer (the in-place scatter made the
    compiler write a float32 one and read it back; 3.4 GB a step at 1.2B parameters), and the
    gradients equal eager's bit for bit (measured: identical; the one-hot subtracts what the scatter adds)."""
    import re

    from torch._inductor.utils import run_and_get_code

    from repro.parallel.cross_entropy import vocab_parallel_cross_entropy

    tokens, vocab = 64, 1024
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, 32, generator=gen).bfloat16()
    target = torch.randint(0, vocab, (tokens,), generator=gen)
    weight = torch.randn(32, vocab, generator=gen).bfloat16().requires_grad_()

    def step():
        vocab_parallel_cross_entropy(x @ weight, target).mean().backward()
        grad, weight.grad = weight.grad, None
        return grad

    eager = step()
    compiled, (_, backward) = run_and_get_code(torch.compile(step))
    assert torch.equal(compiled, eager)
    shapes = re.findall(r"empty_strided_cpu\(\(([^)]*)\)", backward)
    assert f"{tokens}, {vocab}" not in shapes, shapes


def test_compiled_gpt_masks_padded_vocab_as_eager_does():
    """Compiled, the padded vocab columns are masked out of place (the in-place fill compiled to a store
    of every logit): the same logits, -inf at the padding, the same loss to fp32 rounding, and no
    gradient into the padded rows of the tied embedding."""
    from repro.models.gpt import GPT

    cfg = ModelConfig(num_layers=1, hidden_size=64, num_attention_heads=4, seq_length=32, vocab_size=1000,
                      make_vocab_size_divisible_by=128, hidden_dropout=0.0, attention_dropout=0.0)
    model = GPT(cfg, seed=3)
    ids = torch.randint(0, cfg.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    eager_logits, compiled_logits = model.logits(ids), torch.compile(model.logits)(ids)
    assert torch.isneginf(compiled_logits[..., cfg.vocab_size:]).all()
    torch.testing.assert_close(compiled_logits, eager_logits, rtol=1e-5, atol=1e-5)
    compiled_loss = torch.compile(model.loss)(ids, ids).mean()
    compiled_loss.backward()
    assert abs(compiled_loss.item() - model.loss(ids, ids).mean().item()) < 1e-5
    assert not model.transformer.wte.weight.grad[cfg.vocab_size:].any()
    assert model.transformer.wte.weight.grad[:cfg.vocab_size].any()


def _attention_dropout_without_a_tracker() -> tuple[str, bool, bool]:
    """At TP=2 with attention dropout: (the error without an RNG tracker in training, whether eval runs
    without one, whether training runs with one)."""
    from dataclasses import replace

    from repro.models.gpt import GPT
    from repro.parallel.groups import build_process_groups
    from repro.parallel.random import RNGTracker

    pg = build_process_groups(ParallelDims(tp=2, dp=1))
    cfg = replace(checks.tiny_config(2), attention_dropout=0.5)
    ids, labels = checks.random_batch(cfg, 2, "cpu")
    bare = GPT(cfg, pg.tp_group, seed=1).train()
    try:
        bare.loss(ids, labels)
        error = ""
    except ValueError as err:
        error = str(err)
    evaluated = bool(torch.isfinite(bare.eval().loss(ids, labels)).all())
    tracked = GPT(cfg, pg.tp_group, RNGTracker(1, pg.tp_rank), seed=1).train()
    return error, evaluated, bool(torch.isfinite(tracked.loss(ids, labels)).all())


def test_attention_dropout_at_tp2_needs_an_rng_tracker():
    """Without a tracker every TP rank drew the same attention-dropout mask for its head i (the default
    generator is seeded alike on every rank); training now refuses, naming the fix. Evaluation (no
    dropout) needs no tracker."""
    for error, evaluated, tracked in run_ranks(_attention_dropout_without_a_tracker, 2):
        assert "attention dropout at TP=2 without an RNG tracker" in error and "rng=RNGTracker(seed, tp_rank)" in error
        assert evaluated and tracked
