"""A torchrun worker for tests/crash/test_torchrun.py: init_process_group("collectives") (with the
``init_method`` given as its argument, if any), then an all_reduce and a broadcast whose results it
checks, and ``DONE <rank> <size>``."""

import sys

import torch
import torch.distributed as dist

import collectives.torch_backend  # noqa: F401 - registers "collectives"

dist.init_process_group("collectives", init_method=sys.argv[1] if len(sys.argv) > 1 else None)
rank, size = dist.get_rank(), dist.get_world_size()
t = torch.full((4,), float(rank + 1))
dist.all_reduce(t)
assert t.tolist() == [size * (size + 1) / 2] * 4, t
b = torch.full((2,), float(rank))
dist.broadcast(b, src=size - 1)
assert b.tolist() == [float(size - 1)] * 2, b
dist.destroy_process_group()
print(f"DONE {rank} {size}", flush=True)
