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
import socket
import subprocess
from dataclasses import dataclass

import torch
import torch.distributed as dist


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
        """This rank's GPU (by local rank) when CUDA is there, else the CPU."""
        return torch.device("cuda", self.local_rank) if torch.cuda.is_available() else torch.device("cpu")


def _first_slurm_host() -> str:
    nodelist = os.environ.get("SLURM_JOB_NODELIST") or os.environ.get("SLURM_NODELIST")
    if not nodelist:
        return "127.0.0.1"
    out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True)
    return out.stdout.split()[0] if out.returncode == 0 and out.stdout else socket.gethostname()


def discover_launch_env(environ: dict[str, str] | None = None) -> LaunchEnv:
    """Prefer RANK/WORLD_SIZE/LOCAL_RANK (torchrun); fall back to SLURM_PROCID/NTASKS/LOCALID."""
    env = os.environ if environ is None else environ
    if "RANK" in env and "WORLD_SIZE" in env:
        rank, world, local = int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", 0))
    elif "SLURM_PROCID" in env:
        rank, world = int(env["SLURM_PROCID"]), int(env.get("SLURM_NTASKS", 1))
        local = int(env.get("SLURM_LOCALID", 0))
    else:
        rank, world, local = 0, 1, 0
    addr = env.get("MASTER_ADDR") or (_first_slurm_host() if "SLURM_PROCID" in env else "127.0.0.1")
    port = int(env.get("MASTER_PORT", 29500))
    launched = ("RANK" in env and "WORLD_SIZE" in env) or "SLURM_PROCID" in env
    return LaunchEnv(rank, world, local, addr, port, launched)


def default_backend() -> str:
    """NCCL when CUDA is available, gloo otherwise."""
    return "nccl" if torch.cuda.is_available() else "gloo"


def init_distributed(tp: int, backend: str | None = None, timeout_s: int = 600) -> ProcessGroups:
    """Initialise torch.distributed from the launch environment and build the TP/DP groups."""
    launch = discover_launch_env()
    dims = ParallelDims.from_world(tp, launch.world_size)
    if not dist.is_initialized():
        backend = backend or default_backend()
        if backend == "nccl":
            torch.cuda.set_device(launch.local_rank)
        dist.init_process_group(
            backend,
            init_method=f"tcp://{launch.master_addr}:{launch.master_port}",
            rank=launch.rank,
            world_size=launch.world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
    return build_process_groups(dims)
