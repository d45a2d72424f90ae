"""The suite's own channel between ranks, independent of the system under test.

Every rank runs every test. After a test's body, the ranks exchange their verdicts (passed, failed with a
message, skipped) and the digests of the results they recorded, over a duplicate of MPI's world made with
mpi4py directly, never through the library being tested. So:

- a failure on any rank fails the test on every rank, with the failing ranks' messages: the ranks stay in
  step and the next test starts together (no hang, no abort needed);
- results that must be the same on every rank (an allreduce, a broadcast, an allgather) are compared bit
  for bit across ranks.

With the ``self`` backend, or without mpi4py, the channel is a world of one.
"""

from __future__ import annotations

import hashlib


class AgreedFailure(AssertionError):
    """A test failed on some ranks; raised on every rank so that all of them report the same test."""


class Channel:
    rank = 0
    size = 1

    def for_tests(self) -> Channel:
        """A second channel for tests' own exchanges, which can never pair with a verdict exchange."""
        return self

    def allgather(self, obj) -> list:
        return [obj]

    def abort(self, code: int = 1) -> None:
        import os

        os._exit(code)


class MPIChannel(Channel):
    def __init__(self):
        from mpi4py import MPI

        self.MPI = MPI
        self.comm = MPI.COMM_WORLD.Dup()
        self.rank = self.comm.Get_rank()
        self.size = self.comm.Get_size()

    def allgather(self, obj) -> list:
        """Every rank's picklable ``obj``. Waits politely (non-blocking calls, polled with short sleeps):
        with more ranks than cores, a rank spinning in MPI would take the CPU from the ranks still working."""
        import pickle

        import numpy as np

        MPI = self.MPI
        data = np.frombuffer(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), dtype=np.uint8)
        sizes = np.zeros(self.size, dtype=np.int64)
        self._wait(self.comm.Iallgather(np.array([data.size], dtype=np.int64), sizes))
        displs = np.concatenate([[0], np.cumsum(sizes)[:-1]])
        recv = np.empty(int(sizes.sum()), dtype=np.uint8)
        self._wait(self.comm.Iallgatherv(data, [recv, sizes, displs, MPI.BYTE]))
        return [pickle.loads(recv[d:d + n].tobytes()) for d, n in zip(displs, sizes)]

    @staticmethod
    def _wait(request) -> None:
        import time

        for _ in range(50):
            if request.Test():
                return
        pause = 0.0001
        while not request.Test():
            time.sleep(pause)
            pause = min(pause * 2, 0.002)

    def for_tests(self) -> Channel:
        if not hasattr(self, "_tests"):
            other = object.__new__(MPIChannel)
            other.MPI, other.comm, other.rank, other.size = self.MPI, self.comm.Dup(), self.rank, self.size
            self._tests = other
        return self._tests

    def abort(self, code: int = 1) -> None:
        self.MPI.COMM_WORLD.Abort(code)


def launcher_size() -> int:
    """The number of processes a launcher started (1 for a plain ``python``)."""
    import os

    for var in ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_SIZE", "MPI_LOCALNRANKS", "SLURM_STEP_NUM_TASKS"):
        raw = os.environ.get(var)
        if raw:
            try:
                return int(raw.split("(")[0])
            except ValueError:
                continue
    return 1


def make_channel(single: bool) -> Channel:
    if single:
        return Channel()
    try:
        return MPIChannel()
    except ImportError:
        if launcher_size() > 1:
            raise
        return Channel()


class Recorder:
    """What one test recorded for the cross-rank comparison."""

    def __init__(self):
        self.digests: list[tuple[str, str]] = []

    def same_on_every_rank(self, label: str, data: bytes) -> None:
        self.digests.append((label, hashlib.blake2b(data, digest_size=16).hexdigest()))


def compare_digests(per_rank: list[list[tuple[str, str]]]) -> str | None:
    """A message naming the first result that differs between ranks, or None."""
    first = per_rank[0]
    for r, mine in enumerate(per_rank[1:], start=1):
        if len(mine) != len(first):
            return (f"ranks recorded different numbers of results: rank 0 has {len(first)}, "
                    f"rank {r} has {len(mine)}")
    for i, (label, _) in enumerate(first):
        groups: dict = {}
        for rank, digests in enumerate(per_rank):
            groups.setdefault(digests[i][1], []).append(rank)
        if len(groups) > 1:
            parts = "; ".join(f"ranks {','.join(map(str, ranks))} agree" for ranks in groups.values())
            return f"result {label!r} differs between ranks, bit for bit ({parts})"
    return None
