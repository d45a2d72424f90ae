"""RSS growth of the root over repeated rooted collectives, in the pattern tests/mpi/test_memory.py used before
issue 13 (blocks of 50 calls, then a broadcast from rank 0): raw mpi4py Reduce vs collectives.reduce in the
same job, in the order given, segments of 10,000 calls.

    mpiexec -n 3 python benchmarks/memory_rooted.py mpi4py,collectives   # then collectives,mpi4py
"""
import gc
import os
import sys

import numpy as np
from mpi4py import MPI
import collectives as coll

def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

comm = coll.init()
raw = MPI.COMM_WORLD.Dup()
size, rank = raw.Get_size(), raw.Get_rank()
root = size - 1
small = np.arange(8, dtype=np.int64)
buf = small.copy()
flag = np.zeros(1, np.uint8)

def ours():
    comm.reduce(small, op="max", root=root)

def mpi4py_reduce():
    if rank == root:
        raw.Reduce(MPI.IN_PLACE, buf, MPI.MAX, root)
    else:
        raw.Reduce(buf, None, MPI.MAX, root)

order = sys.argv[1].split(",") if len(sys.argv) > 1 else ["mpi4py", "collectives"]
calls = {"mpi4py": mpi4py_reduce, "collectives": ours}
for name in order:
    call = calls[name]
    for _ in range(30):
        call()
    gc.collect()
    start = rss()
    marks = []
    for _ in range(4):
        for _ in range(10_000 // 50):
            for _ in range(50):
                call()
            comm.broadcast(flag, root=0)
        gc.collect()
        marks.append((rss() - start) // 1024)
    g = raw.gather(marks, root=0)
    if rank == 0:
        print(f"{name:12s} root's RSS growth (KiB) after 10k/20k/30k/40k calls: {g[root]}; other ranks {g[:root]}", flush=True)
