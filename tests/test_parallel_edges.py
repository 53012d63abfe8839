"""Edges of the TP layers found in review: world sizes with a factor other than 2, out-of-range ids
and targets, the same model at every TP degree whatever the vocab padding, TP markers after a
meta-device load, and the spawn harness's GPU count check."""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import re
import sys
import time

import pytest
import torch

from repro.models.bert import BERT, BertConfig
from repro.models.bert_checks import TINY_BERT, run_bert_checks
from repro.models.gpt import GPT
from repro.parallel import checks
from repro.parallel.cross_entropy import vocab_parallel_cross_entropy
from repro.parallel.layers import ColumnParallelLinear, VocabParallelEmbedding, gather_full, is_tensor_parallel
from repro.parallel.spawn import check_gpu_count, join_process_group, launch_ranks, leave_process_group, run_ranks

BAD_ID = r"token id is outside \[0, 1000\)"
BAD_TARGET = r"target is outside \[0, 1024\)"


# --- world size 3: the selftest checks and the same model at tp=3 as at tp=1 -----------------------

def _full_state(model: torch.nn.Module, tp_group, vocab_size: int) -> dict[str, torch.Tensor]:
    """Every parameter unsharded, vocabulary-indexed ones cut to the real vocab."""
    from repro.train.reshard import VOCAB_ROWS

    full = {}
    with torch.no_grad():
        for name, p in model.named_parameters():
            t = gather_full(p, tp_group) if is_tensor_parallel(p) and tp_group is not None else p
            full[name] = t[:vocab_size] if name in VOCAB_ROWS else t
    return full


def _same_as_serial(family, cfg, pg) -> dict:
    """Does the tp=3 model equal the serial one with the same seed (the vocab padding differs)?"""
    serial, sharded = family(cfg, seed=42), family(cfg, pg.tp_group, seed=42)
    ours, ref = _full_state(sharded, pg.tp_group, cfg.vocab_size), _full_state(serial, None, cfg.vocab_size)
    return {"padded": (serial.padded_vocab, sharded.padded_vocab), "names": sorted(ours) == sorted(ref),
            "differ": [n for n in ref if not torch.equal(ours[n], ref[n])]}


def _world_of_three() -> dict:
    from repro.parallel.groups import ParallelDims, build_process_groups
    from repro.parallel.selftest import layouts_for

    rows = checks.run_all(layouts_for(3), include_hf=False) + run_bert_checks([(3, 1)])
    pg = build_process_groups(ParallelDims(3, 1))
    gpt = checks.tiny_config(3, make_vocab_size_divisible_by=1024)
    bert = BertConfig(**{**TINY_BERT.__dict__, **checks.tiny_dims(3), "make_vocab_size_divisible_by": 1024})
    return {"rows": rows, "gpt": _same_as_serial(GPT, gpt, pg), "bert": _same_as_serial(BERT, bert, pg)}


@pytest.fixture(scope="module")
def three_ranks() -> list[dict]:
    return run_ranks(_world_of_three, 3, timeout=240)


def test_selftest_checks_pass_on_three_ranks(three_ranks):
    """Every (tp, dp) layout of 3 ranks ((1, 3) and (3, 1)) reproduces the serial GPT and BERT: the
    tiny models have lcm(4, tp) heads, so tp=3 splits them."""
    rows = [r for result in three_ranks for r in result["rows"]]
    names = {r["name"] for r in rows}
    assert any("tp=3 dp=1" in n for n in names) and any("tp=1 dp=3" in n for n in names)
    assert any("bert pre tp=3" in n for n in names) and any("collectives" in n for n in names)
    assert not [r for r in rows if not r["passed"]]


@pytest.mark.parametrize("family", ["gpt", "bert"])
def test_same_seed_gives_the_same_model_at_tp3_as_at_tp1(three_ranks, family):
    """divisible_by=1024 pads the vocab to 1024 at tp=1 but 3072 at tp=3; the real vocab rows and
    every other parameter are still bit-identical (the generator draws the same values)."""
    for result in three_ranks:
        got = result[family]
        assert got["padded"] == (1024, 3072) and got["names"]
        assert got["differ"] == []


def test_tiny_models_split_at_every_tp():
    for tp in range(1, 9):
        checks.tiny_config(tp).validate(tp)
        assert checks.tiny_config(tp).head_dim == checks.TINY.head_dim
    assert checks.tiny_config(2) == checks.TINY  # the sizes of the existing checks are unchanged


# --- out-of-range token ids and targets ------------------------------------------------------------

def _errors(tp_group=None) -> dict[str, str]:
    """The error message (or "ok") of each out-of-range id and target, vocab 1000 padded to 1024."""
    emb = VocabParallelEmbedding(1024, 8, tp_group=tp_group, vocab_size=1000)
    tp = 1 if tp_group is None else tp_group.size()
    logits = torch.randn(2, 1024 // tp)
    cases = {f"id {i}": lambda i=i: emb(torch.tensor([[3, i]])) for i in (-1, 999, 1000, 1023, 5000)}
    cases |= {f"target {t}": lambda t=t: vocab_parallel_cross_entropy(logits, torch.tensor([3, t]), tp_group)
              for t in (-100, -1, 1023, 1024)}
    cases |= {f"target {t} of vocab 1000": lambda t=t: vocab_parallel_cross_entropy(
        logits, torch.tensor([3, t]), tp_group, vocab_size=1000) for t in (999, 1000, 1023)}
    out = {}
    for name, case in cases.items():
        try:
            case()
            out[name] = "ok"
        except RuntimeError as err:
            out[name] = str(err)
    return out


def _errors_at_tp2() -> dict[str, str]:
    from repro.parallel.groups import ParallelDims, build_process_groups

    return _errors(build_process_groups(ParallelDims(2, 1)).tp_group)


def _assert_refused(errors: dict[str, str]) -> None:
    import re

    for name in ("id -1", "id 1000", "id 1023", "id 5000"):  # 1023: a padded row, not a token
        assert re.search(BAD_ID, errors[name]), (name, errors[name])
    for name in ("target -100", "target -1", "target 1024"):
        assert re.search(BAD_TARGET, errors[name]), (name, errors[name])
    for name in ("target 1000 of vocab 1000", "target 1023 of vocab 1000"):  # padded columns: -inf logits
        assert re.search(r"target is outside \[0, 1000\)", errors[name]), (name, errors[name])
    assert errors["id 999"] == errors["target 1023"] == errors["target 999 of vocab 1000"] == "ok"


def test_out_of_range_ids_and_targets_fail_alike_at_tp1_and_tp2():
    """An id outside [0, vocab) and a target outside [0, padded vocab), or [0, vocab) where the caller
    names the vocab (-100 included: there is no ignore-index) raise the same error at every TP degree,
    instead of a zero embedding, a loss that trains every logit down, or an infinite loss."""
    _assert_refused(_errors())
    for errors in run_ranks(_errors_at_tp2, 2):
        _assert_refused(errors)


def test_models_refuse_a_target_in_the_padded_vocab():
    """GPT's and BERT's losses bound targets by the real vocab (1000, padded to 1024): a target of
    1000 would meet a -inf logit and train on an infinite loss; it raises instead, naming the bound."""
    from repro.models.bert_checks import random_bert_batch

    gpt = GPT(checks.TINY, seed=1)
    ids = torch.zeros(1, 16, dtype=torch.long)
    assert torch.isfinite(gpt(ids, torch.full_like(ids, 999))).all()
    with pytest.raises(RuntimeError, match=r"target is outside \[0, 1000\)"):
        gpt(ids, torch.full_like(ids, 1000))
    bert, batch = BERT(TINY_BERT, seed=1), random_bert_batch(TINY_BERT, 2)
    assert torch.isfinite(bert.losses(batch)["mlm"])
    batch["mlm_labels"][0, 0] = 1000
    with pytest.raises(RuntimeError, match=r"target is outside \[0, 1000\)"):
        bert.losses(batch)


def test_assert_async_raises_on_cpu():
    """The checks use torch._assert_async (no host sync on GPU); on CPU it raises at once."""
    torch._assert_async(torch.tensor(True), "fine")
    with pytest.raises(RuntimeError, match="named failure"):
        torch._assert_async(torch.tensor(False), "named failure")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_logits_take_the_loss_in_float32(dtype):
    """Half logits lose nothing to the loss: it is bitwise the loss of the same logits given in
    float32, and their gradient bitwise that gradient rounded once to half."""
    gen = torch.Generator().manual_seed(0)
    values = (4 * torch.randn(3, 16, 200, generator=gen)).to(dtype)
    target, grad_loss = torch.randint(0, 200, (3, 16), generator=gen), torch.randn(3, 16, generator=gen)
    half, wide = values.clone().requires_grad_(), values.float().requires_grad_()
    loss_half, loss_wide = (vocab_parallel_cross_entropy(x, target) for x in (half, wide))
    loss_half.backward(grad_loss)
    loss_wide.backward(grad_loss)
    assert half.grad.dtype == dtype and torch.equal(loss_half, loss_wide)
    assert torch.equal(half.grad, wide.grad.to(dtype))


def test_bert_losses_still_mask_ignored_positions():
    """BERT.losses clamps the -100 labels of unpredicted positions before the cross-entropy and
    masks their losses: the MLM loss is the mean over the predicted tokens only."""
    from repro.models.bert_checks import random_bert_batch

    model = BERT(TINY_BERT, seed=1)
    batch = random_bert_batch(TINY_BERT, 2)
    assert (batch["mlm_labels"] == -100).any()
    out = model(batch["tokens"], batch["token_types"], batch["padding_mask"])
    predict = batch["mlm_labels"] != -100
    want = torch.nn.functional.cross_entropy(out.mlm_logits[predict][:, :1000], batch["mlm_labels"][predict])
    assert torch.allclose(model.losses(batch)["mlm"], want, rtol=1e-6)


# --- ColumnParallelLinear ----------------------------------------------------------------------------

def test_strided_column_linear_refuses_to_gather_its_output():
    """With stride > 1 a gathered output would come out per rank ([q0 k0 v0 q1 k1 v1]), not in the
    serial order: the combination is refused where the layer is built."""
    with pytest.raises(ValueError, match="gather_output=True with stride=3"):
        ColumnParallelLinear(8, 24, stride=3, gather_output=True)
    assert ColumnParallelLinear(8, 24, stride=3).weight.shape == (24, 8)
    assert ColumnParallelLinear(8, 24, gather_output=True).weight.shape == (24, 8)


# --- load_model_for_eval keeps the TP markers --------------------------------------------------------

def _loaded_vs_direct(ckpt: str) -> dict:
    """A model saved at TP=2 and loaded by load_model_for_eval, against the one built directly."""
    from pathlib import Path

    import torch.distributed as dist

    from repro.parallel.grads import global_grad_norm
    from repro.parallel.groups import ParallelDims, build_process_groups
    from repro.parallel.layers import tp_markers
    from repro.train import reshard as rs

    pg = build_process_groups(ParallelDims(2, 1))
    cfg = checks.tiny_config(2)
    direct = GPT(cfg, pg.tp_group, seed=3)
    torch.save(direct.state_dict(), Path(ckpt) / f"model_tp{pg.tp_rank:02d}.pt")
    if pg.rank == 0:
        (Path(ckpt) / "meta.json").write_text(json.dumps({"tp": 2, "family": "gpt", "model": dataclasses.asdict(cfg)}))
    dist.barrier()
    loaded = rs.load_model_for_eval(ckpt, pg)
    ids, labels = checks.random_batch(cfg, 2, "cpu")
    norms = []
    for model in (direct, loaded):
        model.loss(ids, labels).mean().backward()
        norms.append(global_grad_norm(model.parameters(), pg.tp_group).item())
    return {"direct": tp_markers(direct), "loaded": tp_markers(loaded), "norms": norms}


def test_a_model_loaded_for_eval_keeps_its_tp_markers(tmp_path):
    """The meta-device build + to_empty of load_model_for_eval used to drop tensor_model_parallel,
    partition_dim and partition_stride, so the global grad norm counted sharded gradients on TP rank 0
    only. At TP=2 the markers and the norm now equal those of the model built directly."""
    for got in run_ranks(_loaded_vs_direct, 2, str(tmp_path)):
        assert got["loaded"] == got["direct"]
        assert got["direct"]["transformer.h.0.attn.c_attn.weight"] == (0, 3)
        assert got["norms"][1] == pytest.approx(got["norms"][0], rel=1e-6)


def test_resharding_streams_one_tensor_at_a_time_to_the_same_shards(tmp_path):
    """resharded_state (memory-mapped shards, one full tensor at a time: what eval at another TP and
    `repro checkpoint reshard` use) gives exactly the shards of merging everything first, and TP=2 ->
    TP=1 gives back the serial model."""
    from repro.train import reshard as rs

    cfg = checks.tiny_config(4)
    serial = GPT(cfg, seed=5).state_dict()
    full = {k: v[:cfg.vocab_size] if k in rs.VOCAB_ROWS else v for k, v in serial.items()}
    spec = rs.partition_spec(cfg)
    for rank in range(2):
        torch.save(rs.shard_state(full, spec, rank, 2, cfg.padded_vocab_size(2)), tmp_path / f"model_tp{rank:02d}.pt")
    meta = {"tp": 2, "family": "gpt", "model": dataclasses.asdict(cfg)}
    back = rs.resharded_state(tmp_path, meta, 0, 1)  # padding rows are zeros, the serial init's are not
    back = {k: v[:cfg.vocab_size] if k in rs.VOCAB_ROWS else v for k, v in back.items()}
    assert back.keys() == full.keys() and all(torch.equal(back[k], full[k]) for k in full)
    for rank in range(4):
        want = rs.shard_state(full, spec, rank, 4, cfg.padded_vocab_size(4))
        got = rs.resharded_state(tmp_path, meta, rank, 4)
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


# --- the spawn harness and the RNG tracker -----------------------------------------------------------

def test_spawning_more_nccl_ranks_than_gpus_is_refused_clearly():
    check_gpu_count(4, "nccl", visible=4)
    check_gpu_count(8, "gloo", visible=0)
    with pytest.raises(ValueError, match="4 NCCL ranks need 4 GPUs .* but 2 are visible: spawn at most 2"):
        check_gpu_count(4, "nccl", visible=2)
    with pytest.raises(ValueError, match="but 1 is visible"):
        check_gpu_count(2, "nccl", visible=1)


def _environment_and_directory(name: str) -> tuple[str | None, str]:
    print(f"out of {os.environ.get('RANK')}", flush=True)
    print(f"err of {os.environ.get('RANK')}", file=sys.stderr, flush=True)
    return os.environ.get(name), os.getcwd()


def _launch_sees_the_caller(value: str, directory, monkeypatch, capfd) -> None:
    """Two ranks launched now see this environment variable and directory, and print where fds 1 and 2 go."""
    monkeypatch.setenv("REPRO_TEST_LAUNCH", value)
    monkeypatch.chdir(directory)
    assert run_ranks(_environment_and_directory, 2, "REPRO_TEST_LAUNCH") == [(value, str(directory))] * 2
    out, err = capfd.readouterr()
    assert sorted(re.findall(r"out of \d", out)) == ["out of 0", "out of 1"]
    assert sorted(re.findall(r"err of \d", err)) == ["err of 0", "err of 1"]


def test_ranks_see_the_callers_environment_directory_and_output_of_each_launch(tmp_path, monkeypatch, capfd):
    """gloo ranks fork from a server started by the first launch: each launch still gives them the
    caller's environment variables, working directory, stdout and stderr of that moment (here pytest's
    capture of file descriptors 1 and 2), as spawned ranks had."""
    with capfd.disabled():  # the fork server is up, started while fds 1 and 2 went elsewhere
        run_ranks(os.getpid, 1)
    _launch_sees_the_caller("second", tmp_path, monkeypatch, capfd)


def test_rng_tracker_seeds_its_own_state_and_leaves_the_default_one():
    from repro.parallel.random import TP_REGION_SEED_OFFSET, RNGTracker

    before = torch.get_rng_state()
    tracker = RNGTracker(5, 1)
    assert torch.equal(torch.get_rng_state(), before)
    assert torch.equal(tracker.get_state(), torch.Generator().manual_seed(5 + TP_REGION_SEED_OFFSET + 1).get_state())


def _unpicklable_result() -> object:
    return lambda: None


def test_a_result_that_cannot_be_sent_back_fails_at_once_naming_the_rank():
    """Before, the queue's feeder thread dropped it and the caller waited out the whole timeout. The
    rank's own pickling error, reported as its failure, is the mechanism: a wait for the result ends
    in TimeoutError (or, the rank gone, 'ended without a result'), neither of which matches. The
    timeout only guards against a hang."""
    with pytest.raises(RuntimeError, match=r"(?s)rank 0 failed in _unpicklable_result.*Can.t pickle"):
        run_ranks(_unpicklable_result, 1, timeout=120)


def _join_then_fail(failing_rank: int, backend: str, store: str, rank: int, world_size: int) -> None:
    """Joins as run_ranks does; `failing_rank` then raises, after its peer has joined."""
    join_process_group(backend, store, rank, world_size)
    if rank == failing_rank:
        raise RuntimeError("join failed (injected)")


def _record_run(marker_dir: str) -> int:
    from pathlib import Path

    import torch.distributed as dist

    Path(marker_dir, f"ran-{dist.get_rank()}-{os.getpid()}").touch()
    return dist.get_rank()


def test_a_rank_whose_join_fails_fails_the_launch_and_no_rank_ran_the_function(tmp_path):
    join = functools.partial(_join_then_fail, 1)
    with pytest.raises(RuntimeError, match=r"(?s)rank 1 failed in _record_run.*join failed \(injected\)"):
        launch_ranks(_record_run, 2, (str(tmp_path),), 120.0, "gloo", join)
    assert not list(tmp_path.glob("ran-*"))  # rank 0 had joined, and still waited


def _join_then_linger(marker_dir: str, backend: str, store: str, rank: int, world_size: int) -> None:
    """Joins as run_ranks does; rank 1 then takes a second longer to return, as a descheduled rank's
    gloo join did on a loaded machine."""
    from pathlib import Path

    join_process_group(backend, store, rank, world_size)
    if rank == 1:
        time.sleep(1.0)
        Path(marker_dir, "rank1-joined").write_text(repr(time.time()))


def _record_start(marker_dir: str) -> int:
    from pathlib import Path

    import torch.distributed as dist

    Path(marker_dir, f"start-{dist.get_rank()}").write_text(repr(time.time()))
    return dist.get_rank()


def test_no_rank_starts_the_function_before_every_rank_has_joined(tmp_path):
    """The CI failure's cause, reproduced with the launcher before c82786e (6 of 300 no-op launches of
    2 ranks on 2 busy cores; none of 300 since): rank 0 ran a function that needs no collective,
    returned and closed its gloo pair while rank 1 was still inside its join, which then read the
    closed socket (`connectFullMesh failed ... Connection closed by peer`)."""
    join = functools.partial(_join_then_linger, str(tmp_path))
    assert launch_ranks(_record_start, 2, (str(tmp_path),), 120.0, "gloo", join) == [0, 1]
    joined = float((tmp_path / "rank1-joined").read_text())
    assert float((tmp_path / "start-0").read_text()) >= joined


def _leave_after(marker_dir: str, late_rank: int) -> int:
    from pathlib import Path

    import torch.distributed as dist

    rank = dist.get_rank()
    if rank == late_rank:
        time.sleep(1.0)
    Path(marker_dir, f"done-{rank}").write_text(repr(time.time()))
    leave_process_group("gloo")
    Path(marker_dir, f"left-{rank}").write_text(repr(time.time()))
    return rank


def test_no_rank_leaves_the_process_group_before_every_rank_is_done(tmp_path):
    """A rank that left (closing its gloo pairs) while a peer was still connecting a subgroup failed
    that peer the same way (16 of 200 launches of a function that only calls dist.new_group)."""
    assert run_ranks(_leave_after, 2, str(tmp_path), 1) == [0, 1]
    assert float((tmp_path / "left-0").read_text()) >= float((tmp_path / "done-1").read_text())


def _end_without_a_result(rank_to_die: int) -> int:
    import torch.distributed as dist

    dist.barrier()  # the gloo mesh is complete: a rank that leaves during its handshake fails its peer first
    if dist.get_rank() == rank_to_die:
        os._exit(3)
    time.sleep(5)
    return dist.get_rank()


def test_a_rank_that_dies_without_a_result_fails_at_once_naming_it():
    """Killed, out of memory, os._exit: before, the caller waited out the whole timeout. The surviving
    rank returns after 5 s, so without the dead rank's detection the launch could only end in
    TimeoutError: the RuntimeError naming rank 1 and its exit code is the mechanism, and the timeout
    only guards against a hang."""
    with pytest.raises(RuntimeError, match=r"rank 1 of _end_without_a_result ended without a result \(exit code 3\)"):
        run_ranks(_end_without_a_result, 2, 1, timeout=120)


def _stop_the_fork_server_then(pid_dir: str, then_sleep: float) -> int:
    import signal
    from pathlib import Path

    import torch.distributed as dist

    Path(pid_dir, str(os.getpid())).touch()
    if dist.get_rank() == 0:
        os.kill(os.getppid(), signal.SIGTERM)  # what a TERM to every descendant does to the fork server
    time.sleep(then_sleep)
    return dist.get_rank()


def test_ranks_outliving_their_fork_server_are_still_waited_for_and_killed(tmp_path):
    """A stop signal to all of `repro train --nproc N`'s processes ends the fork server too: the ranks
    it forked still deliver their results, a hung one is still killed at the timeout (through its
    pidfd: the server that knew its exit status is gone), and the next launch starts a new server."""
    import psutil

    for name in ("a", "b"):
        (tmp_path / name).mkdir()
    assert run_ranks(_stop_the_fork_server_then, 2, str(tmp_path / "a"), 2.0) == [0, 1]
    with pytest.raises(TimeoutError):
        run_ranks(_stop_the_fork_server_then, 2, str(tmp_path / "b"), 300.0, timeout=8)
    pids = [int(p.name) for p in (tmp_path / "b").iterdir()]
    assert len(pids) == 2
    left = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    assert not left, f"ranks left running after the timeout: {left}"
    assert len(set(run_ranks(os.getpid, 2))) == 2


def test_spawned_ranks_as_nccl_uses_them_keep_their_output(tmp_path, monkeypatch, capfd):
    """The spawn start method (NCCL's, forced here on gloo): the ranks print to the caller's stdout
    and stderr and see its environment; a rank that died without a result is still named at once."""
    import torch.multiprocessing as mp

    from repro.parallel import spawn

    monkeypatch.setattr(spawn, "_start_context", lambda backend: mp.get_context("spawn"))
    _launch_sees_the_caller("spawned", tmp_path, monkeypatch, capfd)
    with pytest.raises(RuntimeError, match=r"rank 0 of _end_without_a_result ended without a result \(exit code 3\)"):
        run_ranks(_end_without_a_result, 2, 0, timeout=120)
