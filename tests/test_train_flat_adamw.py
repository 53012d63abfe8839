"""The flat AdamW step that rounds the masters into the half model (repro.train.flat_adamw).

Reference: torch.optim.AdamW (its single-tensor loop) on separate fp32 masters, then
`masters_to_model`. Both evaluate the same fp32 expression per element, but in a different order (the
flat kernel computes the decayed master and the update in one expression, torch in several in-place
passes; compiled, the compiler reorders again), so elements differ by a few fp32 ulps. The error is
measured as the largest absolute difference over the largest magnitude of the tensor (an element
near zero has no meaningful relative error): over 6 steps of lr 1e-2 at most 2.1e-7 (eager and
compiled; 2^-23 = 1.2e-7). The bound, 1e-6, leaves a factor of 5; leaving out the weight decay
(lr * wd = 1e-3 a step) moves the matrices by 4e-3 to 5e-3 on that scale. The half parameters must
equal the masters rounded, exactly.
"""

from __future__ import annotations

import copy
import re
import warnings
from pathlib import Path

import pytest
import torch

from repro.models.config import ModelConfig
from repro.models.gpt import GPT
from repro.parallel.spawn import run_ranks
from repro.train.commands import train_rank
from repro.train.config import OptimConfig, RunConfigError, derive, load_config
from repro.train.flat_adamw import FlatMasterAdamW
from repro.train.main_grads import MainGrads
from repro.train.mixed_precision import MasterWeights
from repro.train.optim import DynamicLossScaler, build_optimizer, clip_and_step
from train_fixtures import corpus, data_dir, data_mirror, tiny_overrides  # noqa: F401

TINY = str(Path(__file__).resolve().parents[1] / "experiments/tiny/gpt_tiny.yaml")
HALF_BF16 = {"precision.precision": "bf16", "precision.params": "half"}
LOSS_NATS = 1e-3
BOUND = 1e-6
STEPS = 6


def _tiny_gpt() -> GPT:
    cfg = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32, vocab_size=512,
                      make_vocab_size_divisible_by=128, hidden_dropout=0.0, attention_dropout=0.0)
    return GPT(cfg, seed=3)


def _half_setup(bucket_numel: int = 2**14):
    model = _tiny_gpt()
    masters = MasterWeights(model, torch.bfloat16)
    main = MainGrads(masters.pairs(), bucket_numel=bucket_numel)
    opt = build_optimizer(masters, OptimConfig(lr=1e-2, weight_decay=0.1, fused=False))
    return model, masters, main, opt


def _fill_grads(main: MainGrads, step: int) -> None:
    gen = torch.Generator().manual_seed(100 + step)
    for bucket in main.buckets:
        bucket.flat.copy_(torch.randn(bucket.flat.shape, generator=gen))


def _run(flat: bool, compile: bool = False, grad_scale: float | None = None):
    model, masters, main, opt = _half_setup()
    stepper = FlatMasterAdamW(opt, masters, main, compile=compile) if flat else None
    for step in range(STEPS):
        _fill_grads(main, step)
        if flat:
            stepper.step(None if grad_scale is None else torch.tensor([grad_scale]))
        else:
            if grad_scale is not None:
                torch._foreach_div_([m.grad for m in masters.parameters()], grad_scale)
            opt.step()
            masters.masters_to_model()
    return model, masters, opt


def _assert_same(flat_run, ref_run) -> None:
    (model, masters, opt), (_, ref_masters, ref_opt) = flat_run, ref_run
    for (name, m), (_, r) in zip(masters.named_parameters(), ref_masters.named_parameters()):
        for what, got, want in (("master", m, r), ("exp_avg", opt.state[m]["exp_avg"], ref_opt.state[r]["exp_avg"]),
                                ("exp_avg_sq", opt.state[m]["exp_avg_sq"], ref_opt.state[r]["exp_avg_sq"])):
            error = _error(got, want)
            assert error <= BOUND, f"{name} {what}: {error:.2e} of its largest magnitude"
    # the flat step writes its count into the state when it is saved
    assert {int(st["step"]) for st in opt.state_dict()["state"].values()} == {STEPS}
    for (name, p), (_, m) in zip(model.named_parameters(), masters.named_parameters()):
        assert p.dtype == torch.bfloat16
        assert torch.equal(p, m.to(torch.bfloat16)), f"{name}: half parameter is not its master rounded"


def test_flat_step_matches_torch_adamw_and_rounds_into_model():
    _assert_same(_run(flat=True), _run(flat=False))


def test_grad_scale_divides_the_gradient_as_fused_adamw_does():
    _assert_same(_run(flat=True, grad_scale=3.0), _run(flat=False, grad_scale=3.0))


def test_compiled_kernel_matches_eager():
    """The compiled kernel (a GPU's default) computes what the eager one does on CPU."""
    _assert_same(_run(flat=True, compile=True), _run(flat=False))


def _fp16_schedule_run(flat: bool, compile: bool = False):
    """fp16 masters' half model under a loss scale of 1024, a clip, an lr that changes every step
    (LambdaLR) and an inf gradient at step 3: the plain path is clip_and_step over torch's single-tensor
    AdamW, then masters_to_model. Returns the masters, the optimizer, the skipped steps and any
    LR-scheduler warnings."""
    model = _tiny_gpt()
    masters = MasterWeights(model, torch.float16)
    main = MainGrads(masters.pairs(), bucket_numel=2**14)
    opt = build_optimizer(masters, OptimConfig(lr=1e-2, weight_decay=0.1, fused=False, adam_beta1=0.8,
                                               adam_beta2=0.9, adam_eps=1e-3))
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: (1.0, 0.3, 2.0, 0.05, 1.0, 0.7)[i % 6])
    stepper = FlatMasterAdamW(opt, masters, main, compile=compile) if flat else None
    scaler, skipped_steps = DynamicLossScaler(scale=1024.0), []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(STEPS):
            gen = torch.Generator().manual_seed(step)
            for bucket in main.buckets:
                bucket.flat.copy_(torch.randn(bucket.flat.shape, generator=gen) * 1024 * (1e-4 if step % 2 else 1.0))
                bucket.flat[5] = float("inf") if step == 3 else bucket.flat[5]
            _, skipped = clip_and_step(opt, masters.parameters(), 1.0, scaler=scaler, fold=False, flat=stepper)
            scaler.update(skipped)
            if skipped:
                skipped_steps.append(step)
                continue
            if stepper is None:
                masters.masters_to_model()
            schedule.step()
    scheduler_warnings = [str(w.message) for w in caught if "lr_scheduler" in str(w.message)]
    return model, masters, opt, skipped_steps, scheduler_warnings


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
def test_changing_lr_and_fp16_overflow_skip_match_torch_adamw(compile):
    """The lr is read every step, an overflowed step leaves buffers and step count alone (both paths
    skip step 3 and count 5 steps), the loss scale and clip divide the gradient as torch's unscale and
    clip do; the masters agree to BOUND (measured 2.0e-7) and no LR-scheduler order warning is raised."""
    model, masters, opt, skipped, warned = _fp16_schedule_run(flat=True, compile=compile)
    _, ref_masters, ref_opt, ref_skipped, ref_warned = _fp16_schedule_run(flat=False)
    assert skipped == ref_skipped == [3] and warned == ref_warned == [], (skipped, warned)
    assert {int(st["step"]) for st in opt.state_dict()["state"].values()} == {STEPS - 1}
    assert opt.param_groups[0]["lr"] == ref_opt.param_groups[0]["lr"]
    for (name, got), want in zip(masters.named_parameters(), ref_masters.parameters()):
        assert _error(got, want) <= BOUND, name
    for (name, p), m in zip(model.named_parameters(), masters.parameters()):
        assert torch.equal(p, m.to(torch.float16)), name


def test_runs_are_two_per_bucket_and_cover_every_element():
    """Eagerly one call a run; compiled, one a bucket (its two runs told apart by the layout)."""
    _, masters, main, opt = _half_setup()
    stepper = FlatMasterAdamW(opt, masters, main)
    assert len(stepper.calls) == len(stepper.runs)
    _, masters_c, main_c, opt_c = _half_setup()
    assert len(FlatMasterAdamW(opt_c, masters_c, main_c, compile=True).calls) == len(main_c.buckets)
    for b, bucket in enumerate(main.buckets):
        runs = [r for r in stepper.runs if r.bucket == b]
        assert len(runs) <= 2
        assert runs[0].start == 0 and runs[-1].end == bucket.flat.numel()
        assert all(a.end == b_.start for a, b_ in zip(runs, runs[1:]))
        decays = [opt.param_groups[r.group]["weight_decay"] for r in runs]
        assert decays == sorted(decays, reverse=True)  # matrices (decayed) first


def test_compiled_two_run_kernel_allocates_nothing():
    """The compiled bucket kernel selects each element's param-group scalars in the kernel: inductor's
    generated code (CPU here; the scheduler that decides it is the one the GPU's Triton code shares)
    is one fused loop with no intermediate buffer. An earlier form (one [n, 7] select of the scalar
    rows) made inductor write and read 28 bytes an element more: 68 GB a step at 1.2B parameters."""
    from torch._inductor.utils import run_and_get_code

    from repro.train.flat_adamw import adamw_and_round_two_runs

    n = 3000
    tensors = [torch.randn(n), torch.randn(n), torch.zeros(n), torch.rand(n), torch.empty(n, dtype=torch.bfloat16)]
    kernel = torch.compile(adamw_and_round_two_runs, dynamic=True, fullgraph=True)
    _, (code,) = run_and_get_code(kernel, *tensors, torch.rand(2, 7), torch.tensor([0, 1, 2000]), torch.ones(()))
    assert not re.search(r"empty_strided\w*\(", code), code  # no buffer allocated


def _norm_rank() -> dict:
    """TP=2: the flat runs' norm and uncounted sum of squares against repro.parallel.grads' per-parameter
    ones, with different random gradients on each rank (the replicated ones too: the norm counts
    them on TP rank 0 only)."""
    import torch.distributed as dist

    from repro.parallel.grads import global_grad_norm, uncounted_sum_of_squares

    cfg = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32, vocab_size=512,
                      make_vocab_size_divisible_by=128)
    model = GPT(cfg, tp_group=dist.group.WORLD, seed=3)
    masters = MasterWeights(model, torch.bfloat16)
    main = MainGrads(masters.pairs(), bucket_numel=2**13)
    stepper = FlatMasterAdamW(build_optimizer(masters, OptimConfig(fused=False)), masters, main)
    gen = torch.Generator().manual_seed(dist.get_rank())
    for bucket in main.buckets:
        bucket.flat.copy_(torch.randn(bucket.flat.shape, generator=gen))
    params = masters.parameters()
    return {"norm": (stepper.grad_norm(dist.group.WORLD).item(), global_grad_norm(params, dist.group.WORLD).item()),
            "uncounted": (stepper.uncounted_sum_of_squares(dist.group.WORLD).item(),
                          uncounted_sum_of_squares(params, dist.group.WORLD).item()),
            "norm_runs": len(stepper.norm_runs), "buckets": len(main.buckets)}


def test_flat_grad_norm_is_the_tp_aware_norm():
    """Summed over a few flat runs instead of per parameter: the same value to fp32 summation order
    (measured: equal, and 8.4e-8 relative for the uncounted sum; bound 1e-6)."""
    for rank, r in enumerate(run_ranks(_norm_rank, 2)):
        (flat, want), (flat_u, want_u) = r["norm"], r["uncounted"]
        assert abs(flat - want) <= 1e-6 * want, r
        assert (flat_u == want_u == 0.0) if rank == 0 else abs(flat_u - want_u) <= 1e-6 * want_u, r
        assert r["norm_runs"] <= 4 * r["buckets"], r


def test_state_dict_round_trip_lands_in_the_flat_buffers():
    """A checkpointed optimizer state loads back into the flat moments (the resumed step continues
    the run); torch's plain AdamW loads the same state dict, and from there the next step of each,
    on the same gradients, agrees to BOUND (a lost moment or step count would move it by ~lr)."""
    model, masters, opt = _run(flat=True)
    saved = copy.deepcopy(opt.state_dict())
    _, masters2, main2, opt2 = _half_setup()
    stepper2 = FlatMasterAdamW(opt2, masters2, main2)
    opt2.load_state_dict(saved)
    assert stepper2.steps == STEPS
    flat_storages = {f["exp_avg"].untyped_storage().data_ptr() for f in stepper2.flat}
    for m1, m2 in zip(masters.parameters(), masters2.parameters()):
        view = opt2.state[m2]["exp_avg"]
        assert torch.equal(view, opt.state[m1]["exp_avg"])
        assert view.untyped_storage().data_ptr() in flat_storages
    _, plain_masters, plain_main, plain = _half_setup()
    plain.load_state_dict(saved)
    for resumed in (masters2, plain_masters):
        for got, want in zip(resumed.parameters(), masters.parameters()):
            got.data.copy_(want)  # the model file's masters
    for main in (main2, plain_main):
        _fill_grads(main, STEPS)
    stepper2.step()
    plain.step()
    for (name, got), want in zip(plain_masters.named_parameters(), masters2.parameters()):
        assert _error(got, want) <= BOUND, name
        assert int(plain.state[got]["step"]) == STEPS + 1


def test_loading_hands_torch_the_flat_views_and_leaves_the_callers_dict_alone():
    """The moments are copied into the flat buffers before torch's load (no second device copy of the
    state): the loaded state holds the very views, and the dict passed in still holds its own tensors."""
    _, _, opt = _run(flat=True)
    saved = copy.deepcopy(opt.state_dict())
    before = {k: v["exp_avg"].clone() for k, v in saved["state"].items()}
    _, masters2, main2, opt2 = _half_setup()
    stepper2 = FlatMasterAdamW(opt2, masters2, main2)
    loaded = []  # what torch's load itself put in the state, before the stepper's post hook
    opt2.register_load_state_dict_post_hook(
        lambda o: loaded.extend(o.state[m][name] is stepper2._moment_views[m][name]
                                for m in masters2.parameters() for name in ("exp_avg", "exp_avg_sq")), prepend=True)
    opt2.load_state_dict(saved)
    assert loaded and all(loaded)
    flat_storages = {f["exp_avg"].untyped_storage().data_ptr() for f in stepper2.flat}
    for k, v in saved["state"].items():
        assert v["exp_avg"].untyped_storage().data_ptr() not in flat_storages
        assert torch.equal(v["exp_avg"], before[k])


def test_loading_a_state_without_moments_zeroes_them():
    """As a fresh torch AdamW would start: loading an unstepped optimizer's state after 6 steps leaves
    no stale moments behind, and the step count is back to 0."""
    _, masters, opt = _run(flat=True)
    _, fresh_masters, _, fresh = _half_setup()
    opt.load_state_dict(fresh.state_dict())
    stepper_steps = {int(st["step"]) for st in opt.state_dict()["state"].values()}
    assert stepper_steps == {0}
    for master in masters.parameters():
        assert not opt.state[master]["exp_avg"].any() and not opt.state[master]["exp_avg_sq"].any()


def test_loading_options_it_does_not_implement_is_refused():
    _, _, opt = _run(flat=True)
    saved = copy.deepcopy(opt.state_dict())
    for group in saved["param_groups"]:
        group["amsgrad"] = True
    with pytest.raises(ValueError, match="amsgrad"):
        opt.load_state_dict(saved)


def test_refuses_what_it_does_not_implement():
    _, masters, main, _ = _half_setup()
    amsgrad = torch.optim.AdamW(masters.parameters(), amsgrad=True)
    with pytest.raises(ValueError, match="amsgrad"):
        FlatMasterAdamW(amsgrad, masters, main)
    partial = torch.optim.AdamW(masters.parameters()[:3])
    with pytest.raises(ValueError, match="exactly the fp32 masters"):
        FlatMasterAdamW(partial, masters, main)


def _run_losses(run_dir) -> dict[int, float]:
    from repro.tracking.run_dir import read_metrics

    return {row["step"]: row["loss"] for row in read_metrics(run_dir) if "loss" in row}


def test_trainer_with_flat_step_follows_the_plain_step_and_resumes(corpus, tmp_path):
    """`optim.flat_step` in the trainer at TP=2 (the TP-aware clip folded into the flat kernel): the
    loss curve of the plain step to LOSS_NATS (measured: 8.4e-5 nats over 10 iterations, equal over
    the first 4); 3 + 3 iterations over two launches equal one launch of 6 bit for bit (the moments
    and step count come back into the flat buffers); and a checkpoint of the flat step resumes under
    the plain one (the same optimizer state format; stepped alike to fp32 rounding:
    test_state_dict_round_trip_lands_in_the_flat_buffers)."""
    base = {**HALF_BF16, "parallel.tp": 2, "optim.lr_decay_iters": 6, "train.train_iters": 6}
    runs = {}
    for name, flat in (("plain", False), ("flat", True)):
        runs[name] = tmp_path / name
        run_ranks(train_rank, 2, TINY, tiny_overrides(corpus, runs[name], **base, **{"optim.flat_step": flat}))
    plain, flat = _run_losses(runs["plain"]), _run_losses(runs["flat"])
    assert len(flat) == 6 and max(abs(plain[k] - flat[k]) for k in plain) < LOSS_NATS, (plain, flat)
    flat_masters = _final_masters(runs["flat"])
    for resumed_flat in (True, False):
        split = tmp_path / f"split_{resumed_flat}"
        over = tiny_overrides(corpus, split, **base, **{"optim.flat_step": True})
        run_ranks(train_rank, 2, TINY, over + ["train.train_iters=3"])
        run_ranks(train_rank, 2, TINY, over + [f"optim.flat_step={str(resumed_flat).lower()}"])
        losses, masters = _run_losses(split), _final_masters(split)
        if resumed_flat:
            assert losses == flat and all(torch.equal(masters[k], flat_masters[k]) for k in masters)
        else:  # torch's AdamW took over: same losses to LOSS_NATS; its masters round differently, and a
            # gradient that is rounding noise (the attention key bias's) makes Adam steps of ~lr either way
            assert max(abs(flat[k] - losses[k]) for k in flat) < LOSS_NATS, (flat, losses)


def _final_masters(run_dir) -> dict[str, torch.Tensor]:
    from repro.train import checkpoint as ck

    return ck.load_file(ck.latest_checkpoint(run_dir / "checkpoints") / "model_tp00.pt")


def _error(got: torch.Tensor, want: torch.Tensor) -> float:
    """The largest absolute difference over the largest magnitude of `want` (see the module doc)."""
    scale = want.abs().max()
    return ((got - want).abs().max() / scale).item() if scale > 0 else (got - want).abs().max().item()


def test_flat_step_needs_half_params_with_fp32_main_grads():
    for extra in ({}, {**HALF_BF16, "precision.main_grads": "param"}, {**HALF_BF16, "train.zero_stage": 1}):
        cfg = load_config(TINY, [f"{k}={v}" for k, v in {**extra, "optim.flat_step": True}.items()])
        with pytest.raises(RunConfigError, match="optim.flat_step"):
            derive(cfg, 2)
