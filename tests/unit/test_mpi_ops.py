"""The table of MPI operations (``_backends.mpi.ops``), without MPI: each row turns the transport's
arguments into mpi4py's as the MPI call of that collective takes them, counts what one call carries, and
binds the hot path's closure. (Under MPI, tests/mpi/test_paths.py checks the bits of every path.)"""

from __future__ import annotations

import numpy as np
import pytest

from collectives._backends import base
from collectives._backends._fingerprint import EAGER_LANES, LANES
from collectives._backends.mpi.ops import ALLGATHERV, MESSAGES, OPERATIONS

IN_PLACE, MOP = "IN_PLACE", "MOP"  # stand-ins for MPI.IN_PLACE and an MPI op


def test_one_row_per_collective_each_on_a_lane_of_its_own():
    collectives = set(base.OPERATIONS) - set(base.P2P_OPERATIONS)
    assert set(OPERATIONS) == collectives | {"barrier"}
    lanes = [row.lane for row in OPERATIONS.values()]
    assert len(set(lanes)) == len(lanes) and set(lanes) <= set(LANES) - set(EAGER_LANES)
    assert {row.name: (row.blocking, row.nonblocking) for row in OPERATIONS.values()} == {
        "allreduce": ("Allreduce", "Iallreduce"), "reduce": ("Reduce", "Ireduce"), "broadcast": ("Bcast", "Ibcast"),
        "allgather": ("Allgather", "Iallgather"), "gather": ("Gather", "Igather"),
        "reduce_scatter": ("Reduce_scatter_block", "Ireduce_scatter_block"), "alltoall": ("Alltoall", "Ialltoall"),
        "barrier": ("Barrier", "Ibarrier")}


@pytest.mark.parametrize(("name", "args", "rank", "want"), [
    ("allreduce", ("s", "sum"), 0, [IN_PLACE, "s", MOP]),
    ("reduce", ("s", "sum", 1), 1, [IN_PLACE, "s", MOP, 1]),  # the root: in place
    ("reduce", ("s", "sum", 1), 0, ["s", None, MOP, 1]),  # elsewhere: no receive buffer
    ("broadcast", ("s", 1), 0, ["s", 1]),
    ("allgather", ("s", "r"), 0, ["s", "r"]),
    ("gather", ("s", None, 1), 0, ["s", None, 1]),
    ("gather", ("s", "r", 1), 1, ["s", "r", 1]),
    ("reduce_scatter", ("s", "r", "sum"), 0, ["s", "r", MOP]),
    ("alltoall", ("s", "r"), 0, ["s", "r"]),
    ("barrier", (), 0, []),
])
def test_each_row_gives_mpi4py_the_arguments_of_its_call(name, args, rank, want):
    """The transport's arguments (buffers, then op, then root) as mpi4py's, the buffers already specs."""
    row = OPERATIONS[name]
    specs, op, root = row.parts(args)
    assert row.arguments(specs, None if op is None else MOP, root, rank, IN_PLACE) == want


def test_the_count_rules():
    """What ``COLLECTIVES_MAX_COUNT`` bounds: a reduction's elements (a reduce-scatter's received block),
    data movement's bytes (an alltoall's per rank); a complex product's reduce never runs non-blocking."""
    x = np.zeros(6, np.float32)
    fits = {name: OPERATIONS[name].count for name in OPERATIONS}
    assert fits["allreduce"]((x, "sum"), 3) == 6 and fits["reduce"]((x, "sum", 0), 3) == 6
    assert fits["broadcast"]((x, 0), 3) == 24 and fits["allgather"]((x, x), 3) == 24
    assert fits["gather"]((x, None, 0), 3) == 24 and fits["alltoall"]((x, x), 3) == 8
    assert fits["reduce_scatter"]((x, x[:2], "sum"), 3) == 2 and fits["barrier"]((), 3) == 0
    assert OPERATIONS["reduce"].fits((x, "prod", 0), 3, 6)
    assert not OPERATIONS["reduce"].fits((x, "sum", 0), 3, 5)
    assert not OPERATIONS["reduce"].fits((x.astype(np.complex64), "prod", 0), 3, 6)
    assert OPERATIONS["reduce"].fits((x.astype(np.complex64), "sum", 0), 3, 6)


def test_the_hot_path_closure_calls_the_method_or_the_slow_path():
    calls = []

    def method(*a):
        calls.append(("mpi", *[v if not isinstance(v, list) else (v[0].nbytes, v[1]) for v in a]))

    def slow(*a):
        calls.append(("slow", *[v.nbytes if isinstance(v, np.ndarray) else v for v in a]))

    x, big = np.zeros(2), np.zeros(4)
    run = OPERATIONS["allreduce"].bind(method, "DOUBLE", MOP, IN_PLACE, 32, slow)
    run(x), run(big)
    bcast = OPERATIONS["broadcast"].bind(method, "BYTE", None, IN_PLACE, 32, slow)
    bcast(x, 1), bcast(big, 1)
    OPERATIONS["broadcast"].bind(method, "BYTE", None, IN_PLACE, None, None)(big, 0)
    scatter = OPERATIONS["reduce_scatter"].bind(method, "DOUBLE", MOP, IN_PLACE, 32, slow)
    scatter(big, x), scatter(np.zeros(8), big)  # counted by the receive buffer
    alltoall = OPERATIONS["alltoall"].bind(method, "BYTE", None, IN_PLACE, 32, slow)
    alltoall(x, x), alltoall(big, big)
    allgather = OPERATIONS["allgather"].bind(method, "BYTE", None, IN_PLACE, 32, slow)
    allgather(x, big), allgather(big, np.zeros(8))  # counted by the send buffer
    reduce = OPERATIONS["reduce"].bind(method, "DOUBLE", MOP, IN_PLACE, 32, slow, rank=1)
    reduce(x, 1), reduce(x, 0), reduce(big, 1)  # in place at the root (this rank), no receive elsewhere
    assert calls == [("mpi", IN_PLACE, (16, "DOUBLE"), MOP), ("slow", 32),
                     ("mpi", (16, "BYTE"), 1), ("slow", 32, 1), ("mpi", (32, "BYTE"), 0),
                     ("mpi", (32, "DOUBLE"), (16, "DOUBLE"), MOP), ("slow", 64, 32),
                     ("mpi", (16, "BYTE"), (16, "BYTE")), ("slow", 32, 32),
                     ("mpi", (16, "BYTE"), (32, "BYTE")), ("slow", 32, 64),
                     ("mpi", IN_PLACE, (16, "DOUBLE"), MOP, 1), ("mpi", (16, "DOUBLE"), None, MOP, 0),
                     ("slow", 32, 1)]
    with pytest.raises(ValueError, match="no form for the MPI operation gather"):
        OPERATIONS["gather"].bind(method, "BYTE", None, IN_PLACE, 32, slow)


class FakeComm:
    """An mpi4py communicator's methods, recorded: ``comm.Allreduce(*a)`` appends ``("Allreduce", *a)``."""

    def __init__(self):
        self.calls = []

    def __getattr__(self, method):
        return lambda *a: self.calls.append((method, *a)) or f"{method} request"


def test_each_row_makes_its_call_on_a_given_communicator():
    """``method``/``call``: the row's blocking or non-blocking method on any communicator (a lane, the
    agreement communicator, a node's), with the row's arguments; the object bytes' allgatherv and the
    point-to-point rows (a message: header lane, data lane; spec, peer, tag, a receive's status)."""
    comm = FakeComm()
    allreduce, bcast, barrier = OPERATIONS["allreduce"], OPERATIONS["broadcast"], OPERATIONS["barrier"]
    assert allreduce.call(comm, (["x", "T"],), MOP, in_place=IN_PLACE) == "Allreduce request"
    assert bcast.call(comm, (["n", "I"],), root=1, blocking=False) == "Ibcast request"
    OPERATIONS["reduce"].call(comm, ("s",), MOP, 0, rank=1)  # not the root: no receive buffer
    assert barrier.method(comm, False)() == "Ibarrier request"
    assert ALLGATHERV.call(comm, ("s", ["t", ("sizes", "offsets"), "B"]), blocking=False) == "Iallgatherv request"
    send, recv = MESSAGES["send"], MESSAGES["recv"]
    assert (send.lane, send.data_lane) == (recv.lane, recv.data_lane) == ("p2p", "p2p_data")
    send.call(comm, ["h", "I"], 1, 5)
    assert recv.call(comm, ["h", "I"], 0, 5, blocking=False) == "Irecv request"
    recv.call(comm, ["h", "I"], 0, 5, "status")
    assert comm.calls == [("Allreduce", IN_PLACE, ["x", "T"], MOP), ("Ibcast", ["n", "I"], 1),
                          ("Reduce", "s", None, MOP, 0), ("Ibarrier",),
                          ("Iallgatherv", "s", ["t", ("sizes", "offsets"), "B"]),
                          ("Send", ["h", "I"], 1, 5), ("Irecv", ["h", "I"], 0, 5), ("Recv", ["h", "I"], 0, 5, "status")]
    assert set(MESSAGES) == set(base.P2P_OPERATIONS)


def test_the_fingerprint_binding_is_the_in_place_call():
    """``bind_in_place``: the fingerprint's ``Iallreduce(IN_PLACE, v, MAX)``, bound once: only for a row of
    one buffer reduced in place."""
    comm = FakeComm()
    run = OPERATIONS["allreduce"].bind_in_place(OPERATIONS["allreduce"].method(comm, False), "MAX", IN_PLACE)
    assert run("v") == "Iallreduce request" and comm.calls == [("Iallreduce", IN_PLACE, "v", "MAX")]
    with pytest.raises(ValueError, match="broadcast is not one buffer reduced in place"):
        OPERATIONS["broadcast"].bind_in_place(None, None, IN_PLACE)
