"""The clusters `repro plan` and `repro scaling-model` predict for: two built in, or yours, in YAML.

    repro plan experiments/gpt2/gpt2_8.3b.yaml --cluster slurm/clusters/h200.yaml
    repro scaling-model --cluster mine.yaml --out results/scaling_model_mine

A cluster file holds the fields of `repro.perf.scaling_model.Cluster`; `slurm/clusters/dgx2h.yaml` and
`h200.yaml` are the built-in two written out, to copy. Every field is required (a typo or a missing
field is an error, not a default), and `baseline_fraction` is the one measured number: the fraction
of peak that Table 1's config 1 (1.2B, batch 8, activation checkpointing) sustains on one of your
GPUs, which `python -m repro.perf.gpu_bench --out DIR --dtypes bf16 --checkpointing on --params fp32`
prints as its HFU (its value sets the one GEMM efficiency the model assumes); `fused_attention`
says whether attention runs as one flash / cuDNN kernel (true on Ampere and Hopper with torch's SDPA). The others come from spec sheets; the network ones can
be measured with `repro comm-bench` (slurm/comm_bench.sh), which prints them in this form.
"""

from __future__ import annotations

import math
from dataclasses import fields
from pathlib import Path

from repro.perf.scaling_model import DGX2H, H200_CLUSTER, Cluster, calibrate_gemm_efficiency

BUILT_IN: dict[str, Cluster] = {"dgx2h": DGX2H, "h200": H200_CLUSTER}
POSITIVE = ("peak_tflops", "hbm_gbps", "intra_gbps", "node_net_gbps", "memory_gib", "gpus_per_node")


class ClusterSpecError(ValueError):
    """A cluster file that cannot describe a cluster; the message names the file, the field and the fix."""


def load_cluster(spec: str | Path) -> Cluster:
    """A built-in cluster by name (dgx2h, h200) or a cluster YAML file."""
    if str(spec) in BUILT_IN:
        return BUILT_IN[str(spec)]
    path = Path(spec)
    if not path.is_file():
        raise ClusterSpecError(f"--cluster {spec}: neither a built-in cluster ({', '.join(BUILT_IN)}) nor a file. "
                               "Fix: copy slurm/clusters/h200.yaml, describe your nodes, and pass its path")
    return cluster_from_yaml(path)


def cluster_from_yaml(path: Path) -> Cluster:
    """Read and check a cluster file: every field of Cluster, of its type, nothing else."""
    import yaml
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from repro.train.config import yaml_error_detail

    try:
        raw = OmegaConf.load(path)
    except yaml.MarkedYAMLError as err:
        raise ClusterSpecError(f"{path}: not valid YAML ({yaml_error_detail(err)}): fix the file's syntax") from None
    except (OSError, OmegaConfBaseException, ValueError, yaml.YAMLError) as err:
        raise ClusterSpecError(f"{path}: not readable as YAML ({err})") from None
    if not OmegaConf.is_dict(raw):
        raise ClusterSpecError(f"{path}: expected a mapping of Cluster fields, found {type(raw).__name__}")
    names = [f.name for f in fields(Cluster)]
    unknown = sorted(set(raw) - set(names))
    missing = [n for n in names if n not in raw]
    if unknown or missing:
        raise ClusterSpecError(f"{path}: " + "; ".join(
            part for part in (f"unknown field(s) {unknown}" if unknown else "",
                              f"missing field(s) {missing}" if missing else "") if part)
            + f". The fields: {', '.join(names)} (see slurm/clusters/h200.yaml)")
    try:
        cluster = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(Cluster), raw))
    except OmegaConfBaseException as err:
        key = getattr(err, "full_key", None)
        raise ClusterSpecError(f"{path}: {key + ': ' if key else ''}{str(err).splitlines()[0]}") from None
    check_cluster(cluster, path)
    return cluster


def check_cluster(cluster: Cluster, where: Path | str) -> None:
    """Values a cluster can have: positive finite sizes and rates, memory above the plan's headroom, a
    calibration fraction in (0, 1] that leaves the GEMMs an efficiency in (0, 1]."""
    from repro.perf.plan import HEADROOM_GIB

    for name in POSITIVE:
        if not 0 < getattr(cluster, name) < math.inf:  # NaN fails too
            raise ClusterSpecError(f"{where}: {name}={getattr(cluster, name)} must be a positive number")
    if cluster.memory_gib <= HEADROOM_GIB:
        raise ClusterSpecError(f"{where}: memory_gib={cluster.memory_gib:g} must be more than the {HEADROOM_GIB:g} GiB "
                               "the plan keeps for the CUDA context, NCCL and fragmentation: give one GPU's memory "
                               "as torch.cuda reports it (total_memory, GiB)")
    if not all(0 <= a < math.inf for a in (cluster.alpha_intra_s, cluster.alpha_inter_s)):
        raise ClusterSpecError(f"{where}: the all-reduce latencies alpha_intra_s / alpha_inter_s must be "
                               "numbers of seconds, 0 or more")
    if not 0 < cluster.baseline_fraction <= 1:
        raise ClusterSpecError(
            f"{where}: baseline_fraction={cluster.baseline_fraction} must be in (0, 1]: the fraction of peak "
            "that Table 1's config 1 sustains on one of your GPUs, with activation checkpointing. Measure it: "
            "python -m repro.perf.gpu_bench --out DIR --dtypes bf16 --checkpointing on --params fp32 (its HFU column)")
    try:
        calibrate_gemm_efficiency(cluster)
    except ValueError as err:
        raise ClusterSpecError(f"{where}: {err}") from None
