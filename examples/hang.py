"""A job that hangs: the last rank is stuck in its own code while the others wait in an allreduce.

    COLLECTIVES_STALL_WARN_S=3 COLLECTIVES_TIMEOUT=8 mpiexec -n 3 python examples/hang.py
    python -m collectives trace collectives-trace
"""
import time

import numpy as np

import collectives as coll

comm = coll.init()
x = np.ones(4)
for _ in range(3):
    coll.allreduce(x)
if comm.rank == comm.size - 1:
    time.sleep(30)  # stands for a rank that is stuck: a deadlock, a slow disk, an endless loop
coll.allreduce(x)
