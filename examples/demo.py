"""A small tour of collectives. Run: ``mpiexec -n 2 python examples/demo.py`` (or plain ``python``)."""

import numpy as np

import collectives as coll

comm = coll.init()
rank, size = comm.rank, comm.size
say = print if rank == 0 else (lambda *a, **k: None)
say(f"{size} process(es), backend {comm.backend!r}")

# broadcast: everyone gets root's values, in place
w = np.random.default_rng(rank).standard_normal(3)
coll.broadcast(w, root=0)
say("broadcast from rank 0:", np.round(w, 3))

# allreduce: sum and mean over ranks
g = np.full(4, float(rank + 1))
coll.allreduce(g, op="mean")
say(f"mean of 1..{size}:", g)

# reduce to one rank; others get their input back unchanged
total = coll.reduce(np.array([rank]), op="sum", root=0)
say("sum of ranks on rank 0:", int(total[0]))

# allgather: one row per rank
rows = coll.allgather(np.array([rank, rank * rank]))
say("allgather:\n", rows)

# illegal dtype/op pairs are refused before any communication, on every rank
try:
    coll.allreduce(np.arange(3), op="mean")
except TypeError as e:
    say("refused:", e)

coll.barrier()
say("done")
