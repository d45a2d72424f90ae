"""Every environment variable the library reads, read in one place.

==============================  ===========================================================  ==========
variable                        meaning                                                      default
==============================  ===========================================================  ==========
``COLLECTIVES_BACKEND``         backend for ``init("auto")``: ``auto``, ``mpi``, ``self``    ``auto``
``COLLECTIVES_CHECK``           ``1``: cross-rank agreement check before every collective    ``0``
``COLLECTIVES_CHECK_NAN``       ``1``: refuse a float reduction of NaN/inf (NonFiniteError)  ``0``
``COLLECTIVES_TIMEOUT``         seconds before a blocked collective is declared hung         unset/300
``COLLECTIVES_MPI_THREAD_LEVEL`` thread level when *we* initialise MPI                       ``serialized``
``COLLECTIVES_MAX_COUNT``       largest element count handed to one MPI call (chunking)      ``2**31-1``
``COLLECTIVES_BUCKET_BYTES``    size bound of a fused tree bucket                            25 MiB
``COLLECTIVES_NCCL_LIBRARY``    explicit path of ``libnccl.so.2``                            search
``COLLECTIVES_DISABLE_NCCL``    ``1``: never use NCCL (CUDA arrays go through MPI or host)   ``0``
``COLLECTIVES_CUDA_AWARE_MPI``  ``1``: hand CUDA pointers to MPI; ``0``: stage through host  unset
``COLLECTIVES_NCCL_EAGER``      ``1``: set up the CUDA transport at init, not at first use  ``0``
``COLLECTIVES_ABORT_ON_ERROR``  ``0``: do not abort the job on an uncaught exception         ``1``
``COLLECTIVES_SHM``             ``0``: never reduce through node-shared memory, MPI only     ``1``
``COLLECTIVES_SHM_THRESHOLD``   host allreduces of this many bytes and up use shared memory  256 KiB
``COLLECTIVES_SHM_SLOT_BYTES``  shared-memory window bytes per rank (the piece size)         1 MiB
``COLLECTIVES_SYNC_PIPELINE``   ``0``: synchronize through MPI_Bcast of packed buckets        ``1``
``COLLECTIVES_SIMULATE_NODES``  N: every N consecutive ranks of a node act as one node (tests)  unset
``COLLECTIVES_TRACE_BUFFER``    calls each communicator keeps in its record (``0``: none)    2000
``COLLECTIVES_TRACE_DIR``       where the per-rank trace dumps are written                   ``./collectives-trace``
``COLLECTIVES_TRACE_FORMAT``    the dumps: ``collectives`` (JSON), ``torch`` or ``both``     ``collectives``
``COLLECTIVES_STALL_WARN_S``    seconds in one collective before a stall warning (``0``: off) 60
``COLLECTIVES_REPRODUCIBLE``    ``1``: float sums and means are reproducible by default      ``0``
==============================  ===========================================================  ==========
"""

from __future__ import annotations

import os

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def flag(name: str, default: bool = False) -> bool:
    """Read a boolean environment variable; anything unrecognised is a ValueError naming it."""
    raw = os.environ.get(name)
    if raw is None:
        return default
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"environment variable {name}={raw!r}: expected 1/0, true/false, yes/no or on/off")


def integer(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = int(raw, 0)
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r}: expected an integer") from None
    if value <= 0:
        raise ValueError(f"environment variable {name}={raw!r}: expected a positive integer")
    return value


def seconds(name: str) -> float | None:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return None
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r}: expected a number of seconds") from None
    return value if value > 0 else None


def string(name: str, default: str) -> str:
    raw = os.environ.get(name)
    return default if raw is None or raw.strip() == "" else raw.strip()


def backend() -> str:
    return string("COLLECTIVES_BACKEND", "auto").lower()


def check() -> bool:
    return flag("COLLECTIVES_CHECK")


def check_nan() -> bool:
    """``COLLECTIVES_CHECK_NAN=1``: every rank scans the input of a floating reduction for NaN and inf
    before it moves, and every rank raises ``NonFiniteError`` when one has any (``_finite``); read when a
    host transport is made, on if any rank of it sets it (agreed: the check is one more collective)."""
    return flag("COLLECTIVES_CHECK_NAN")


def reproducible() -> bool:
    """``COLLECTIVES_REPRODUCIBLE=1``: a communicator's float and complex sums and means default to
    ``reproducible=True`` (the same bits at any number of ranks; see docs/semantics.md)."""
    return flag("COLLECTIVES_REPRODUCIBLE")


def timeout() -> float | None:
    return seconds("COLLECTIVES_TIMEOUT")


def mpi_thread_level() -> str:
    level = string("COLLECTIVES_MPI_THREAD_LEVEL", "serialized").lower()
    if level not in ("single", "funneled", "serialized", "multiple"):
        raise ValueError(f"environment variable COLLECTIVES_MPI_THREAD_LEVEL={level!r}: expected single, "
                         f"funneled, serialized or multiple")
    return level


def max_count() -> int:
    return integer("COLLECTIVES_MAX_COUNT", 2**31 - 1)


def bucket_bytes() -> int:
    return integer("COLLECTIVES_BUCKET_BYTES", 25 * 2**20)


def bucket_bytes_set() -> bool:
    """Whether ``COLLECTIVES_BUCKET_BYTES`` is set (not empty): DistributedOptimizer's gradient buckets then
    take it where it is below their own bound."""
    return bool(os.environ.get("COLLECTIVES_BUCKET_BYTES"))


def shm() -> bool:
    """Whether large host allreduces may go through a node-shared MPI window (agreed over ranks)."""
    return flag("COLLECTIVES_SHM", True)


def simulate_nodes() -> int | None:
    """``COLLECTIVES_SIMULATE_NODES=N``: treat every N consecutive ranks of a real node as one node, to
    exercise the multi-node paths (hierarchical allreduce, synchronize's bucket path) on one machine."""
    return integer("COLLECTIVES_SIMULATE_NODES", 0) or None  # unset: 0; set: a positive integer


def sync_pipeline() -> bool:
    """Whether synchronize may send host trees as a point-to-point pipeline (agreed over ranks)."""
    return flag("COLLECTIVES_SYNC_PIPELINE", True)


def shm_threshold() -> int:
    """Smallest buffer, in bytes, reduced through shared memory; MPI's own allreduce below it."""
    return integer("COLLECTIVES_SHM_THRESHOLD", 256 * 2**10)


def shm_slot_bytes() -> int:
    """Shared-window bytes per rank; larger messages go through in pieces of about this size (1 MiB: a
    piece's data stays in the caches between the copy in, the reduction and the copy out; see
    docs/performance.md, "The slot size")."""
    return integer("COLLECTIVES_SHM_SLOT_BYTES", 2**20)


# Variables set by process launchers, giving the number of processes they started. If one of these says
# more than one and MPI is unusable, init() refuses instead of running N independent size-1 copies.
LAUNCHER_SIZE_VARIABLES = (
    "PMI_SIZE",  # MPICH hydra, Intel MPI, PMI-1/2
    "PMIX_SIZE",
    "OMPI_COMM_WORLD_SIZE",  # Open MPI
    "MPI_LOCALNRANKS",  # MPICH hydra
    "MV2_COMM_WORLD_SIZE",  # MVAPICH2
    "PALS_SIZE",  # HPE/Cray PALS
    "SLURM_STEP_NUM_TASKS",  # srun (the step, not the allocation)
)


def launcher_size() -> tuple[str, int] | None:
    """The first launcher variable claiming more than one process, as (name, size), else None."""
    for name in LAUNCHER_SIZE_VARIABLES:
        raw = os.environ.get(name)
        if raw is None:
            continue
        try:
            n = int(raw.split("(")[0])
        except ValueError:
            continue
        if n > 1:
            return name, n
    return None


def torchrun_run_id() -> str | None:
    """``TORCHELASTIC_RUN_ID``, which torchrun (torch's elastic agent) sets in every worker it starts, else
    None: the torch backend then joins the workers into one MPI job, or says why it cannot (docs/torchrun.md)."""
    raw = os.environ.get("TORCHELASTIC_RUN_ID")
    return None if raw is None else raw.strip()


TORCH_LAUNCH_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def torch_launch() -> dict[str, str]:
    """torch's launch variables (:data:`TORCH_LAUNCH_VARIABLES`) that are set and not empty, by name: the
    torch backend's ``env://`` rendezvous chooses between torch's and MPI's ranks by them."""
    return {name: os.environ[name] for name in TORCH_LAUNCH_VARIABLES if os.environ.get(name)}


def environment() -> dict[str, str]:
    """A copy of the whole environment, for ``_launcher``: it recognises the launcher that started this
    process by the variables that launcher sets, and builds a new job's environment from this one."""
    return dict(os.environ)


def as_set(name: str) -> str | None:
    """A variable's text as set (None when unset), for an error message that quotes it."""
    return os.environ.get(name)


_PMI_CLIENT = ("PMI_FD", "PMI_RANK", "PMI_SIZE")


def set_pmi_client(fd: int | None, rank: int = 0, size: int = 1) -> None:
    """Set (``fd`` an open socket to a PMI-1 server) or remove (``fd=None``) the variables through which
    MPICH's ``MPI_Init`` finds its launcher: the torch backend makes torchrun's workers one MPI job this way
    (``_launcher.pmi_server``) and removes them once MPI runs, so no process started later inherits them."""
    if fd is None:
        for name in _PMI_CLIENT:
            os.environ.pop(name, None)
    else:
        os.environ.update(PMI_FD=str(fd), PMI_RANK=str(rank), PMI_SIZE=str(size))


# ---- CUDA arrays (read by _backends/cuda.py and _backends/nccl.py) ----

DEVICE_TIMEOUT_DEFAULT = 300.0  # seconds: NCCL set-up and every poll of a non-blocking NCCL call


def device_timeout() -> float:
    """``COLLECTIVES_TIMEOUT``, or 300 s when unset: how long a NCCL call may stay in progress."""
    return timeout() or DEVICE_TIMEOUT_DEFAULT


def disable_nccl() -> bool:
    return flag("COLLECTIVES_DISABLE_NCCL")


def nccl_library() -> str | None:
    """``COLLECTIVES_NCCL_LIBRARY``: the path of ``libnccl.so.2`` to load, None when unset or empty."""
    return string("COLLECTIVES_NCCL_LIBRARY", "") or None


def cuda_aware_mpi() -> bool | None:
    """``COLLECTIVES_CUDA_AWARE_MPI``: True/False when set, None when unset (CUDA arrays are then staged
    through host memory when NCCL is unavailable, with a one-time warning)."""
    raw = os.environ.get("COLLECTIVES_CUDA_AWARE_MPI")
    if raw is None or raw.strip() == "":
        return None
    return flag("COLLECTIVES_CUDA_AWARE_MPI")


def nccl_eager() -> bool:
    """``COLLECTIVES_NCCL_EAGER=1``: set up this rank's CUDA transport (NCCL, ...) at ``init()``, agreed by
    every rank (``_backends.cuda.initialize_eagerly``), not at the first CUDA collective."""
    return flag("COLLECTIVES_NCCL_EAGER")


def nccl_multi_rank_gpu() -> bool:
    """NCCL's own ``NCCL_MULTI_RANK_GPU_ENABLE``, read the way NCCL reads it (an integer, non-zero = on)."""
    raw = os.environ.get("NCCL_MULTI_RANK_GPU_ENABLE", "").strip()
    try:
        return int(raw, 0) != 0
    except ValueError:
        return False


# ---- every variable, validated at once (issue 12 item 2) ----

def trace_buffer() -> int:
    """Calls each communicator's record keeps (``COLLECTIVES_TRACE_BUFFER``; 0: no record, no dumps)."""
    raw = os.environ.get("COLLECTIVES_TRACE_BUFFER")
    if raw is None or raw.strip() == "":
        return 2000
    try:
        value = int(raw, 0)
    except ValueError:
        value = -1
    if value < 0:
        raise ValueError(f"environment variable COLLECTIVES_TRACE_BUFFER={raw!r}: expected an integer >= 0 "
                         f"(0 turns the record off)")
    return value


def trace_dir() -> str:
    """Where trace dumps go (``COLLECTIVES_TRACE_DIR``), as an absolute path; created when first needed."""
    return os.path.abspath(string("COLLECTIVES_TRACE_DIR", "collectives-trace"))


TRACE_FORMATS = ("collectives", "torch", "both")


def trace_format() -> str:
    """What each rank's trace dump is written as (``COLLECTIVES_TRACE_FORMAT``): ``collectives`` (our JSON,
    the default), ``torch`` (torch's flight-recorder pickle, for its ``fr_trace``, instead) or ``both``."""
    value = string("COLLECTIVES_TRACE_FORMAT", "collectives").lower()
    if value not in TRACE_FORMATS:
        raise ValueError(f"environment variable COLLECTIVES_TRACE_FORMAT="
                         f"{os.environ.get('COLLECTIVES_TRACE_FORMAT')!r}: expected collectives, torch or both")
    return value


def timeline() -> str | None:
    """Where each rank writes the timeline of every call (``COLLECTIVES_TIMELINE``: a path prefix, each
    rank's Chrome trace is ``<prefix>.<rank>``), as an absolute path; None (the default): no timeline."""
    raw = os.environ.get("COLLECTIVES_TIMELINE")
    if raw is None or raw.strip() == "":
        return None
    return os.path.abspath(raw.strip())


def stall_warn_s() -> float | None:
    """Seconds one collective may wait before every waiting rank warns (``COLLECTIVES_STALL_WARN_S``;
    default 60, ``0``: never)."""
    raw = os.environ.get("COLLECTIVES_STALL_WARN_S")
    if raw is None or raw.strip() == "":
        return 60.0
    return seconds("COLLECTIVES_STALL_WARN_S")


def _backend_checked() -> str:
    value = backend()
    if value not in ("auto", "mpi", "self"):
        raise ValueError(f"environment variable COLLECTIVES_BACKEND={os.environ.get('COLLECTIVES_BACKEND')!r}: "
                         f"expected auto, mpi or self")
    return value


def _abort_on_error() -> bool:
    return flag("COLLECTIVES_ABORT_ON_ERROR", True)


# Every reader of a variable that can be malformed. A variable read later (at first use, or per call) is
# read here first too, so that a malformed value is refused at init, where the ranks agree on it.
READERS = (_backend_checked, check, check_nan, timeout, mpi_thread_level, max_count, bucket_bytes, shm,
           simulate_nodes, sync_pipeline, shm_threshold, shm_slot_bytes, _abort_on_error,
           disable_nccl, cuda_aware_mpi, nccl_eager, trace_buffer, trace_format, stall_warn_s, reproducible)


def problems() -> list[str]:
    """One line per malformed variable (each names the variable, its value and what was expected)."""
    found = []
    for read in READERS:
        try:
            read()
        except ValueError as exc:
            found.append(str(exc).removeprefix("environment variable "))
    return found


def malformed(bad: dict[int, list[str]]) -> ValueError:
    """The one ValueError every rank raises at init when some rank has a malformed variable: ``bad`` holds
    each such rank's :func:`problems`. The transports refuse with it after gathering every rank's problems
    (``_agree.refuse_together(via, problems(), malformed)``: at init, before anything else talks), so
    every rank raises the same message, naming each rank's variables."""
    lines = [f"rank {r}: {line}" for r, found in bad.items() for line in found]
    return ValueError(
        "malformed environment variable" + ("s" if len(lines) > 1 else "") + " (" + "; ".join(lines) + "); "
        "fix or unset it on the rank named and start again (every rank refuses, so that none waits "
        "for the others; docs/configuration.md lists what each variable takes)")
