"""What the client scripts share (not a client: tests/run_all.py runs the entries of its CLIENTS table)."""

from __future__ import annotations

import socket


def gloo_rendezvous(world, *, ranks: bool = True) -> dict[str, str]:
    """The environment torch's ``env://`` rendezvous needs for the gloo run of a script: a free port of
    rank 0's loopback, broadcast over ``world`` (mpi4py), and, with ``ranks``, RANK and WORLD_SIZE."""
    port = None
    if world.Get_rank() == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(world.bcast(port))}
    if ranks:
        env.update(RANK=str(world.Get_rank()), WORLD_SIZE=str(world.Get_size()))
    return env
