"""One failure scenario, run by every rank: ``mpiexec -n N python tests/crash/scenario.py NAME``.

The rank that causes the failure prints ``FAILING <name> AT <time.time()>`` to stdout (flushed) just
before it fails, so the test can tell how long the job took to end after the failure, apart from the
start-up time. A rank that gets past the point where the job should have ended prints ``SURVIVED``.
Scenarios that must end cleanly print ``DONE <rank>`` and exit 0.
"""

import os
import signal
import sys
import time

import numpy as np

import collectives as coll


def say(line: str) -> None:
    """One line on stdout in one write, so that lines of different ranks do not interleave."""
    sys.stdout.flush()
    os.write(1, (line + "\n").encode())


def mark(what: str) -> None:
    say(f"FAILING {what} AT {time.time():.3f}")


BAD_SETTINGS = [  # (variable, malformed value): the thread level first, while MPI is not initialised yet
    ("COLLECTIVES_MPI_THREAD_LEVEL", "many"), ("COLLECTIVES_TIMEOUT", "abc"), ("COLLECTIVES_MAX_COUNT", "lots"),
    ("COLLECTIVES_SHM", "maybe"), ("COLLECTIVES_SIMULATE_NODES", "two"), ("COLLECTIVES_BACKEND", "tcp"),
    ("COLLECTIVES_CHECK", "please"), ("COLLECTIVES_ABORT_ON_ERROR", "never"),
]


def main(name: str) -> None:
    if name == "clean-eager-refused":  # COLLECTIVES_NCCL_EAGER=1 without a GPU: init refuses on every rank
        import torch

        try:
            coll.init()
        except coll.BackendUnavailableError as e:
            say(f"refused: {str(e).splitlines()[0][:120]}")
        else:
            raise AssertionError("init() did not refuse")
        os.environ["COLLECTIVES_NCCL_EAGER"] = "0"  # after a refused init, init works again
    if name.startswith("bad-setting"):  # issue 12 item 2: a malformed variable on the last rank only
        env = os.environ  # the launcher's own rank variables (MPI is not initialised yet): Hydra's or PRRTE's
        launched_rank = int(env.get("PMI_RANK", env.get("OMPI_COMM_WORLD_RANK", env.get("PMIX_RANK", "0"))))
        launched_size = int(env.get("PMI_SIZE", env.get("OMPI_COMM_WORLD_SIZE", "1")))
        bad = launched_rank == launched_size - 1
        if name == "bad-setting":  # uncaught: every rank raises, so the job ends
            variable, value = BAD_SETTINGS[1]
            if bad:
                os.environ[variable] = value
                mark(name)
            coll.init()
        for variable, value in BAD_SETTINGS:
            if bad:
                os.environ[variable] = value
            try:
                coll.init()
            except ValueError as e:
                assert variable in str(e) and repr(value) in str(e), e
                say(f"rank {launched_rank} refused {variable}: {str(e)[:100]}")
            else:
                raise AssertionError(f"{variable}={value!r} on rank {launched_size - 1} was not refused")
            os.environ.pop(variable, None)
    comm = coll.init()
    rank, last = comm.rank, comm.size - 1
    x = np.ones(4)
    comm.allreduce(x)  # everybody is up and talking

    if name == "exception":  # one rank raises; the others are blocked in a collective
        if comm.rank == last:
            mark(name)
            raise ValueError(f"boom from rank {comm.rank}")
        comm.allreduce(x)

    elif name == "library-error":  # an invalid call on one rank, unchecked: a TypeError there
        if comm.rank == last:
            mark(name)
            comm.allreduce(np.arange(4), op="mean")
        else:
            comm.allreduce(x, op="mean")

    elif name == "mpi-error":  # unchecked, one rank's buffer is smaller: MPI itself reports the error
        if comm.rank == last:
            mark(name)
        comm.broadcast(np.zeros(4 if comm.rank == last else 64), root=0)
        comm.allreduce(x)

    elif name == "sigkill":  # one rank is killed hard mid-training
        for step in range(5):
            if step == 3 and comm.rank == last:
                mark(name)
                os.kill(os.getpid(), signal.SIGKILL)
            comm.allreduce(x)

    elif name == "mismatch":  # checked mode, different shapes, not caught: every rank raises
        if comm.rank == 0:
            mark(name)
        comm.allreduce(np.ones(4 + (comm.rank == last)))

    elif name == "mismatch-caught":  # checked mode, caught on every rank, then the job goes on
        try:
            comm.allreduce(np.ones(4 + (comm.rank == last)))
        except coll.MismatchError as e:
            say(f"rank {comm.rank} caught MismatchError: {e}")
        else:
            raise AssertionError("no MismatchError")
        try:
            if comm.rank == last:
                comm.broadcast(x, root=comm.size)  # out of range, on this rank only
            else:
                comm.broadcast(x, root=0)
        except (ValueError, coll.MismatchError) as e:
            say(f"rank {comm.rank} caught {type(e).__name__}: {e}")
        else:
            raise AssertionError("no error")
        y = np.full(3, float(comm.rank))
        comm.allreduce(y)
        assert (y == sum(range(comm.size))).all(), y

    elif name == "clean-fp-errors":  # one rank makes NumPy's floating-point errors exceptions (issue 12)
        import warnings

        big = 1 << 16  # elements: past the shared-memory threshold, every rank reduces a slice
        if comm.rank == last:
            np.seterr(all="raise")
            warnings.simplefilter("error")  # as python -W error, or pytest's filterwarnings = error
        cases = [
            (np.full(big, np.inf if comm.rank % 2 == 0 else -np.inf), "sum"),  # inf - inf on some slices
            (np.full(big, 60000.0, np.float16), "sum"),  # float16 overflow
            (np.full(3, 60000.0, np.float16), "sum"),  # the same, small (widened where the MPI has no float16)
            (np.full(3, 1e300), "prod"),  # an overflow in MPI's own product (the values travel as they are)
            (np.array([5e-324, 3.0]), "mean"),  # underflow in mean's division
            (np.full(big, 1e300), "prod"),  # overflow
        ]
        for data, op in cases:
            try:
                comm.allreduce(data, op=op)
                coll.allreduce_tree({"a": data.copy(), "b": data[:3].copy()}, op=op)
                comm.allreduce(data, op=op, async_op=True).wait()  # the host rules' steps in a Handle
                coll.allreduce_tree({"a": data.copy(), "b": data[:3].copy()}, op=op, async_op=True).wait()
            except Exception as e:  # noqa: BLE001 - what a test runner would do: catch, report, go on
                say(f"rank {comm.rank} caught {type(e).__name__} in {op}: {e}")
        comm.allreduce(x)

    elif name == "deadline":  # one rank never arrives; the others' deadline ends the job
        if comm.rank == last:
            time.sleep(120)
        else:
            mark(name)
        comm.allreduce(x)

    elif name == "async-never-issued":  # one rank never issues the matching async call: wait()'s deadline
        if comm.rank == last:
            time.sleep(120)
        else:
            h = comm.allreduce(x, async_op=True)
            mark(name)
            h.wait()

    elif name == "deadline-checked":  # the same, caught in checked mode's agreement step
        if comm.rank == last:
            time.sleep(120)
        else:
            mark(name)
        comm.broadcast(x, root=0)

    elif name == "early-exit":  # one rank returns early (status 0), the others still call collectives
        if comm.rank == last:
            mark(name)
            sys.exit(0)
        comm.allreduce(x)

    elif name == "torch-exception":  # the same under torch.distributed's backend "collectives" (whose
        import torch as th  # init_process_group wraps sys.excepthook, capturing stderr around the hook)
        import torch.distributed as dist

        import collectives.torch_backend

        dist.init_process_group("collectives")
        t = th.ones(3)
        dist.all_reduce(t)
        if comm.rank == last:
            mark(name)
            raise ValueError(f"boom from rank {comm.rank}")
        dist.all_reduce(t)

    elif name == "torch-killed":  # rank 0 of a torch group killed outright: nothing of the store may remain
        import torch as th
        import torch.distributed as dist

        import collectives.torch_backend

        dist.init_process_group("collectives")
        t = th.ones(3)
        dist.all_reduce(t)
        if comm.rank == 0:
            mark(name)
            os.kill(os.getpid(), signal.SIGKILL)
        dist.all_reduce(t)

    elif name == "clean":  # all the collectives, then exit without finalize(): status 0, nothing on stderr
        comm.broadcast(x, root=last)
        comm.reduce(x, op="max", root=last)
        comm.allgather(x)
        comm.barrier()
        if hasattr(coll, "allreduce_tree"):
            coll.allreduce_tree({"w": np.ones(3), "b": [np.zeros(2)]}, op="mean")
        from mpi4py import MPI

        user = MPI.COMM_WORLD.Split(0, last - comm.rank)
        coll.init(comm=user).allreduce(x)  # a second communicator, never released by the user

    elif name == "clean-finalize":  # the same with an explicit finalize, and init again after it
        coll.finalize()
        comm = coll.init()
        comm.allreduce(x)
        coll.finalize()

    elif name == "bad-setting-caught":  # after every refused init (above): collectives work
        assert (x == comm.size).all(), x

    elif name == "clean-eager-refused":  # after the refused init (above): collectives work
        assert (x == comm.size).all() and not comm._devices, (x, comm._devices)

    # ---- the flight recorder (issue 22): each leaves its dumps in COLLECTIVES_TRACE_DIR ----
    elif name == "trace-skip":  # the last rank skips an allreduce the others call, then waits in a barrier
        for _ in range(3):
            comm.allreduce(x)
        if comm.rank == last:
            mark(name)
            comm.barrier()  # TRACE-SKIP-BARRIER
        else:
            comm.allreduce(x)  # TRACE-SKIP-ALLREDUCE
        comm.barrier()

    elif name == "trace-extra":  # the last rank makes one allreduce more than the others, who go on to a barrier
        for _ in range(3):
            comm.allreduce(x)
        if comm.rank == last:
            mark(name)
            comm.allreduce(x)  # TRACE-EXTRA-ALLREDUCE
        comm.barrier()  # TRACE-EXTRA-BARRIER

    elif name == "trace-count":  # the last rank's allreduce has one element more (unchecked: the fingerprint
        # beside the transfer, with COLLECTIVES_TIMEOUT set, finds it)
        for _ in range(3):
            comm.allreduce(x)
        y = np.ones(5 if comm.rank == last else 4)
        if comm.rank == last:
            mark(name)
        comm.allreduce(y)  # TRACE-COUNT-ALLREDUCE

    elif name == "trace-hang-sigusr1":  # no deadline: the last rank waits in MPI_Recv for a message that never
        # comes while the others wait in an allreduce it never enters; the test signals them (SIGUSR1), reads
        # the dumps, and kills the job
        for _ in range(3):
            comm.allreduce(x)
        say(f"PID {comm.rank} {os.getpid()}")
        if comm.rank == last:
            comm.recv(np.zeros(1), src=0, tag=77)  # TRACE-HANG-RECV
        else:
            comm.allreduce(x)  # TRACE-HANG-ALLREDUCE
        say("SURVIVED")

    elif name == "trace-divergent":  # the last rank calls broadcast where the others call allreduce
        comm.allreduce(x)
        mark(name)
        if comm.rank == last:
            comm.broadcast(x, root=0)  # TRACE-DIVERGENT-BROADCAST
        else:
            comm.allreduce(x)  # TRACE-DIVERGENT-ALLREDUCE

    elif name == "clean-trace-stall":  # the last rank computes for a while; the others wait in an allreduce
        import threading

        if comm.rank == 0:  # while the main thread waits inside MPI, ask every rank for a dump
            threading.Thread(target=lambda: (time.sleep(float(os.environ["TRACE_ASK_AT"])),
                                             coll.dump_trace(all_ranks=True)), daemon=True).start()
        if comm.rank == last:
            time.sleep(float(os.environ["TRACE_SLEEP"]))  # TRACE-STALL-SLEEP
        comm.allreduce(x)  # TRACE-STALL-ALLREDUCE
        assert (x == comm.size ** 2).all(), x

    elif name == "hang-trace-stall-divergent":  # the same call number, two collectives, no deadline: a hang
        comm.allreduce(x)
        if comm.rank == last:
            comm.barrier()  # TRACE-STALL-DIVERGENT-BARRIER
        else:
            comm.allreduce(x)  # TRACE-STALL-DIVERGENT-ALLREDUCE
        say(f"SURVIVED {rank}")  # never: the test kills the job once the warnings are out

    elif name == "clean-trace-sigusr1":  # every rank gets SIGUSR1 mid-run; the job goes on, correct
        for i in range(20):
            comm.allreduce(x)
            if i == 10:
                os.kill(os.getpid(), signal.SIGUSR1)
        assert (x == comm.size ** 21).all(), x

    elif name == "clean-trace-p2p-stall":  # the last rank waits in a recv; rank 0 computes before it sends
        if comm.rank == 0 and comm.size > 1:
            time.sleep(float(os.environ["TRACE_SLEEP"]))  # TRACE-P2P-SLEEP
            comm.send(np.full(3, 7.0), last, tag=5)
        elif comm.rank == last:
            got = np.zeros(3)
            comm.recv(got, src=0, tag=5)  # TRACE-P2P-RECV
            assert (got == 7.0).all(), got
        comm.barrier()

    elif name == "trace-nan":  # COLLECTIVES_CHECK_NAN=1: the last rank's input holds a NaN; nobody catches it
        comm.allreduce(x)
        y = np.ones(6, np.float32)
        if comm.rank == last:
            y[4] = np.nan
        mark(name)
        comm.allreduce(y)  # TRACE-NAN-ALLREDUCE

    elif name == "clean-trace-slow":  # the last rank arrives late at every call (a straggler); the job goes on
        before = x.copy()
        for _ in range(8):
            if comm.rank == last:
                time.sleep(0.2)  # TRACE-SLOW-SLEEP
            comm.allreduce(x, async_op=True).wait()  # the general path: its record keeps the start time
        coll.dump_trace()
        assert (x == before * comm.size ** 8).all(), x

    elif name == "clean-trace-fronts":  # the torch backend and DistributedOptimizer's buckets, recorded
        import torch
        import torch.distributed as dist

        import collectives.torch_backend

        dist.init_process_group("collectives")
        t = torch.ones(3)
        dist.all_reduce(t)  # TRACE-FRONTS-DIST
        model = torch.nn.Linear(3, 2)
        opt = coll.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
        model(torch.ones(4, 3)).sum().backward()  # TRACE-FRONTS-BACKWARD
        opt.step()
        dist.barrier()  # (torch's analyzer takes a collective numbered K right before a p2p call numbered K
        # for one coalesced group: not this one, #2 before p2p #1)
        if comm.size > 1:  # point-to-point through the backend: ranks 0 and 1
            if rank == 0:
                dist.send(t, 1)
            elif rank == 1:
                dist.recv(t, 0)
        dist.barrier()
        coll.dump_trace()
        dist.destroy_process_group()

    elif name == "clean-timeline":  # COLLECTIVES_TIMELINE (set by the test): 60 calls of every kind on one
        # communicator, then the fronts (the torch backend, the gradient buckets) and point-to-point elsewhere
        import torch
        import torch.distributed as dist

        import collectives.torch_backend  # noqa: F401 - registers the backend

        sub = comm.split(0)
        y = np.ones(2, np.float32)
        for _ in range(20):
            sub.allreduce(y)  # the hot path from the second call
        for _ in range(10):
            sub.broadcast(y, 0)
        for _ in range(5):
            sub.allreduce(y, async_op=True).wait()
        for _ in range(5):
            sub.allreduce_tree({"w": np.ones(3), "b": np.ones(2, np.float32)})
        for _ in range(5):
            sub.reduce_scatter(np.ones(2 * sub.size))
        for _ in range(5):
            sub.allgather(y)
        for _ in range(4):
            sub.allreduce(np.ones(3), "min")  # a host reduction (min of floats: NaN and zero signs kept)
        for _ in range(3):
            sub.barrier()
        sub.broadcast_object({"step": 1})
        sub.allgather_object(rank)
        sub.alltoall(np.ones(sub.size))
        if comm.size > 1:  # point-to-point on the world communicator: ranks 0 and 1
            if rank == 0:
                comm.send(y, 1)
            elif rank == 1:
                comm.recv(y, 0)
        dist.init_process_group("collectives")
        t = torch.ones(3)
        dist.all_reduce(t)
        model = torch.nn.Linear(3, 2)
        opt = coll.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
        model(torch.ones(4, 3)).sum().backward()
        opt.step()
        dist.destroy_process_group()

    else:
        raise SystemExit(f"unknown scenario {name!r}")

    if name.startswith(("clean", "mismatch-caught", "bad-setting-caught")):
        say(f"DONE {rank}")
    else:
        say(f"SURVIVED {rank}")


if __name__ == "__main__":
    main(sys.argv[1])
