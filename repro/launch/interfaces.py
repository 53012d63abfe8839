"""Does NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME name an interface this node has? Checked by
`repro slurm check` on the batch host before any task starts: a name that matches nothing would
otherwise fail every rank at its first collective, in NCCL's or gloo's words, not ours.

NCCL reads a comma list of name prefixes; `^` in front excludes them instead, `=` makes them exact
names (`^=docker0`: all but docker0). Gloo reads a comma list of exact names and opens each one.
"""

from __future__ import annotations


def nccl_matches(spec: str, names: list[str]) -> list[str]:
    """The interfaces of `names` NCCL_SOCKET_IFNAME=`spec` lets NCCL use."""
    exclude = spec.startswith("^")
    spec = spec[1:] if exclude else spec
    exact = spec.startswith("=")
    spec = spec[1:] if exact else spec
    items = [item for item in spec.split(",") if item]

    def listed(name: str) -> bool:
        return any(name == item if exact else name.startswith(item) for item in items)

    return [name for name in names if listed(name) != exclude]


def gloo_missing(spec: str, names: list[str]) -> list[str]:
    """The names in GLOO_SOCKET_IFNAME=`spec` this node lacks (gloo opens every one)."""
    return [item for item in spec.split(",") if item and item not in names]


def interface_problem(environ: dict[str, str], names: list[str], backend: str, host: str) -> str | None:
    """What is wrong with the socket-interface setting of `backend` on `host` (None: nothing)."""
    have = ", ".join(sorted(names))
    if backend == "nccl" and (spec := environ.get("NCCL_SOCKET_IFNAME")):
        if not nccl_matches(spec, names):
            return (f"NCCL_SOCKET_IFNAME={spec} matches no network interface of {host} (it has: {have}), so "
                    "NCCL would find no socket interface. Fix: a prefix of one of those in slurm/cluster.env "
                    "(ib for ib0, ibp65s0...; =NAME for one exact name; ^PREFIX to exclude), or unset it")
    if backend == "gloo" and (spec := environ.get("GLOO_SOCKET_IFNAME")):
        if missing := gloo_missing(spec, names):
            return (f"GLOO_SOCKET_IFNAME={spec} names {', '.join(missing)}, which {host} lacks (it has: {have}), "
                    "so gloo could not open its socket. Fix: exact names from that list, comma-separated, in "
                    "slurm/cluster.env, or unset it")
    return None


def local_interfaces() -> list[str]:
    import psutil

    return sorted(psutil.net_if_addrs())
