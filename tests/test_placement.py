"""repro.parallel.placement: which TP groups span hosts, and the warning and summary line they give (the
gather itself runs in every training test; on two real Slurm nodes in tests/test_slurm_multinode.py)."""

from __future__ import annotations

from repro.parallel.groups import ParallelDims
from repro.parallel.placement import Placement, gather_placement


def _placement(*hosts: str) -> Placement:
    seen: dict[str, int] = {}
    local = []
    for host in hosts:
        local.append(seen.get(host, 0))
        seen[host] = local[-1] + 1
    return Placement(hosts=list(hosts), local_ranks=local)


def test_tp_groups_inside_hosts_need_no_warning():
    placement = _placement(*["a"] * 8, *["b"] * 8)  # 2 nodes x 8 GPUs
    for tp in (1, 2, 4, 8):
        dims = ParallelDims.from_world(tp, 16)
        assert placement.split_tp_groups(dims) == [] and placement.warning(dims) is None
        assert placement.summary(dims) == (f"placement: 2 host(s); a: ranks 0-7; b: ranks 8-15; "
                                           f"every TP group (tp={tp}) inside one host")


def test_tp_wider_than_a_host_is_split_and_the_warning_names_group_hosts_and_fix():
    dims = ParallelDims.from_world(16, 16)
    placement = _placement(*["a"] * 8, *["b"] * 8)
    assert placement.split_tp_groups(dims) == [list(range(16))]
    warning = placement.warning(dims)
    assert warning.startswith(f"TP group {list(range(16))} runs on 2 hosts (a, b): its activation all-reduces")
    assert "Hosts run 8 ranks here" in warning and "K a multiple of 16" in warning
    assert placement.summary(dims).endswith("1 of 1 TP groups span hosts")


def test_hosts_with_a_task_count_not_a_multiple_of_tp_split_some_groups():
    """`-N2 -n6` gives 4 + 2 tasks (Slurm's block distribution). tp=2: [0,1] [2,3] inside a, [4,5]
    inside b. tp=3: [0,1,2] inside a, but [3,4,5] on a and b."""
    placement = _placement("a", "a", "a", "a", "b", "b")
    assert placement.split_tp_groups(ParallelDims.from_world(2, 6)) == []
    dims = ParallelDims.from_world(3, 6)
    assert placement.split_tp_groups(dims) == [[3, 4, 5]]
    assert "Hosts run 2/4 ranks here" in placement.warning(dims)


def test_ranks_interleaved_over_hosts_are_listed_one_by_one():
    placement = _placement("a", "b", "a", "b")  # srun --distribution=cyclic
    assert placement.ranks_by_host() == {"a": [0, 2], "b": [1, 3]}
    assert placement.local_ranks == [0, 0, 1, 1]
    dims = ParallelDims.from_world(2, 4)
    assert placement.split_tp_groups(dims) == [[0, 1], [2, 3]]
    assert "a: ranks 0,2; b: ranks 1,3; 2 of 2 TP groups span hosts" in placement.summary(dims)
    assert placement.warning(dims).startswith("TP group [0, 1] runs on 2 hosts (a, b) (and 1 more of the 2 TP groups)")
    assert "block distribution" in placement.warning(dims)


def test_a_single_process_reports_its_own_host(monkeypatch):
    import socket

    monkeypatch.setenv("LOCAL_RANK", "3")
    placement = gather_placement(None)
    assert placement.hosts == [socket.gethostname()] and placement.local_ranks == [3]
    assert placement.as_dict()["ranks_by_host"] == {socket.gethostname(): [0]}


def test_a_plain_srun_task_reports_slurms_local_rank(monkeypatch):
    """srun without slurm/task.sh sets no LOCAL_RANK: the task's SLURM_LOCALID is its local rank."""
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.setenv("SLURM_LOCALID", "5")
    assert gather_placement(None).local_ranks == [5]
    monkeypatch.setenv("LOCAL_RANK", "2")  # torchrun's, where both are set (torchrun inside an srun step)
    assert gather_placement(None).local_ranks == [2]
