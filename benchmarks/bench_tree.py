"""The tree collectives against raw mpi4py, in the same job.

    mpiexec -n 2 python benchmarks/bench_tree.py
    mpiexec -n 2 python benchmarks/bench_tree.py --rounds 5 --json out.json
    mpiexec -n 2 python benchmarks/bench_tree.py --thresholds   # re-measure _buckets' thresholds

A realistic tree: 200 float32 leaves (100 weight matrices of mixed sizes and their 100 biases,
about 57 MiB in all).

==============================  ===============================================  ===========================================
row                             ours                                             against
==============================  ===============================================  ===========================================
``synchronize``                 ``coll.synchronize(tree)``                       one raw ``Bcast`` of a flat buffer of the
                                                                                 same bytes
``synchronize/per-leaf``        the same                                         one raw ``Bcast`` per leaf, in place
``synchronize/leaf copy``       the same                                         every rank copying its leaves into another
                                                                                 tree's (one copy of every byte, from and to
                                                                                 memory laid out as the leaves are: the
                                                                                 least a receiver's writes cost)
``leaf copy/flat Bcast``        that leaf copy                                   one raw ``Bcast`` of a flat buffer
``synchronize, bucket path``    the same, via packed buckets + ``MPI_Bcast``     one raw ``Bcast`` of a flat buffer
                                (the path across nodes)
``synchronize/bucket path``     ``coll.synchronize(tree)``                       the bucket path, in the same rounds
``allreduce_tree``              ``coll.allreduce_tree(tree, op="mean")``         one raw ``Allreduce`` (+ divide) of a flat
                                                                                 buffer
``allreduce_tree/per-leaf``     the same                                         one raw ``Allreduce`` (+ divide) per leaf
``per-leaf allreduce``          one ``coll.allreduce(leaf, "mean")`` per leaf    the flat ``Allreduce``
``per-leaf broadcast``          one ``coll.broadcast(leaf)`` per leaf            the flat ``Bcast``
``structure check``             flatten + describe + the 17-byte agreement       the flat ``Allreduce``
                                (``allreduce_tree`` with the data step stubbed;
                                a repeated call: the description is cached)
``agreement alone``             the 17-byte agreement                            the flat ``Allreduce``
==============================  ===============================================  ===========================================

The flat buffer is the lower bound: what the data costs without any tree. The raw per-leaf rows are what
the data costs moved where it lies, one collective per leaf, without any library.

Training steps (DistributedOptimizer against DDP, raw mpi4py and no communication) are in
``bench_training.py``.

``--thresholds`` adds rows for ``synchronize`` and ``allreduce_tree`` with other values of
``_buckets.BROADCAST_SOLO_BYTES`` and ``_buckets.SOLO_BYTES`` (leaves at least this big get a collective
of their own, in their own memory; smaller ones are packed), to choose them on a new machine.

Measurement: the two sides of a comparison run in alternating rounds (the side that goes first swaps each
round), each round after a barrier; a round's time is the slowest rank's; reported are medians over the
rounds and the median of the per-round ratios, so that a change of the machine's speed between rounds
cancels out. Only ratios mean something, and only within one run. On a machine whose cores are shared
with other jobs, every rendezvous of the ranks can cost a scheduler time slice: run it several times.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
from _common import finish
from mpi4py import MPI

import collectives as coll
from collectives import _buckets, _tree
from collectives._comm import engine_of

RAW = MPI.COMM_WORLD.Dup()


def timed(fn, k: int = 1) -> float:
    """Seconds per call of ``fn`` (``k`` calls after a barrier), on the slowest rank."""
    RAW.Barrier()
    t = time.perf_counter()
    for _ in range(k):
        fn()
    dt = (time.perf_counter() - t) / k
    return RAW.allreduce(dt, op=MPI.MAX)


def compare(ours, raw, rounds: int, k: int = 1, warmup: int = 1) -> dict:
    for _ in range(warmup):
        ours(), raw()
    a, b, ratios = [], [], []
    for r in range(rounds):
        if r % 2:
            tb, ta = timed(raw, k), timed(ours, k)
        else:
            ta, tb = timed(ours, k), timed(raw, k)
        a.append(ta)
        b.append(tb)
        ratios.append(ta / tb)
    return {"ours_s": statistics.median(a), "raw_s": statistics.median(b), "ratio": statistics.median(ratios)}


# ---------------------------------------------------------------------------------------------------------
# a 200-leaf tree


def make_tree(rank: int) -> dict:
    rng = np.random.default_rng(0)
    dims = [64, 128, 256, 384, 512, 768]
    tree = {}
    for i in range(100):
        d_in, d_out = (int(v) for v in rng.choice(dims, 2))
        tree[f"layer{i:03d}"] = {"w": np.full((d_in, d_out), 1.0 + rank, np.float32),
                                 "b": np.full(d_out, 1.0 + rank, np.float32)}
    return tree


def tree_part(comm, rounds: int, thresholds: bool = False) -> dict:
    tree = make_tree(comm.rank)
    leaves = _tree.flatten(tree).leaves
    nbytes = sum(x.nbytes for x in leaves)
    flat = np.ones(nbytes // 4, np.float32)
    size = float(comm.size)

    def raw_allreduce():
        RAW.Allreduce(MPI.IN_PLACE, flat, MPI.SUM)
        np.divide(flat, size, out=flat)

    def raw_per_leaf_allreduce():
        for x in leaves:
            RAW.Allreduce(MPI.IN_PLACE, x, MPI.SUM)
            np.divide(x, size, out=x)

    def raw_per_leaf_bcast():
        for x in leaves:
            RAW.Bcast(x, 0)

    def per_leaf():
        for x in leaves:
            coll.allreduce(x, op="mean", comm=comm)

    real = _buckets.allreduce

    def check_only():
        _buckets.allreduce = lambda *a, **k: None  # everything but the data movement
        try:
            coll.allreduce_tree(tree, op="mean", comm=comm)
        finally:
            _buckets.allreduce = real

    header = (("op", "mean"), ("bucket_bytes", 25 << 20))
    entries = [(p, f"float32 {x.shape}") for p, x in zip(_tree.flatten(tree).paths, leaves)]

    def sync():
        coll.synchronize(tree, comm=comm)

    def reduce_tree():
        coll.allreduce_tree(tree, op="mean", comm=comm)

    host_type = type(comm._host)

    def sync_buckets():  # the path synchronize takes across nodes: packed buckets through MPI_Bcast
        saved = host_type.__dict__.get("can_broadcast_many")
        host_type.can_broadcast_many = False
        try:
            coll.synchronize(tree, comm=comm)
        finally:
            if saved is None:
                del host_type.can_broadcast_many
            else:
                host_type.can_broadcast_many = saved

    out = {"leaves": len(leaves), "bytes": nbytes}
    out["synchronize"] = compare(sync, lambda: RAW.Bcast(flat, 0), rounds)
    twin = [np.empty_like(x) for x in leaves]

    def copy_leaves():  # every rank at once, as every receiver writes its leaves at once
        for src, dst in zip(leaves, twin):
            np.copyto(dst, src)

    out["synchronize/leaf copy"] = compare(sync, copy_leaves, rounds)
    out["leaf copy/flat Bcast"] = compare(copy_leaves, lambda: RAW.Bcast(flat, 0), rounds)
    out["synchronize/per-leaf"] = compare(sync, raw_per_leaf_bcast, rounds)
    if hasattr(host_type, "can_broadcast_many"):
        out["synchronize, bucket path"] = compare(sync_buckets, lambda: RAW.Bcast(flat, 0), rounds)
        out["synchronize/bucket path"] = compare(sync, sync_buckets, rounds)
    out["allreduce_tree"] = compare(reduce_tree, raw_allreduce, rounds)
    out["allreduce_tree/per-leaf"] = compare(reduce_tree, raw_per_leaf_allreduce, rounds)
    out["per-leaf allreduce"] = compare(per_leaf, raw_allreduce, rounds)
    out["per-leaf broadcast"] = compare(lambda: [coll.broadcast(x, 0, comm=comm) for x in leaves],
                                        lambda: RAW.Bcast(flat, 0), rounds)
    out["structure check"] = compare(check_only, raw_allreduce, rounds, k=5)
    out["agreement alone"] = compare(lambda: _tree.agree(engine_of(comm), "bench", header, entries, None), raw_allreduce,
                                     rounds, k=5)
    if thresholds:
        for name, attr, fn, raw in (("synchronize", "BROADCAST_SOLO_BYTES", sync, lambda: RAW.Bcast(flat, 0)),
                                    ("allreduce_tree", "SOLO_BYTES", reduce_tree, raw_allreduce)):
            default = getattr(_buckets, attr)
            for kib in (64, 256, 1024, 4096, 16384):
                setattr(_buckets, attr, kib << 10)
                _tree._plans.clear()  # the cached plans were made with the other threshold
                try:
                    out[f"{name} solo >= {kib} KiB"] = compare(fn, raw, rounds)
                finally:
                    setattr(_buckets, attr, default)
                    _tree._plans.clear()
    return out


def report(title: str, rows: dict) -> None:
    print(f"\n{title}")
    for name, r in rows.items():
        if isinstance(r, dict):
            print(f"  {name:42s} ours {r['ours_s'] * 1e3:9.2f} ms   other {r['raw_s'] * 1e3:9.2f} ms   "
                  f"ratio {r['ratio']:6.2f}x")
        else:
            print(f"  {name:42s} {r}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--skip-training", action="store_true", help=argparse.SUPPRESS)  # (old command lines)
    ap.add_argument("--thresholds", action="store_true", help="also time other solo thresholds")
    ap.add_argument("--json", help="write the figures to this file")
    args = ap.parse_args()
    comm = coll.init()
    start = time.perf_counter()
    results = {"size": comm.size, "tree": tree_part(comm, args.rounds, args.thresholds)}
    if comm.rank == 0:
        t = results["tree"]
        report(f"tree of {t['leaves']} float32 leaves, {t['bytes'] / 2**20:.1f} MiB, {comm.size} ranks "
               f"(other = one raw flat Bcast/Allreduce of the same bytes; /per-leaf: one raw call per leaf)", t)
        finish(start, results, args.json)


if __name__ == "__main__":
    main()
