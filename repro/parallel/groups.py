"""Process groups for hybrid tensor x data parallelism (paper Appendix B.1).

The paper's "model parallel" is tensor parallel here (`tp`). Ranks are laid out on a grid
`torch.arange(world_size).view(dp, tp)`: tensor parallel is the innermost (fastest varying) axis,
so a TP group is a set of adjacent ranks, which the launcher places inside one server.

Worked example, 8 GPUs with tp=2 (so dp=4)::

    grid = [[0, 1],
            [2, 3],
            [4, 5],
            [6, 7]]
    TP groups (rows):    [0, 1] [2, 3] [4, 5] [6, 7]
    DP groups (columns): [0, 2, 4, 6] [1, 3, 5, 7]

Gradients are all-reduced inside each DP group; activations inside each TP group.
"""

from __future__ import annotations

import datetime
import os
import re
import socket
import subprocess
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist

from repro.parallel.placement import Placement, gather_placement


class LayoutError(ValueError):
    """An impossible parallel layout (the message names the numbers and the fix)."""


@dataclass(frozen=True)
class ParallelDims:
    """Sizes of the two parallel axes; `tp * dp` must equal the world size."""

    tp: int = 1
    """Tensor-parallel degree: ranks that split every weight matrix of a layer."""
    dp: int = 1
    """Data-parallel degree: model replicas that split the batch."""

    @classmethod
    def from_world(cls, tp: int, world_size: int) -> "ParallelDims":
        """Derive dp from the world size, failing if tp does not divide it."""
        if tp < 1 or world_size % tp:
            raise LayoutError(
                f"tensor-parallel size tp={tp} does not divide world size {world_size}: "
                f"choose tp from the divisors of {world_size} or launch a multiple of {tp} ranks"
            )
        return cls(tp=tp, dp=world_size // tp)

    @property
    def world_size(self) -> int:
        return self.tp * self.dp

    def validate(self, world_size: int) -> None:
        """Raise LayoutError unless tp * dp == world_size."""
        if self.tp < 1 or self.dp < 1 or self.tp * self.dp != world_size:
            raise LayoutError(
                f"tp={self.tp} x dp={self.dp} = {self.tp * self.dp} ranks, but the world size is "
                f"{world_size}: launch {self.tp * self.dp} ranks or set tp*dp = {world_size}"
            )

    def rank_grid(self) -> torch.Tensor:
        """Global ranks as a (dp, tp) grid: row i is TP group i, column j is DP group j."""
        return torch.arange(self.world_size).view(self.dp, self.tp)

    def tp_groups(self) -> list[list[int]]:
        return self.rank_grid().tolist()

    def dp_groups(self) -> list[list[int]]:
        return self.rank_grid().t().tolist()


@dataclass
class ProcessGroups:
    """This rank's groups and coordinates. `None` groups mean a single process (serial model).

    Also implements the `mpu` interface DeepSpeed asks for (`get_model_parallel_*`,
    `get_data_parallel_*`), so ZeRO shards optimizer state over the DP group only.
    """

    dims: ParallelDims
    rank: int = 0
    tp_group: dist.ProcessGroup | None = None
    dp_group: dist.ProcessGroup | None = None
    world_group: dist.ProcessGroup | None = None
    """Every rank: agreement on a skipped step or a stop signal, checkpoint barriers."""
    placement: Placement | None = None
    """Every rank's host and local rank, once `init_distributed` has gathered them."""

    @classmethod
    def single(cls) -> "ProcessGroups":
        """The serial layout: one process, no communication."""
        return cls(dims=ParallelDims(1, 1))

    @property
    def tp_size(self) -> int:
        return self.dims.tp

    @property
    def dp_size(self) -> int:
        return self.dims.dp

    @property
    def tp_rank(self) -> int:
        return self.rank % self.dims.tp

    @property
    def dp_rank(self) -> int:
        return self.rank // self.dims.tp

    # DeepSpeed's mpu interface ("model parallel" = tensor parallel).
    def get_model_parallel_rank(self) -> int:
        return self.tp_rank

    def get_model_parallel_world_size(self) -> int:
        return self.tp_size

    def get_model_parallel_group(self):
        return self.tp_group

    def get_data_parallel_rank(self) -> int:
        return self.dp_rank

    def get_data_parallel_world_size(self) -> int:
        return self.dp_size

    def get_data_parallel_group(self):
        return self.dp_group


def build_process_groups(dims: ParallelDims) -> ProcessGroups:
    """Create the TP and DP groups of `dims` on the initialised default group (all ranks call it)."""
    world_size, rank = dist.get_world_size(), dist.get_rank()
    dims.validate(world_size)
    tp_group = dp_group = None
    for ranks in dims.tp_groups():  # every rank must create every group, in the same order
        group = dist.new_group(ranks)
        if rank in ranks:
            tp_group = group
    for ranks in dims.dp_groups():
        group = dist.new_group(ranks)
        if rank in ranks:
            dp_group = group
    return ProcessGroups(dims=dims, rank=rank, tp_group=tp_group, dp_group=dp_group, world_group=dist.group.WORLD)


@dataclass(frozen=True)
class LaunchEnv:
    """Rank coordinates from torchrun's variables, or Slurm's when torchrun did not set them."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    launched: bool = False
    """A launcher (torchrun, srun) started this process as one of its ranks."""

    def device(self) -> torch.device:
        """This rank's GPU when CUDA is there (`cuda_index`), else the CPU."""
        if not torch.cuda.is_available():
            return torch.device("cpu")
        return torch.device("cuda", cuda_index(self.local_rank, torch.cuda.device_count()))


def cuda_index(local_rank: int, visible: int) -> int:
    """This rank's GPU among the `visible` ones: its local rank when every task sees all of the
    node's GPUs (torchrun, launch.sh); 0 when the task sees one GPU (Slurm's --gpus-per-task=1 or a
    site's --gpu-bind give each task its own CUDA_VISIBLE_DEVICES)."""
    if visible == 1:
        return 0
    if 0 <= local_rank < visible:
        return local_rank
    raise LayoutError(
        f"local rank {local_rank} but this task sees {visible} GPUs "
        f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}): give every task all of "
        "the node's GPUs (srun --gpu-bind=none, launch.sh's default) or exactly one (--gpus-per-task=1)")


def _first_slurm_host() -> str:
    nodelist = os.environ.get("SLURM_JOB_NODELIST") or os.environ.get("SLURM_NODELIST")
    if not nodelist:
        return "127.0.0.1"
    try:
        out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True)
        problem = out.stderr.strip() or "no output" if out.returncode or not out.stdout.split() else ""
    except OSError as err:
        problem = str(err)
    if problem:  # guessing would make every node its own master
        raise RuntimeError(f"MASTER_ADDR is not set and `scontrol show hostnames {nodelist}` failed ({problem}): "
                           "launch through slurm/launch.sh (it exports MASTER_ADDR/MASTER_PORT), or export "
                           "MASTER_ADDR=<first node> yourself")
    return _rendezvous_host(out.stdout.split()[0])


def _resolves(host: str) -> bool:
    try:
        socket.getaddrinfo(host, None)
    except OSError:
        return False
    return True


def _node_addr(node: str) -> str:
    """The node's NodeAddr in `scontrol show node` (the address slurmctld reaches it by); "" when none."""
    try:
        record = subprocess.run(["scontrol", "show", "node", "-o", node], capture_output=True, text=True).stdout
    except OSError:
        return ""
    found = re.search(r"(?:^|\s)NodeAddr=(\S+)", record)
    return found.group(1) if found else ""


def _rendezvous_host(node: str) -> str:
    """launch.sh's rule: the node's Slurm name when it resolves here, else its NodeAddr (Slurm does not
    need NodeName to be a host name: cloud nodes); an error rather than ranks retrying it until timeout."""
    if _resolves(node):
        return node
    addr = _node_addr(node)
    if addr and _resolves(addr):
        return addr
    nor = f", nor does its NodeAddr {addr}" if addr and addr != node else ""
    raise RuntimeError(f"MASTER_ADDR is not set and the first node's Slurm name {node} does not resolve on "
                       f"{socket.gethostname()}{nor}: export MASTER_ADDR=<an address of that node> or fix DNS")


def _slurm_port(env) -> int:
    """launch.sh's rule: from the job id, below Linux's ephemeral ports, the same on every node."""
    return 15000 + int(env["SLURM_JOB_ID"]) % 15000 if "SLURM_JOB_ID" in env else 29500


def discover_launch_env(environ: dict[str, str] | None = None) -> LaunchEnv:
    """Prefer RANK/WORLD_SIZE/LOCAL_RANK (torchrun); fall back to SLURM_PROCID, the step's task count
    and SLURM_LOCALID in a task of an srun step (not in a batch script's own shell: repro.cli.in_srun_task)."""
    from repro.cli import in_srun_task, srun_world_size

    env = os.environ if environ is None else environ
    srun = in_srun_task(env)
    if "RANK" in env and "WORLD_SIZE" in env:
        rank, world, local = int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", 0))
    elif srun:
        rank, world = int(env["SLURM_PROCID"]), srun_world_size(env)
        local = int(env.get("SLURM_LOCALID", 0))
    else:
        rank, world, local = 0, 1, 0
    addr = env.get("MASTER_ADDR") or (_first_slurm_host() if srun and world > 1 else "127.0.0.1")
    port = int(env.get("MASTER_PORT") or (_slurm_port(env) if srun else 29500))
    launched = ("RANK" in env and "WORLD_SIZE" in env) or srun
    return LaunchEnv(rank, world, local, addr, port, launched)


def spawns_ranks(launch: LaunchEnv, nproc: int | None) -> bool:
    """`--nproc N` spawns N local ranks unless a launcher (torchrun, srun) started several: a one-task
    srun step, as an interactive `srun --pty bash` is, spawns them too."""
    return nproc is not None and not (launch.launched and launch.world_size > 1)


def default_backend() -> str:
    """NCCL when CUDA is available, gloo otherwise."""
    return "nccl" if torch.cuda.is_available() else "gloo"


def backend_for(device: str) -> str:
    """The backend a run on `train.device` uses: gloo for cpu, else the default."""
    return "gloo" if device == "cpu" else default_backend()


def collective_timeout_s(environ=None) -> int:
    """Seconds a collective may wait for the slowest rank: REPRO_DIST_TIMEOUT_S, default 600 (raise
    it where resuming a large run reads its checkpoint slowly from a shared filesystem)."""
    value = (os.environ if environ is None else environ).get("REPRO_DIST_TIMEOUT_S", "600")
    if not value.isdigit() or int(value) < 1:
        raise LayoutError(f"REPRO_DIST_TIMEOUT_S={value!r}: give a whole number of seconds, e.g. 1800")
    return int(value)


def init_distributed(tp: int, backend: str | None = None, timeout_s: int | None = None) -> ProcessGroups:
    """Initialise torch.distributed from the launch environment and build the TP/DP groups."""
    launch = discover_launch_env()
    dims = ParallelDims.from_world(tp, launch.world_size)
    if not dist.is_initialized():
        backend = backend or default_backend()
        if backend == "nccl":
            torch.cuda.set_device(launch.device())
        timeout = datetime.timedelta(seconds=timeout_s or collective_timeout_s())
        if launch.world_size == 1:  # one process: an in-memory store, no port to collide with another job's
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        else:
            dist.init_process_group(backend, init_method=f"tcp://{launch.master_addr}:{launch.master_port}",
                                    rank=launch.rank, world_size=launch.world_size, timeout=timeout)
    pg = build_process_groups(dims)
    pg.placement = gather_placement(pg.world_group)
    if pg.rank == 0 and (warning := pg.placement.warning(dims)):
        warnings.warn(warning, stacklevel=2)
    return pg
