"""Pure-ctypes binding of ``libnccl.so.2``.

This module imports nothing but the standard library: no array library (NumPy, torch, CuPy) and no
mpi4py. Device buffers, CUDA streams and communicators cross the boundary as plain integers (raw
pointers), so any array library can hand us its ``data_ptr()`` / ``__cuda_array_interface__`` address.

Layout:

* :func:`find_library` locates ``libnccl.so.2`` (``COLLECTIVES_NCCL_LIBRARY``, then the
  ``nvidia-nccl-cu12`` / ``nvidia-nccl-cu13`` wheel, then the system loader).
* :class:`NCCLLibrary` loads it once per path and binds the C functions listed in the declarative
  table ``_FUNCTIONS`` (one entry per C function, its prototype in a comment). Every method raises
  :class:`~collectives.NcclError` with the numeric status, its symbolic name, NCCL's own text and the
  C function name; ``ncclInProgress`` is *not* an error for the calls that may be non-blocking.
* Enum values (``ncclResult_t``, ``ncclRedOp_t``, ``ncclDataType_t``) are module-level ints and dicts,
  checked against the installed ``nccl.h`` by ``tests/unit/test_libnccl.py``.
* :func:`supported_dtype_op` holds our rules for which dtype/op pairs NCCL can reduce and how
  (bool as uint8, complex as pairs of reals, ...).

Example:
    >>> from collectives._backends import _libnccl
    >>> lib = _libnccl.get()                      # doctest: +SKIP
    >>> lib.version_tuple >= (2, 18, 0)           # doctest: +SKIP
    True
    >>> len(lib.get_unique_id())                  # doctest: +SKIP
    128
"""

from __future__ import annotations

import ctypes
import ctypes.util
import importlib.util
import os
import threading
from typing import Any, NamedTuple

from .. import _config, _ops
from .._errors import NcclError

__all__ = [
    "DATATYPE_NAMES",
    "DTYPE_BY_NAME",
    "ENV_DISABLE",
    "ENV_LIBRARY",
    "OP_BY_NAME",
    "REDOP_NAMES",
    "RESULT_NAMES",
    "NCCLLibrary",
    "NcclNotFound",
    "decode_version",
    "find_library",
    "get",
    "info",
    "make_config",
    "ncclConfig_t",
    "ncclUniqueId",
    "nccl_version_code",
    "supported_dtype_op",
    "unique_id",
    "unique_id_from_bytes",
    "unique_id_to_bytes",
]

ENV_LIBRARY = "COLLECTIVES_NCCL_LIBRARY"
ENV_DISABLE = "COLLECTIVES_DISABLE_NCCL"

LIBRARY_NAME = "libnccl.so.2"

# --------------------------------------------------------------------------------------------------
# Enums (values from nccl.h 2.32.3; tests/unit/test_libnccl.py parses the installed header and fails
# if any of these drift).
# --------------------------------------------------------------------------------------------------

# ncclResult_t
ncclSuccess = 0
ncclUnhandledCudaError = 1
ncclSystemError = 2
ncclInternalError = 3
ncclInvalidArgument = 4
ncclInvalidUsage = 5
ncclRemoteError = 6
ncclInProgress = 7
ncclTimeout = 8
ncclNumResults = 9  # not a result: the count of results

RESULT_NAMES: dict[int, str] = {
    ncclSuccess: "ncclSuccess",
    ncclUnhandledCudaError: "ncclUnhandledCudaError",
    ncclSystemError: "ncclSystemError",
    ncclInternalError: "ncclInternalError",
    ncclInvalidArgument: "ncclInvalidArgument",
    ncclInvalidUsage: "ncclInvalidUsage",
    ncclRemoteError: "ncclRemoteError",
    ncclInProgress: "ncclInProgress",
    ncclTimeout: "ncclTimeout",
}

# ncclRedOp_t (built-in operators; values >= ncclNumOps are user-created ops)
ncclSum = 0
ncclProd = 1
ncclMax = 2
ncclMin = 3
ncclAvg = 4
ncclNumOps = 5

REDOP_NAMES: dict[int, str] = {
    ncclSum: "ncclSum",
    ncclProd: "ncclProd",
    ncclMax: "ncclMax",
    ncclMin: "ncclMin",
    ncclAvg: "ncclAvg",
}

# ncclDataType_t (the aliases ncclChar, ncclInt, ncclHalf, ncclFloat, ncclDouble share values)
ncclInt8 = 0
ncclChar = 0
ncclUint8 = 1
ncclInt32 = 2
ncclInt = 2
ncclUint32 = 3
ncclInt64 = 4
ncclUint64 = 5
ncclFloat16 = 6
ncclHalf = 6
ncclFloat32 = 7
ncclFloat = 7
ncclFloat64 = 8
ncclDouble = 8
ncclBfloat16 = 9
ncclFloat8e4m3 = 10  # NCCL >= 2.24
ncclFloat8e5m2 = 11  # NCCL >= 2.24
ncclNumTypes = 12

DATATYPE_NAMES: dict[int, str] = {  # canonical (non-alias) name of each value
    ncclInt8: "ncclInt8",
    ncclUint8: "ncclUint8",
    ncclInt32: "ncclInt32",
    ncclUint32: "ncclUint32",
    ncclInt64: "ncclInt64",
    ncclUint64: "ncclUint64",
    ncclFloat16: "ncclFloat16",
    ncclFloat32: "ncclFloat32",
    ncclFloat64: "ncclFloat64",
    ncclBfloat16: "ncclBfloat16",
    ncclFloat8e4m3: "ncclFloat8e4m3",
    ncclFloat8e5m2: "ncclFloat8e5m2",
}

#: Our dtype names (NumPy spelling) -> ncclDataType_t, for dtypes NCCL reduces natively.
DTYPE_BY_NAME: dict[str, int] = {
    "int8": ncclInt8,
    "uint8": ncclUint8,
    "int32": ncclInt32,
    "uint32": ncclUint32,
    "int64": ncclInt64,
    "uint64": ncclUint64,
    "float16": ncclFloat16,
    "float32": ncclFloat32,
    "float64": ncclFloat64,
    "bfloat16": ncclBfloat16,
}

#: Our op names -> ncclRedOp_t ("mean" is NCCL's ncclAvg, NCCL >= 2.10; the NCCL transport does not use it:
#: ncclAvg multiplies by 1/n, and the host rules divide a sum once, so mean is ncclSum, then divided).
OP_BY_NAME: dict[str, int] = {
    "sum": ncclSum,
    "prod": ncclProd,
    "max": ncclMax,
    "min": ncclMin,
    "mean": ncclAvg,
}

# --------------------------------------------------------------------------------------------------
# Versions
# --------------------------------------------------------------------------------------------------


def nccl_version_code(major: int, minor: int, patch: int) -> int:
    """The ``NCCL_VERSION(X, Y, Z)`` macro of ``nccl.h``.

    Example:
        >>> nccl_version_code(2, 32, 3)
        23203
        >>> nccl_version_code(2, 8, 4)      # releases up to 2.8 used major*1000 + minor*100 + patch
        2804
    """
    if major <= 2 and minor <= 8:
        return major * 1000 + minor * 100 + patch
    return major * 10000 + minor * 100 + patch


def decode_version(code: int) -> tuple[int, int, int]:
    """Invert :func:`nccl_version_code`: ``ncclGetVersion``'s integer -> ``(major, minor, patch)``.

    Example:
        >>> decode_version(23203)
        (2, 32, 3)
        >>> decode_version(2804)
        (2, 8, 4)
    """
    code = int(code)
    if code < 10000:  # old encoding (NCCL <= 2.8)
        return code // 1000, (code % 1000) // 100, code % 100
    return code // 10000, (code % 10000) // 100, code % 100


# The nccl.h whose ncclConfig_t layout ncclConfig_t below mirrors.
HEADER_VERSION: tuple[int, int, int] = (2, 32, 3)
HEADER_VERSION_CODE: int = nccl_version_code(*HEADER_VERSION)

# --------------------------------------------------------------------------------------------------
# Structures
# --------------------------------------------------------------------------------------------------

NCCL_UNIQUE_ID_BYTES = 128
NCCL_API_MAGIC = 0xCAFEBEEF
NCCL_CONFIG_UNDEF_INT = -(2**31)  # INT_MIN
NCCL_CONFIG_UNDEF_PTR = None  # NULL


class ncclUniqueId(ctypes.Structure):
    """``typedef struct { char internal[NCCL_UNIQUE_ID_BYTES]; } ncclUniqueId;`` (passed by value).

    Example:
        >>> uid = ncclUniqueId.from_bytes(bytes(range(128)))
        >>> uid.to_bytes() == bytes(range(128))
        True
    """

    _fields_ = [("internal", ctypes.c_char * NCCL_UNIQUE_ID_BYTES)]

    def to_bytes(self) -> bytes:
        # Not ``self.internal``: ctypes truncates a c_char array at its first NUL byte.
        return ctypes.string_at(ctypes.addressof(self), NCCL_UNIQUE_ID_BYTES)

    @classmethod
    def from_bytes(cls, data: Any) -> ncclUniqueId:
        if isinstance(data, ncclUniqueId):
            return data
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise TypeError(
                f"a NCCL unique id must be {NCCL_UNIQUE_ID_BYTES} bytes (from get_unique_id()); "
                f"got {type(data).__name__}"
            )
        raw = bytes(data)
        if len(raw) != NCCL_UNIQUE_ID_BYTES:
            raise ValueError(
                f"a NCCL unique id must be exactly {NCCL_UNIQUE_ID_BYTES} bytes; got {len(raw)}. "
                f"Send every rank the bytes returned by get_unique_id() on one rank, unmodified"
            )
        return cls.from_buffer_copy(raw)


def unique_id_to_bytes(uid: ncclUniqueId) -> bytes:
    """The 128 raw bytes of a :class:`ncclUniqueId` (safe to send to other ranks)."""
    return uid.to_bytes()


def unique_id_from_bytes(data: Any) -> ncclUniqueId:
    """Rebuild a :class:`ncclUniqueId` from its 128 bytes.

    Raises:
        TypeError: ``data`` is not bytes-like.
        ValueError: ``data`` is not exactly 128 bytes.

    Example:
        >>> unique_id_from_bytes(b"\\x01" * 128).to_bytes()[:2]
        b'\\x01\\x01'
    """
    return ncclUniqueId.from_bytes(data)


class ncclConfig_t(ctypes.Structure):
    """``ncclConfig_t`` exactly as ``typedef struct ncclConfig_v23100`` of nccl.h 2.32.3.

    NCCL's config is append-only and versioned: NCCL reads ``size`` first and copies at most
    ``min(size, its own sizeof(ncclConfig_t))`` bytes, and resets any field newer than ``version`` to
    its default. So a struct laid out like this header works with older libraries (they ignore the
    tail) and with newer ones (they default what we do not provide). We only ever set the fields up to
    ``blocking``; every other field stays at its "undefined" value (INT_MIN / NULL), so NCCL chooses.
    """

    _fields_ = [
        # attributes that users should never touch.
        ("size", ctypes.c_size_t),  # size_t size;
        ("magic", ctypes.c_uint),  # unsigned int magic;
        ("version", ctypes.c_uint),  # unsigned int version;
        # attributes that users are able to customize.
        ("blocking", ctypes.c_int),  # int blocking;
        ("cgaClusterSize", ctypes.c_int),  # int cgaClusterSize;
        ("minCTAs", ctypes.c_int),  # int minCTAs;
        ("maxCTAs", ctypes.c_int),  # int maxCTAs;
        ("netName", ctypes.c_char_p),  # const char *netName;
        ("splitShare", ctypes.c_int),  # int splitShare;
        ("trafficClass", ctypes.c_int),  # int trafficClass;          (2.24)
        ("commName", ctypes.c_char_p),  # const char *commName;     (2.24)
        ("collnetEnable", ctypes.c_int),  # int collnetEnable;         (2.24)
        ("CTAPolicy", ctypes.c_int),  # int CTAPolicy;             (2.24)
        ("shrinkShare", ctypes.c_int),  # int shrinkShare;           (2.27)
        ("nvlsCTAs", ctypes.c_int),  # int nvlsCTAs;              (2.27)
        ("nChannelsPerNetPeer", ctypes.c_int),  # int nChannelsPerNetPeer;
        ("nvlinkCentricSched", ctypes.c_int),  # int nvlinkCentricSched;
        ("graphUsageMode", ctypes.c_int),  # int graphUsageMode;
        ("numRmaCtx", ctypes.c_int),  # int numRmaCtx;
        ("maxP2pPeers", ctypes.c_int),  # int maxP2pPeers;
        ("graphStreamOrdering", ctypes.c_int),  # int graphStreamOrdering;
        ("launchOrderImplicit", ctypes.c_int),  # int launchOrderImplicit;
        ("numRmaSig", ctypes.c_int),  # int numRmaSig;
        ("rmaEagerInit", ctypes.c_int),  # int rmaEagerInit;
        ("hostCftMode", ctypes.c_int),  # int hostCftMode;
        ("nvlsHostMode", ctypes.c_int),  # int nvlsHostMode;
    ]


def make_config(blocking: bool = True) -> ncclConfig_t:
    """A ``ncclConfig_t`` built like ``NCCL_CONFIG_INITIALIZER``, with ``blocking`` set.

    ``size`` is ``sizeof(ncclConfig_t)``, ``magic`` is ``NCCL_API_MAGIC``, ``version`` is the version
    of the header whose layout we mirror (:data:`HEADER_VERSION_CODE`), every other int is
    ``NCCL_CONFIG_UNDEF_INT`` (INT_MIN) and every pointer NULL.

    Args:
        blocking: ``False`` makes communicator calls non-blocking (they may return ``ncclInProgress``).

    Example:
        >>> cfg = make_config(blocking=False)
        >>> (cfg.size == ctypes.sizeof(ncclConfig_t), hex(cfg.magic), cfg.blocking, cfg.minCTAs)
        (True, '0xcafebeef', 0, -2147483648)
    """
    cfg = ncclConfig_t()
    for field in ncclConfig_t._fields_:
        name, ctype = field[0], field[1]
        if ctype is ctypes.c_int:
            setattr(cfg, name, NCCL_CONFIG_UNDEF_INT)
        elif ctype is ctypes.c_char_p:
            setattr(cfg, name, NCCL_CONFIG_UNDEF_PTR)
    cfg.size = ctypes.sizeof(ncclConfig_t)
    cfg.magic = NCCL_API_MAGIC
    cfg.version = HEADER_VERSION_CODE
    cfg.blocking = 1 if blocking else 0
    return cfg


# --------------------------------------------------------------------------------------------------
# Declarative function table
# --------------------------------------------------------------------------------------------------

_c_int_p = ctypes.POINTER(ctypes.c_int)
_c_void_p_p = ctypes.POINTER(ctypes.c_void_p)
_ncclResult_t = ctypes.c_int  # enum
_ncclComm_t = ctypes.c_void_p  # struct ncclComm*
_cudaStream_t = ctypes.c_void_p  # struct CUstream_st*
_ncclDataType_t = ctypes.c_int  # enum
_ncclRedOp_t = ctypes.c_int  # enum


class _Fn(NamedTuple):
    name: str
    restype: Any
    argtypes: tuple
    since: tuple[int, int, int] | None = None  # None: required; else optional, added in that release


_FUNCTIONS: list[_Fn] = [
    # ncclResult_t ncclGetVersion(int *version);
    _Fn("ncclGetVersion", _ncclResult_t, (_c_int_p,)),
    # ncclResult_t ncclGetUniqueId(ncclUniqueId* uniqueId);
    _Fn("ncclGetUniqueId", _ncclResult_t, (ctypes.POINTER(ncclUniqueId),)),
    # ncclResult_t ncclCommInitRank(ncclComm_t* comm, int nranks, ncclUniqueId commId, int rank);
    _Fn("ncclCommInitRank", _ncclResult_t, (_c_void_p_p, ctypes.c_int, ncclUniqueId, ctypes.c_int)),
    # ncclResult_t ncclCommInitRankConfig(ncclComm_t* comm, int nranks, ncclUniqueId commId, int rank,
    #                                     ncclConfig_t* config);
    _Fn(
        "ncclCommInitRankConfig",
        _ncclResult_t,
        (_c_void_p_p, ctypes.c_int, ncclUniqueId, ctypes.c_int, ctypes.POINTER(ncclConfig_t)),
        (2, 14, 0),
    ),
    # ncclResult_t ncclCommDestroy(ncclComm_t comm);
    _Fn("ncclCommDestroy", _ncclResult_t, (_ncclComm_t,)),
    # ncclResult_t ncclCommFinalize(ncclComm_t comm);
    _Fn("ncclCommFinalize", _ncclResult_t, (_ncclComm_t,), (2, 14, 0)),
    # ncclResult_t ncclCommAbort(ncclComm_t comm);
    _Fn("ncclCommAbort", _ncclResult_t, (_ncclComm_t,)),
    # ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t *asyncError);
    _Fn("ncclCommGetAsyncError", _ncclResult_t, (_ncclComm_t, _c_int_p)),
    # ncclResult_t ncclCommCount(const ncclComm_t comm, int* count);
    _Fn("ncclCommCount", _ncclResult_t, (_ncclComm_t, _c_int_p)),
    # ncclResult_t ncclCommCuDevice(const ncclComm_t comm, int* device);
    _Fn("ncclCommCuDevice", _ncclResult_t, (_ncclComm_t, _c_int_p)),
    # ncclResult_t ncclCommUserRank(const ncclComm_t comm, int* rank);
    _Fn("ncclCommUserRank", _ncclResult_t, (_ncclComm_t, _c_int_p)),
    # ncclResult_t ncclAllReduce(const void* sendbuff, void* recvbuff, size_t count,
    #                            ncclDataType_t datatype, ncclRedOp_t op, ncclComm_t comm,
    #                            cudaStream_t stream);
    _Fn(
        "ncclAllReduce",
        _ncclResult_t,
        (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, _ncclDataType_t, _ncclRedOp_t, _ncclComm_t,
         _cudaStream_t),
    ),
    # ncclResult_t ncclBroadcast(const void* sendbuff, void* recvbuff, size_t count,
    #                            ncclDataType_t datatype, int root, ncclComm_t comm,
    #                            cudaStream_t stream);
    _Fn(
        "ncclBroadcast",
        _ncclResult_t,
        (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, _ncclDataType_t, ctypes.c_int, _ncclComm_t,
         _cudaStream_t),
    ),
    # ncclResult_t ncclReduce(const void* sendbuff, void* recvbuff, size_t count,
    #                         ncclDataType_t datatype, ncclRedOp_t op, int root, ncclComm_t comm,
    #                         cudaStream_t stream);
    _Fn(
        "ncclReduce",
        _ncclResult_t,
        (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, _ncclDataType_t, _ncclRedOp_t, ctypes.c_int,
         _ncclComm_t, _cudaStream_t),
    ),
    # ncclResult_t ncclAllGather(const void* sendbuff, void* recvbuff, size_t sendcount,
    #                            ncclDataType_t datatype, ncclComm_t comm, cudaStream_t stream);
    _Fn(
        "ncclAllGather",
        _ncclResult_t,
        (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, _ncclDataType_t, _ncclComm_t, _cudaStream_t),
    ),
    # ncclResult_t ncclReduceScatter(const void* sendbuff, void* recvbuff, size_t recvcount,
    #                                ncclDataType_t datatype, ncclRedOp_t op, ncclComm_t comm,
    #                                cudaStream_t stream);
    _Fn(
        "ncclReduceScatter",
        _ncclResult_t,
        (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, _ncclDataType_t, _ncclRedOp_t, _ncclComm_t,
         _cudaStream_t),
    ),
    # ncclResult_t ncclSend(const void* sendbuff, size_t count, ncclDataType_t datatype, int peer,
    #                       ncclComm_t comm, cudaStream_t stream);
    _Fn(
        "ncclSend",
        _ncclResult_t,
        (ctypes.c_void_p, ctypes.c_size_t, _ncclDataType_t, ctypes.c_int, _ncclComm_t, _cudaStream_t),
        (2, 7, 0),
    ),
    # ncclResult_t ncclRecv(void* recvbuff, size_t count, ncclDataType_t datatype, int peer,
    #                       ncclComm_t comm, cudaStream_t stream);
    _Fn(
        "ncclRecv",
        _ncclResult_t,
        (ctypes.c_void_p, ctypes.c_size_t, _ncclDataType_t, ctypes.c_int, _ncclComm_t, _cudaStream_t),
        (2, 7, 0),
    ),
    # ncclResult_t ncclGroupStart();
    _Fn("ncclGroupStart", _ncclResult_t, ()),
    # ncclResult_t ncclGroupEnd();
    _Fn("ncclGroupEnd", _ncclResult_t, ()),
    # const char* ncclGetErrorString(ncclResult_t result);
    _Fn("ncclGetErrorString", ctypes.c_char_p, (_ncclResult_t,)),
    # const char* ncclGetLastError(ncclComm_t comm);
    _Fn("ncclGetLastError", ctypes.c_char_p, (_ncclComm_t,), (2, 13, 0)),
]

# --------------------------------------------------------------------------------------------------
# Locating and loading
# --------------------------------------------------------------------------------------------------


class NcclNotFound(ImportError):
    """``libnccl.so.2`` cannot be used: not found, disabled, or not a usable NCCL library.

    The message says what was tried and how to fix it. Callers treat this as "NCCL unavailable".

    Example:
        >>> issubclass(NcclNotFound, ImportError)
        True
    """


_FIX = (
    f"To fix: `pip install nvidia-nccl-cu12` (CUDA 12) or `pip install nvidia-nccl-cu13` (CUDA 13), "
    f"or set {ENV_LIBRARY}=/path/to/{LIBRARY_NAME}, or put NCCL's lib directory on LD_LIBRARY_PATH."
)

def _disabled() -> bool:
    return _config.flag(ENV_DISABLE)  # the one reader of boolean variables (stdlib only, like this module)


def _check_enabled() -> None:
    if _disabled():
        raise NcclNotFound(
            f"NCCL is disabled by {ENV_DISABLE}={_config.as_set(ENV_DISABLE)!r}; "
            f"unset it (or set it to 0) to use NCCL"
        )


def _wheel_source(site_nvidia_dir: str) -> str:
    """Name the wheel that installed ``<site>/nvidia``: look at its ``.dist-info`` directories."""
    site = os.path.dirname(site_nvidia_dir.rstrip(os.sep))
    found = set()
    try:
        for entry in os.listdir(site):
            low = entry.lower()
            for cu in ("cu12", "cu13"):
                if low.startswith(f"nvidia_nccl_{cu}-") and low.endswith(".dist-info"):
                    found.add(cu)
    except OSError:
        pass
    if len(found) == 1:
        return f"nvidia-nccl-{found.pop()} wheel"
    return "nvidia wheel"


def _find_in_wheel(tried: list[str]) -> tuple[str, str] | None:
    # find_spec on the top-level namespace package "nvidia" imports nothing; it only walks sys.path.
    try:
        spec = importlib.util.find_spec("nvidia")
    except (ImportError, ValueError):
        spec = None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        tried.append("the nvidia-nccl-cu12 / nvidia-nccl-cu13 wheel: no 'nvidia' package on sys.path")
        return None
    for loc in locations:
        candidate = os.path.join(loc, "nccl", "lib", LIBRARY_NAME)
        tried.append(candidate)
        if os.path.isfile(candidate):
            return os.path.abspath(candidate), _wheel_source(loc)
    return None


def _find_system(tried: list[str]) -> tuple[str, str] | None:
    tried.append(f"dlopen({LIBRARY_NAME!r}) through the system loader (LD_LIBRARY_PATH, ld.so cache)")
    try:
        _load_cdll(LIBRARY_NAME)
        return LIBRARY_NAME, "system"
    except OSError:
        pass
    tried.append("ctypes.util.find_library('nccl')")
    name = ctypes.util.find_library("nccl")
    if name:
        return name, "system"
    return None


def find_library() -> tuple[str, str]:
    """Locate ``libnccl.so.2``.

    Search order: ``$COLLECTIVES_NCCL_LIBRARY`` (an explicit file path), then the
    ``nvidia-nccl-cu12`` / ``nvidia-nccl-cu13`` wheel (``<site-packages>/nvidia/nccl/lib/``), then the
    system loader.

    Returns:
        ``(path, source)`` where ``source`` is ``"COLLECTIVES_NCCL_LIBRARY"``,
        ``"nvidia-nccl-cu12 wheel"`` / ``"nvidia-nccl-cu13 wheel"`` / ``"nvidia wheel"`` (both or
        neither distribution is recorded) or ``"system"``.

    Raises:
        NcclNotFound: ``COLLECTIVES_DISABLE_NCCL`` is set, ``COLLECTIVES_NCCL_LIBRARY`` names a missing
            file, or nothing was found (the message lists what was tried and how to fix it).

    Example:
        >>> path, source = find_library()        # doctest: +SKIP
        >>> source                               # doctest: +SKIP
        'nvidia-nccl-cu12 wheel'
    """
    _check_enabled()
    explicit = _config.nccl_library()
    if explicit:
        path = os.path.abspath(os.path.expanduser(explicit))
        if os.path.isfile(path):
            return path, ENV_LIBRARY
        what = "is a directory, not a file" if os.path.isdir(path) else "does not exist"
        raise NcclNotFound(
            f"{ENV_LIBRARY}={explicit!r} is set but {path} {what}; point it at the {LIBRARY_NAME} file "
            f"(e.g. .../nvidia/nccl/lib/{LIBRARY_NAME}) or unset it to search the nvidia-nccl wheel and "
            f"the system loader"
        )
    tried: list[str] = []
    hit = _find_in_wheel(tried) or _find_system(tried)
    if hit is not None:
        return hit
    raise NcclNotFound(
        f"cannot find {LIBRARY_NAME} (NCCL). Tried:\n  - " + "\n  - ".join(tried) + "\n" + _FIX
    )


_LOCK = threading.RLock()
_CDLLS: dict[str, ctypes.CDLL] = {}
_LIBRARIES: dict[str, NCCLLibrary] = {}


def _key(path: str) -> str:
    return os.path.realpath(path) if os.sep in path else path


def _load_cdll(path: str) -> ctypes.CDLL:
    """``ctypes.CDLL(path)``, once per (resolved) path. Raises OSError if dlopen fails."""
    key = _key(path)
    with _LOCK:
        cdll = _CDLLS.get(key)
        if cdll is None:
            cdll = ctypes.CDLL(path)
            _CDLLS[key] = cdll
        return cdll


def _count(n: int) -> int:
    n = int(n)
    if n < 0:
        raise ValueError(f"element count must be >= 0; got {n}")
    return n


class NCCLLibrary:
    """One loaded ``libnccl`` and thin, checked wrappers of its C functions.

    Obtain instances through :func:`get` (one per path). Pointers (device buffers, streams,
    communicators) are plain ints; a stream of ``0``/``None`` is CUDA's legacy default stream.

    Every wrapper raises :class:`~collectives.NcclError` when NCCL returns anything but
    ``ncclSuccess``, except that calls which may run non-blocking (communicator init with a config,
    finalize/destroy/abort, collectives, ``ncclGroupEnd``) also accept ``ncclInProgress`` and return
    the status (``0`` or ``7``) for the caller to poll with :meth:`comm_get_async_error`.

    Attributes:
        path: what was passed to dlopen.
        source: where it came from (see :func:`find_library`).
        version: ``ncclGetVersion``'s integer, e.g. ``23203``.
        version_tuple: ``(major, minor, patch)``, e.g. ``(2, 32, 3)``.
        missing: optional C functions this (older) library lacks.

    Example:
        >>> lib = get()                                    # doctest: +SKIP
        >>> lib.version_tuple                              # doctest: +SKIP
        (2, 32, 3)
        >>> lib.error_string(4)                            # doctest: +SKIP
        'invalid argument (run with NCCL_DEBUG=WARN for details)'
    """

    def __init__(self, path: str, source: str = "explicit"):
        try:
            self._lib = _load_cdll(path)
        except OSError as e:
            raise NcclNotFound(f"cannot load {path} ({source}): {e}. {_FIX}") from e
        self.path = path
        self.source = source
        self._fns: dict[str, Any] = {}
        self.missing: list[str] = []
        for entry in _FUNCTIONS:
            try:
                fn = getattr(self._lib, entry.name)
            except AttributeError:
                if entry.since is None:
                    raise NcclNotFound(
                        f"{path} ({source}) has no symbol {entry.name}: not a NCCL 2 library or too old. "
                        f"{_FIX}"
                    ) from None
                self.missing.append(entry.name)
                continue
            fn.restype = entry.restype
            fn.argtypes = list(entry.argtypes)
            self._fns[entry.name] = fn
        self.version = self.get_version()
        self.version_tuple = decode_version(self.version)

    def __repr__(self) -> str:
        v = ".".join(map(str, self.version_tuple))
        return f"<NCCLLibrary {v} from {self.path!r} ({self.source})>"

    # ---- plumbing ----

    def _fn(self, name: str) -> Any:
        fn = self._fns.get(name)
        if fn is None:
            since = next((e.since for e in _FUNCTIONS if e.name == name), None)
            need = f"; it needs NCCL >= {'.'.join(map(str, since))}" if since else ""
            v = ".".join(map(str, getattr(self, "version_tuple", ())))
            raise NcclError(
                ncclInvalidUsage,
                RESULT_NAMES[ncclInvalidUsage],
                f"{name} is not provided by {self.path} (NCCL {v}){need}; upgrade NCCL "
                f"(pip install -U nvidia-nccl-cu12)",
                name,
            )
        return fn

    def error(self, status: int, call: str) -> NcclError:
        """The :class:`NcclError` for ``status`` returned by (or found after) ``call``: its symbolic name,
        NCCL's string for it and NCCL's last error message. The one place an NcclError is made from a
        status (the transport's asynchronous errors come here too)."""
        name = RESULT_NAMES.get(status, f"ncclResult_t({status})")
        detail = self.error_string(status)
        try:
            last = self.last_error()
        except Exception:  # noqa: BLE001 - diagnostics must not mask the real error
            last = ""
        if last:
            detail = f"{detail}; last error: {last}"
        return NcclError(status, name, detail, call)

    def _call(self, name: str, *args: Any, allow_in_progress: bool = False) -> int:
        status = int(self._fn(name)(*args))
        if status == ncclSuccess or (allow_in_progress and status == ncclInProgress):
            return status
        raise self.error(status, name)

    # ---- errors ----

    def error_string(self, status: int) -> str:
        """``ncclGetErrorString(status)``: NCCL's one-line text for a status (never raises)."""
        try:
            raw = self._fns["ncclGetErrorString"](int(status))
        except Exception:  # noqa: BLE001
            raw = None
        if not raw:
            return RESULT_NAMES.get(int(status), f"unknown ncclResult_t {int(status)}")
        return raw.decode("utf-8", "replace")

    def last_error(self) -> str:
        """``ncclGetLastError(NULL)``: the text of the last error NCCL recorded in this process
        (``""`` if none, or if the library predates NCCL 2.13)."""
        fn = self._fns.get("ncclGetLastError")
        if fn is None:
            return ""
        raw = fn(None)
        return raw.decode("utf-8", "replace") if raw else ""

    # ---- library ----

    def get_version(self) -> int:
        """``ncclGetVersion``: e.g. ``23203`` for 2.32.3 (see :func:`decode_version`)."""
        v = ctypes.c_int()
        self._call("ncclGetVersion", ctypes.byref(v))
        return v.value

    def get_unique_id(self) -> bytes:
        """``ncclGetUniqueId``: 128 bytes to send from one rank to all others before
        :meth:`comm_init_rank`. Works without a GPU.

        Example:
            >>> uid = get().get_unique_id()       # doctest: +SKIP
            >>> len(uid)                         # doctest: +SKIP
            128
        """
        uid = ncclUniqueId()
        self._call("ncclGetUniqueId", ctypes.byref(uid))
        return uid.to_bytes()

    # ---- communicators ----

    def comm_init_rank(self, nranks: int, uid: Any, rank: int) -> int:
        """``ncclCommInitRank`` (blocking) on the current CUDA device; returns the ``ncclComm_t``.

        Args:
            nranks: number of ranks in the communicator.
            uid: the 128 bytes of :meth:`get_unique_id` (identical on every rank).
            rank: this process' rank, ``0 <= rank < nranks``.

        Raises:
            NcclError: e.g. ``ncclUnhandledCudaError`` when there is no usable GPU.
        """
        comm = ctypes.c_void_p()
        self._call(
            "ncclCommInitRank", ctypes.byref(comm), int(nranks), ncclUniqueId.from_bytes(uid), int(rank)
        )
        return comm.value or 0

    def comm_init_rank_config(
        self, nranks: int, uid: Any, rank: int, config: ncclConfig_t | None = None
    ) -> int:
        """``ncclCommInitRankConfig``; returns the ``ncclComm_t``.

        With a non-blocking config (``make_config(blocking=False)``) NCCL may return
        ``ncclInProgress``: the handle is valid but initialisation continues in the background; poll
        :meth:`comm_get_async_error` until it is no longer ``ncclInProgress``.
        """
        comm = ctypes.c_void_p()
        cfg = ctypes.byref(config) if config is not None else None
        self._call(
            "ncclCommInitRankConfig",
            ctypes.byref(comm),
            int(nranks),
            ncclUniqueId.from_bytes(uid),
            int(rank),
            cfg,
            allow_in_progress=True,
        )
        return comm.value or 0

    def comm_destroy(self, comm: int) -> int:
        """``ncclCommDestroy``; returns the status (``ncclInProgress`` possible when non-blocking)."""
        return self._call("ncclCommDestroy", comm, allow_in_progress=True)

    def comm_finalize(self, comm: int) -> int:
        """``ncclCommFinalize``: flush outstanding work; returns the status (may be ``ncclInProgress``)."""
        return self._call("ncclCommFinalize", comm, allow_in_progress=True)

    def comm_abort(self, comm: int) -> int:
        """``ncclCommAbort``: free the communicator, abandoning in-flight work; returns the status."""
        return self._call("ncclCommAbort", comm, allow_in_progress=True)

    def comm_get_async_error(self, comm: int) -> int:
        """``ncclCommGetAsyncError``: the communicator's pending status (``0`` ok, ``7`` still in
        progress, anything else a failure). Does not raise on that status; raises only if the query
        itself fails (e.g. a NULL communicator)."""
        return self._int_of("ncclCommGetAsyncError", comm)

    def comm_count(self, comm: int) -> int:
        """``ncclCommCount``: number of ranks."""
        return self._int_of("ncclCommCount", comm)

    def comm_cu_device(self, comm: int) -> int:
        """``ncclCommCuDevice``: the CUDA device index of the communicator."""
        return self._int_of("ncclCommCuDevice", comm)

    def comm_user_rank(self, comm: int) -> int:
        """``ncclCommUserRank``: this process' rank in the communicator."""
        return self._int_of("ncclCommUserRank", comm)

    def _int_of(self, name: str, comm: int) -> int:
        """The ``int`` that the query ``name(comm, int*)`` writes."""
        out = ctypes.c_int()
        self._call(name, comm, ctypes.byref(out))
        return out.value

    # ---- collectives (device pointers and streams as ints; they return the status) ----
    # A negative count would silently wrap to a huge size_t in ctypes: refuse it here.

    def all_reduce(self, sendptr: int, recvptr: int, count: int, datatype: int, op: int, comm: int,
                   stream: int | None) -> int:
        """``ncclAllReduce``; ``sendptr == recvptr`` is in place."""
        return self._call("ncclAllReduce", sendptr, recvptr, _count(count), datatype, op, comm, stream,
                          allow_in_progress=True)

    def broadcast(self, sendptr: int, recvptr: int, count: int, datatype: int, root: int, comm: int,
                  stream: int | None) -> int:
        """``ncclBroadcast``; ``sendptr`` only matters on ``root``."""
        return self._call("ncclBroadcast", sendptr, recvptr, _count(count), datatype, root, comm, stream,
                          allow_in_progress=True)

    def reduce(self, sendptr: int, recvptr: int, count: int, datatype: int, op: int, root: int, comm: int,
               stream: int | None) -> int:
        """``ncclReduce``; ``recvptr`` only matters on ``root``."""
        return self._call("ncclReduce", sendptr, recvptr, _count(count), datatype, op, root, comm, stream,
                          allow_in_progress=True)

    def all_gather(self, sendptr: int, recvptr: int, sendcount: int, datatype: int, comm: int,
                   stream: int | None) -> int:
        """``ncclAllGather``; ``recvptr`` holds ``nranks * sendcount`` elements."""
        return self._call("ncclAllGather", sendptr, recvptr, _count(sendcount), datatype, comm, stream,
                          allow_in_progress=True)

    def reduce_scatter(self, sendptr: int, recvptr: int, recvcount: int, datatype: int, op: int, comm: int,
                       stream: int | None) -> int:
        """``ncclReduceScatter``; ``sendptr`` holds ``nranks * recvcount`` elements."""
        return self._call("ncclReduceScatter", sendptr, recvptr, _count(recvcount), datatype, op, comm,
                          stream, allow_in_progress=True)

    def send(self, sendptr: int, count: int, datatype: int, peer: int, comm: int, stream: int | None) -> int:
        """``ncclSend`` (inside a group, with the matching ``ncclRecv`` on ``peer``)."""
        return self._call("ncclSend", sendptr, _count(count), datatype, peer, comm, stream,
                          allow_in_progress=True)

    def recv(self, recvptr: int, count: int, datatype: int, peer: int, comm: int, stream: int | None) -> int:
        """``ncclRecv`` (inside a group, with the matching ``ncclSend`` on ``peer``)."""
        return self._call("ncclRecv", recvptr, _count(count), datatype, peer, comm, stream,
                          allow_in_progress=True)

    def group_start(self) -> int:
        """``ncclGroupStart``."""
        return self._call("ncclGroupStart")

    def group_end(self) -> int:
        """``ncclGroupEnd``; may return ``ncclInProgress`` for non-blocking communicators."""
        return self._call("ncclGroupEnd", allow_in_progress=True)


def get(path: str | None = None) -> NCCLLibrary:
    """The :class:`NCCLLibrary` for ``path`` (default: :func:`find_library`), loaded once per path.

    Raises:
        NcclNotFound: disabled, not found, or not loadable.

    Example:
        >>> lib = get()                          # doctest: +SKIP
        >>> lib is get()                         # doctest: +SKIP
        True
    """
    _check_enabled()
    if path is None:
        path, source = find_library()
    else:
        source = "explicit"
    key = _key(path)
    with _LOCK:
        lib = _LIBRARIES.get(key)
        if lib is None:
            lib = NCCLLibrary(path, source)
            _LIBRARIES[key] = lib
        return lib


def unique_id(path: str | None = None) -> bytes:
    """A fresh 128-byte NCCL unique id from the default library (``get(path).get_unique_id()``)."""
    return get(path).get_unique_id()


def info(path: str | None = None) -> dict:
    """What NCCL we would use, for diagnostics. Never raises.

    Returns:
        ``{"available": True, "path", "source", "version" ("2.32.3"), "version_code", "missing"}``, or
        ``{"available": False, "error": "..."}`` when NCCL is disabled, missing or unloadable.

    Example:
        >>> info()["available"] in (True, False)
        True
    """
    try:
        lib = get(path)
        return {
            "available": True,
            "path": lib.path,
            "source": lib.source,
            "version": ".".join(map(str, lib.version_tuple)),
            "version_code": lib.version,
            "missing": list(lib.missing),
        }
    except Exception as e:  # noqa: BLE001 - diagnostics never raise
        return {"available": False, "error": f"{type(e).__name__}: {e}"}


# --------------------------------------------------------------------------------------------------
# dtype/op rules for NCCL reductions
# --------------------------------------------------------------------------------------------------

_COMPLEX_PARTS = {"complex64": ncclFloat32, "complex128": ncclFloat64}
# Dtypes NCCL cannot reduce but can move bit for bit as bytes (op=None): name -> itemsize.
_BYTES_ONLY = {"int16": 2, "uint16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1}


def _dtype_name(dtype: Any) -> str:
    if isinstance(dtype, str):
        name = dtype
    elif isinstance(getattr(dtype, "name", None), str):  # numpy.dtype
        name = dtype.name
    else:
        name = str(dtype)
    name = name.strip()
    if name.startswith("torch."):
        name = name[len("torch."):]
    return {"bool_": "bool"}.get(name, name)


def supported_dtype_op(dtype_name: Any, op: str | None) -> tuple[int, int | None, int]:
    """How NCCL performs ``op`` on ``dtype_name``: ``(nccl_dtype, nccl_op, count_multiplier)``.

    The element count handed to NCCL is ``count * count_multiplier``. Rules:

    * int8/uint8/int32/uint32/int64/uint64/float16/bfloat16/float32/float64: native.
    * bool travels as uint8, with ``max`` (any) / ``min`` (all) only.
    * complex64/complex128 travel as pairs of float32/float64, for ``sum`` and ``mean`` only.
    * int16/uint16 are not NCCL types: no reduction.
    * ``mean`` on integers would truncate: refused.
    * ``op=None`` asks for data movement only (broadcast, all_gather): every dtype above, plus
      int16/uint16 and float8, travels bit for bit (``nccl_op`` is then ``None``).

    Args:
        dtype_name: our dtype name (``"float32"``), or a NumPy dtype.
        op: ``"sum"``, ``"prod"``, ``"max"``, ``"min"``, ``"mean"``, or ``None`` for data movement.

    Raises:
        ValueError: unknown ``op``.
        TypeError: the dtype/op pair cannot be done by NCCL (the message says what to do instead).

    Example:
        >>> supported_dtype_op("float32", "sum")
        (7, 0, 1)
        >>> supported_dtype_op("complex64", "mean")
        (7, 4, 2)
        >>> supported_dtype_op("bool", "max")
        (1, 2, 1)
    """
    if op is not None and (not isinstance(op, str) or op not in OP_BY_NAME):
        raise ValueError(f"unknown op={op!r}; expected one of {', '.join(map(repr, OP_BY_NAME))}")
    name = _dtype_name(dtype_name)

    if op is None:  # data movement: bits, not values
        if name == "bool":
            return ncclUint8, None, 1
        if name in _COMPLEX_PARTS:
            return _COMPLEX_PARTS[name], None, 2
        if name in DTYPE_BY_NAME:
            return DTYPE_BY_NAME[name], None, 1
        if name in _BYTES_ONLY:
            return ncclUint8, None, _BYTES_ONLY[name]
        raise TypeError(
            f"dtype {name!r} cannot be moved by NCCL; expected bool, complex64/complex128, int16/uint16, "
            f"float8 or one of {', '.join(DTYPE_BY_NAME)}; view the buffer as uint8 first"
        )

    nccl_op = OP_BY_NAME[op]
    kind = _ops.kind_of(name)
    if kind != "x":  # the library's own rule first, in the host path's words
        _ops.check(kind, name, op)
    if name == "bool":
        return ncclUint8, nccl_op, 1
    if name in _COMPLEX_PARTS:
        if op in ("sum", "mean"):
            return _COMPLEX_PARTS[name], nccl_op, 2
        raise TypeError(
            f"op='prod' on complex dtype {name} is not supported by NCCL (it has no complex type, and "
            f"a complex product is not elementwise over real and imaginary parts); use op='sum' or "
            f"'mean', or reduce on the host"
        )
    if name in ("int16", "uint16"):
        raise TypeError(
            f"dtype {name} is not a NCCL type, so NCCL cannot reduce it (op={op!r}); cast to int32 "
            f"(or float32) first, or use the MPI/host transport"
        )
    if name not in DTYPE_BY_NAME:
        raise TypeError(
            f"op={op!r} needs a numeric dtype NCCL can reduce ({', '.join(DTYPE_BY_NAME)}, bool, complex64, "
            f"complex128); got {name}, which can only be broadcast or gathered bit for bit"
        )
    return DTYPE_BY_NAME[name], nccl_op, 1
