"""Ports for the test servers (MLflow, slurmctld, slurmd) that start seconds after their port is chosen.

A port the kernel hands out (bind to 0) comes from the ephemeral range (32768-60999), where the other
xdist worker's gloo ranks open listeners a few times a second: one of them could take it before the
server binds. These are drawn from 30000-32767 instead: below that range, above the rendezvous ports
slurm/launch.sh gives the test clusters' jobs (15000 + job id; tests/slurm_cluster.py's first job id
is at most 14000).
"""

from __future__ import annotations

import random
import socket

LOW, HIGH = 30000, 32767


def listen_ports(count: int) -> list[int]:
    """`count` distinct ports in LOW..HIGH that nothing listens on now (held together while chosen)."""
    draw, held = random.SystemRandom(), []
    try:
        while len(held) < count:
            s = socket.socket()
            try:
                s.bind(("0.0.0.0", draw.randint(LOW, HIGH)))
            except OSError:
                s.close()
                continue
            held.append(s)
        return [s.getsockname()[1] for s in held]
    finally:
        for s in held:
            s.close()


def listen_port() -> int:
    return listen_ports(1)[0]
