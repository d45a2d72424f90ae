"""A torchrun worker for tests/crash/test_torchrun.py: init_process_group("collectives"), then an
all_reduce and a broadcast whose results it checks, and ``DONE <rank> <size>``. Its argument, if any:
an ``init_method`` to pass, ``--mpi-first`` (MPI started before init_process_group) or ``--raise`` (the last
rank raises once the group is made, while the others wait in an all_reduce)."""

import sys

import torch
import torch.distributed as dist

import collectives.torch_backend  # noqa: F401 - registers "collectives"

arg = sys.argv[1] if len(sys.argv) > 1 else None
if arg == "--mpi-first":
    from mpi4py import MPI  # noqa: F401 - starts MPI: a job of one process

dist.init_process_group("collectives", init_method=arg if arg and not arg.startswith("--") else None)
rank, size = dist.get_rank(), dist.get_world_size()
if arg == "--raise" and rank == size - 1:
    raise ValueError(f"boom from rank {rank}")
t = torch.full((4,), float(rank + 1))
dist.all_reduce(t)
if arg == "--raise":
    print("SURVIVED", flush=True)
assert t.tolist() == [size * (size + 1) / 2] * 4, t
b = torch.full((2,), float(rank))
dist.broadcast(b, src=size - 1)
assert b.tolist() == [float(size - 1)] * 2, b
big = torch.full((1 << 18,), float(rank))  # 1 MiB: the node-shared-memory path of a large all_reduce
dist.all_reduce(big)
assert bool((big == size * (size - 1) / 2).all()), big[:4]
dist.destroy_process_group()
sys.stdout.write(f"DONE {rank} {size}\n")  # one write: the workers share torchrun's stdout
sys.stdout.flush()
