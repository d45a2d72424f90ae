"""The ctypes binding of libnccl, without a GPU: loading, errors, enums against the installed nccl.h.

Everything here runs in one process with no MPI and no CUDA device. The one call that touches CUDA
(communicator init) runs in a subprocess so that a crash inside libnccl cannot take pytest down.
The header tests parse the wheel's own ``nccl.h``, so a new NCCL cannot silently drift from the
binding's enum values, function arities or ``ncclConfig_t`` layout.
"""

from __future__ import annotations

import ctypes
import glob
import importlib
import importlib.util
import os
import pickle
import re
import subprocess
import sys
import textwrap
import types

import pytest

SRC = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, "src"))

# Import the module normally; should the package's __init__ be unimportable (or mid-edit), load the
# module under a bare stub package so its own behaviour is still tested.
def _import_code(force_stub: bool = False) -> str:
    stub = textwrap.dedent(
        f"""
        for k in [k for k in sys.modules if k == "collectives" or k.startswith("collectives.")]:
            del sys.modules[k]
        pkg = types.ModuleType("collectives")
        pkg.__path__ = [{os.path.join(SRC, "collectives")!r}]
        sys.modules["collectives"] = pkg
        import collectives._backends._libnccl as m
        """
    )
    if force_stub:
        return "import sys, types\n" + stub
    return (
        "import sys, types\ntry:\n    import collectives._backends._libnccl as m\nexcept Exception:\n"
        + textwrap.indent(stub, "    ")
    )


def _import_binding() -> types.ModuleType:
    if SRC not in sys.path:
        sys.path.insert(0, SRC)
    try:
        return importlib.import_module("collectives._backends._libnccl")
    except Exception:  # noqa: BLE001 - any import failure: retried below with a clean module table
        saved = {k: v for k, v in sys.modules.items() if k == "collectives" or k.startswith("collectives.")}
        for k in saved:
            del sys.modules[k]
        pkg = types.ModuleType("collectives")
        pkg.__path__ = [os.path.join(SRC, "collectives")]
        sys.modules["collectives"] = pkg
        try:
            return importlib.import_module("collectives._backends._libnccl")
        finally:  # do not leave the stub around for other test modules
            for k in [k for k in sys.modules if k == "collectives" or k.startswith("collectives.")]:
                del sys.modules[k]
            sys.modules.update(saved)


m = _import_binding()

try:
    _FOUND_PATH, _FOUND_SOURCE = m.find_library()
except m.NcclNotFound as _e:
    pytest.skip(f"no NCCL library available: {_e}", allow_module_level=True)


def _wheel_lib_path() -> str | None:
    spec = importlib.util.find_spec("nvidia")
    for loc in list(spec.submodule_search_locations or []) if spec else []:
        p = os.path.join(loc, "nccl", "lib", "libnccl.so.2")
        if os.path.isfile(p):
            return p
    return None


def _header_path() -> str | None:
    candidates = []
    if os.sep in _FOUND_PATH:
        candidates.append(os.path.join(os.path.dirname(os.path.dirname(_FOUND_PATH)), "include", "nccl.h"))
    spec = importlib.util.find_spec("nvidia")
    for loc in list(spec.submodule_search_locations or []) if spec else []:
        candidates.append(os.path.join(loc, "nccl", "include", "nccl.h"))
    return next((c for c in candidates if os.path.isfile(c)), None)


WHEEL_LIB = _wheel_lib_path()
HEADER = _header_path()
needs_header = pytest.mark.skipif(
    HEADER is None, reason="no nccl.h found next to the library or in the wheel"
)


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    monkeypatch.delenv(m.ENV_LIBRARY, raising=False)
    monkeypatch.delenv(m.ENV_DISABLE, raising=False)


@pytest.fixture(scope="module")
def lib():
    return m.get()


def _subprocess_env() -> dict:
    env = dict(os.environ)
    env.pop(m.ENV_DISABLE, None)
    env["PYTHONPATH"] = SRC + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


# ---------------------------------------------------------------------------------------------------
# header parsing
# ---------------------------------------------------------------------------------------------------


def _header_text() -> str:
    with open(HEADER, encoding="utf-8", errors="replace") as f:
        return f.read()


def _strip_comments(text: str) -> str:
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    return re.sub(r"//[^\n]*", " ", text)


def _parse_int(expr: str) -> int | None:
    expr = expr.strip()
    if re.fullmatch(r"-?\s*(0[xX][0-9a-fA-F]+|\d+)[uUlL]*", expr):
        return int(expr.rstrip("uUlL").replace(" ", ""), 0)
    return None  # an expression (e.g. ncclMaxRedOp, NCCL_CONFIG_UNDEF_INT): not compared


def _parse_enum(typename: str) -> dict[str, int]:
    """``typedef enum { a = 0, b, c = 5 } typename;`` -> {name: value} (literal or implicit values)."""
    text = _strip_comments(_header_text())
    match = re.search(r"typedef\s+enum\s*\{([^{}]*)\}\s*" + re.escape(typename) + r"\s*;", text)
    assert match, f"enum {typename} not found in {HEADER}"
    values: dict[str, int] = {}
    prev: int | None = -1
    for item in match.group(1).split(","):
        item = item.strip()
        if not item:
            continue
        name, _, expr = item.partition("=")
        name = name.strip()
        if expr:
            value = _parse_int(expr)
            if value is None and expr.strip() in values:
                value = values[expr.strip()]
        else:
            value = prev + 1 if prev is not None else None
        prev = value
        if value is not None:
            values[name] = value
    assert values, f"parsed no values from enum {typename}"
    return values


def _parse_define(name: str) -> int:
    match = re.search(r"#define\s+" + name + r"\s+(\S+)", _header_text())
    assert match, f"#define {name} not in {HEADER}"
    value = _parse_int(match.group(1))
    assert value is not None
    return value


def _parse_config_struct() -> list[tuple[str, str]]:
    """``typedef struct ncclConfig_vNNNNN { ... } ncclConfig_t;`` -> [(field, kind)] in order."""
    text = _strip_comments(_header_text())
    match = re.search(r"typedef\s+struct\s+ncclConfig_v\d+\s*\{(.*?)\}\s*ncclConfig_t\s*;", text, re.S)
    assert match, f"ncclConfig_t not found in {HEADER}"
    fields = []
    for decl in match.group(1).split(";"):
        decl = " ".join(decl.split())
        if not decl:
            continue
        parsed = re.fullmatch(r"(?P<type>[\w ]+?)\s*(?P<ptr>\*+)?\s*(?P<name>\w+)", decl)
        assert parsed, f"cannot parse ncclConfig_t member {decl!r}"
        ctype = parsed.group("type").replace("const ", "").strip()
        if parsed.group("ptr"):
            kind = "pointer"
        elif ctype in ("size_t", "unsigned int", "int"):
            kind = ctype
        else:
            raise AssertionError(f"ncclConfig_t member {decl!r} has a type this test does not know")
        fields.append((parsed.group("name"), kind))
    return fields


_KIND_OF_CTYPE = {
    ctypes.c_size_t: "size_t",
    ctypes.c_uint: "unsigned int",
    ctypes.c_int: "int",
    ctypes.c_char_p: "pointer",
    ctypes.c_void_p: "pointer",
}
_CTYPE_OF_KIND = {"size_t": ctypes.c_size_t, "unsigned int": ctypes.c_uint, "int": ctypes.c_int,
                  "pointer": ctypes.c_void_p}


# ---------------------------------------------------------------------------------------------------
# loading
# ---------------------------------------------------------------------------------------------------


@pytest.mark.skipif(WHEEL_LIB is None, reason="the nvidia-nccl wheel is not installed")
def test_loads_from_the_wheel(lib):
    path, source = m.find_library()
    assert os.path.samefile(path, WHEEL_LIB)
    assert "wheel" in source
    assert os.path.samefile(lib.path, WHEEL_LIB)
    assert "wheel" in lib.source
    if glob.glob(os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(WHEEL_LIB))),
                              "nvidia_nccl_cu12-*.dist-info")):
        assert source in ("nvidia-nccl-cu12 wheel", "nvidia wheel")


def test_get_is_cached_per_path(lib):
    assert m.get() is lib
    assert m.get(lib.path) is lib


def test_version(lib):
    assert lib.version == lib.get_version()
    assert lib.version_tuple == m.decode_version(lib.version)
    assert m.nccl_version_code(*lib.version_tuple) == lib.version
    assert lib.version_tuple >= (2, 18, 0)
    assert lib.missing == []  # every optional function exists in a >= 2.18 library


def test_version_codec():
    assert m.decode_version(23203) == (2, 32, 3)
    assert m.decode_version(21805) == (2, 18, 5)
    assert m.decode_version(2804) == (2, 8, 4)  # pre-2.9 encoding
    assert m.nccl_version_code(2, 8, 4) == 2804
    assert m.nccl_version_code(2, 9, 6) == 20906


def test_info(lib):
    d = m.info()
    assert d["available"] is True
    assert d["path"] == lib.path and d["source"] == lib.source
    assert d["version"] == ".".join(map(str, lib.version_tuple))
    assert "error" not in d


def test_unique_id(lib):
    a, b = lib.get_unique_id(), lib.get_unique_id()
    assert isinstance(a, bytes) and len(a) == 128
    assert len(b) == 128 and a != b
    uid = m.unique_id_from_bytes(a)
    assert isinstance(uid, m.ncclUniqueId)
    assert ctypes.sizeof(uid) == 128
    assert m.unique_id_to_bytes(uid) == a
    assert len(m.unique_id()) == 128


def test_unique_id_round_trip_keeps_nul_bytes():
    raw = bytes(128)[:5] + b"\x07" + bytes(122)  # NULs before and after data
    assert m.unique_id_from_bytes(raw).to_bytes() == raw
    with pytest.raises(ValueError, match="128 bytes"):
        m.unique_id_from_bytes(b"x" * 127)
    with pytest.raises(TypeError, match="128 bytes"):
        m.unique_id_from_bytes("x" * 128)


def test_error_string_maps_every_status(lib):
    texts = {}
    for status, name in m.RESULT_NAMES.items():
        text = lib.error_string(status)
        assert isinstance(text, str) and text, (status, name)
        texts[status] = text
    assert texts[m.ncclSuccess] == "no error"
    assert len(set(texts.values())) == len(texts), "two statuses share a message"
    assert "progress" in texts[m.ncclInProgress].lower()
    assert isinstance(lib.error_string(12345), str)  # unknown codes do not raise
    assert isinstance(lib.last_error(), str)


def test_failing_call_raises_nccl_error(lib):
    with pytest.raises(m.NcclError) as info:
        lib.comm_count(0)  # a NULL communicator: NCCL checks it and returns ncclInvalidArgument
    err = info.value
    assert err.status == m.ncclInvalidArgument == 4
    assert err.name == "ncclInvalidArgument"
    assert err.call == "ncclCommCount"
    assert err.detail.startswith(lib.error_string(m.ncclInvalidArgument))
    assert "last error:" in err.detail and "NULL" in err.detail
    assert "ncclCommCount" in str(err) and "ncclInvalidArgument" in str(err)
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is type(err)
    assert (back.status, back.name, back.detail, back.call) == (err.status, err.name, err.detail, err.call)
    assert str(back) == str(err)


def test_null_arguments_are_errors_not_crashes(lib):
    for call in (lambda: lib.comm_user_rank(0), lambda: lib.comm_cu_device(0),
                 lambda: lib.comm_get_async_error(0),
                 lambda: lib.all_reduce(0, 0, 1, m.ncclFloat32, m.ncclSum, 0, 0)):
        with pytest.raises(m.NcclError) as info:
            call()
        assert info.value.status == m.ncclInvalidArgument
    assert lib.comm_destroy(0) == m.ncclSuccess  # destroying NULL is a no-op in NCCL
    with pytest.raises(ValueError, match=">= 0"):
        lib.all_reduce(0, 0, -1, m.ncclFloat32, m.ncclSum, 0, 0)


def test_group_start_end(lib):
    assert lib.group_start() == m.ncclSuccess
    assert lib.group_end() == m.ncclSuccess


def test_explicit_library_path_missing(monkeypatch, tmp_path):
    missing = tmp_path / "nowhere" / "libnccl.so.2"
    monkeypatch.setenv(m.ENV_LIBRARY, str(missing))
    with pytest.raises(m.NcclNotFound) as info:
        m.find_library()
    msg = str(info.value)
    assert m.ENV_LIBRARY in msg and str(missing) in msg and "does not exist" in msg
    with pytest.raises(ImportError):
        m.get()
    assert "does not exist" in m.info()["error"]


def test_explicit_library_path_used(monkeypatch, lib):
    monkeypatch.setenv(m.ENV_LIBRARY, lib.path)
    path, source = m.find_library()
    assert os.path.samefile(path, lib.path) and source == m.ENV_LIBRARY


def test_explicit_library_not_nccl(monkeypatch, tmp_path):
    junk = tmp_path / "libnccl.so.2"
    junk.write_bytes(b"not an ELF file")
    monkeypatch.setenv(m.ENV_LIBRARY, str(junk))
    with pytest.raises(m.NcclNotFound, match="cannot load"):
        m.get()


def test_disable_refuses_to_load(monkeypatch):
    monkeypatch.setenv(m.ENV_DISABLE, "1")
    with pytest.raises(m.NcclNotFound, match=m.ENV_DISABLE):
        m.find_library()
    with pytest.raises(m.NcclNotFound, match=m.ENV_DISABLE):
        m.get()  # even though a library is already cached
    d = m.info()
    assert d["available"] is False and m.ENV_DISABLE in d["error"]
    monkeypatch.setenv(m.ENV_DISABLE, "0")
    m.find_library()
    monkeypatch.setenv(m.ENV_DISABLE, "perhaps")
    with pytest.raises(ValueError, match=m.ENV_DISABLE):
        m.find_library()


def test_not_found_message_says_what_to_do(monkeypatch):
    monkeypatch.setattr(m, "_find_in_wheel", lambda tried: tried.append("<wheel>") or None)
    monkeypatch.setattr(m, "_find_system", lambda tried: tried.append("<system>") or None)
    with pytest.raises(m.NcclNotFound) as info:
        m.find_library()
    msg = str(info.value)
    assert "<wheel>" in msg and "<system>" in msg
    assert "pip install nvidia-nccl-cu12" in msg and m.ENV_LIBRARY in msg


def test_imports_no_array_library_or_mpi():
    # The stub package keeps collectives/__init__ (which may import NumPy) out of the picture: this checks
    # the binding module itself.
    code = _import_code(force_stub=True) + textwrap.dedent(
        """
        m.get()
        bad = [k for k in ("numpy", "torch", "cupy", "jax", "mpi4py") if k in sys.modules]
        assert not bad, bad
        print("CLEAN")
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env=_subprocess_env())
    assert proc.returncode == 0 and "CLEAN" in proc.stdout, proc.stdout + proc.stderr


# ---------------------------------------------------------------------------------------------------
# communicator init without a GPU (in a subprocess: a crash must not kill pytest)
# ---------------------------------------------------------------------------------------------------


def _has_gpu() -> bool:
    return bool(glob.glob("/dev/nvidia[0-9]*"))


def test_comm_init_without_gpu_raises_nccl_error():
    code = _import_code() + textwrap.dedent(
        """
        lib = m.get()
        uid = lib.get_unique_id()
        for label, init in (("plain", lambda: lib.comm_init_rank(1, uid, 0)),
                            ("config", lambda: lib.comm_init_rank_config(1, uid, 0, m.make_config(True)))):
            try:
                comm = init()
            except m.NcclError as e:
                print("NCCLERROR", label, e.status, e.name, e.call, flush=True)
                print("DETAIL", label, e.detail.replace("\\n", " "), flush=True)
            else:
                print("INITIALIZED", label, lib.comm_count(comm), flush=True)
                lib.comm_destroy(comm)
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env=_subprocess_env())
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"the subprocess died (rc={proc.returncode}):\n{out}"
    for label in ("plain", "config"):
        lines = [ln.split() for ln in proc.stdout.splitlines() if ln.split()[1:2] == [label]]
        kinds = [ln[0] for ln in lines]
        if "INITIALIZED" in kinds:  # a machine with a GPU: one-rank init works
            assert _has_gpu(), out
            continue
        assert "NCCLERROR" in kinds, out
        _, _, status, name, call = next(ln for ln in lines if ln[0] == "NCCLERROR")
        status = int(status)
        assert status != m.ncclSuccess and m.RESULT_NAMES[status] == name, out
        assert call == ("ncclCommInitRank" if label == "plain" else "ncclCommInitRankConfig")
        if not _has_gpu():
            assert status in (m.ncclUnhandledCudaError, m.ncclSystemError, m.ncclInternalError,
                              m.ncclInvalidUsage), out


# ---------------------------------------------------------------------------------------------------
# the binding against the installed nccl.h
# ---------------------------------------------------------------------------------------------------


@needs_header
def test_result_enum_matches_header():
    header = _parse_enum("ncclResult_t")
    assert "ncclSuccess" in header and "ncclInProgress" in header
    for name, value in header.items():
        assert getattr(m, name) == value, name
    expected = {v: k for k, v in header.items() if k != "ncclNumResults"}
    assert expected == m.RESULT_NAMES


@needs_header
def test_redop_enum_matches_header():
    header = _parse_enum("ncclRedOp_t")  # not ncclRedOp_dummy_t; ncclMaxRedOp is an expression
    assert "ncclNumOps_dummy" not in header and "ncclMaxRedOp" not in header
    for name, value in header.items():
        assert getattr(m, name) == value, name
    assert {v: k for k, v in header.items() if v < header["ncclNumOps"]} == m.REDOP_NAMES
    assert {"sum": header["ncclSum"], "prod": header["ncclProd"], "max": header["ncclMax"],
                            "min": header["ncclMin"], "mean": header["ncclAvg"]} == m.OP_BY_NAME


@needs_header
def test_datatype_enum_matches_header():
    header = _parse_enum("ncclDataType_t")
    for name in ("ncclInt8", "ncclChar", "ncclInt", "ncclHalf", "ncclFloat", "ncclDouble", "ncclBfloat16"):
        assert name in header
    for name, value in header.items():
        assert getattr(m, name) == value, name
    values = {v for k, v in header.items() if k != "ncclNumTypes"}
    assert set(m.DATATYPE_NAMES) == values
    for value, name in m.DATATYPE_NAMES.items():
        assert header[name] == value
    expected = {"int8": "ncclInt8", "uint8": "ncclUint8", "int32": "ncclInt32", "uint32": "ncclUint32",
                "int64": "ncclInt64", "uint64": "ncclUint64", "float16": "ncclFloat16",
                "float32": "ncclFloat32", "float64": "ncclFloat64", "bfloat16": "ncclBfloat16"}
    assert {k: header[v] for k, v in expected.items()} == m.DTYPE_BY_NAME


@needs_header
def test_defines_match_header():
    assert _parse_define("NCCL_API_MAGIC") == m.NCCL_API_MAGIC
    assert _parse_define("NCCL_UNIQUE_ID_BYTES") == m.NCCL_UNIQUE_ID_BYTES == ctypes.sizeof(m.ncclUniqueId)
    assert "#define NCCL_CONFIG_UNDEF_INT INT_MIN" in _header_text()
    assert m.NCCL_CONFIG_UNDEF_INT == -(2**31)
    code = _parse_define("NCCL_VERSION_CODE")
    assert m.nccl_version_code(_parse_define("NCCL_MAJOR"), _parse_define("NCCL_MINOR"),
                               _parse_define("NCCL_PATCH")) == code


@needs_header
def test_config_struct_matches_header():
    header_fields = _parse_config_struct()
    ours = [(name, _KIND_OF_CTYPE[ctype]) for name, ctype in m.ncclConfig_t._fields_]
    assert ours == header_fields, "ncclConfig_t drifted from nccl.h: update the binding"

    class Expected(ctypes.Structure):
        _fields_ = [(name, _CTYPE_OF_KIND[kind]) for name, kind in header_fields]

    assert ctypes.sizeof(m.ncclConfig_t) == ctypes.sizeof(Expected)
    for name, _ in header_fields:
        assert getattr(m.ncclConfig_t, name).offset == getattr(Expected, name).offset, name


@needs_header
def test_config_initializer_order_matches_header():
    text = _header_text()
    match = re.search(r"#define\s+NCCL_CONFIG_INITIALIZER\s*\{(.*?)\n\}", text, re.S)
    assert match
    names = re.findall(r"/\*\s*(\w+)\s*\*/", match.group(1))
    assert names == [name for name, _ in m.ncclConfig_t._fields_]


def test_make_config():
    for blocking in (True, False):
        cfg = m.make_config(blocking=blocking)
        assert cfg.size == ctypes.sizeof(m.ncclConfig_t)
        assert cfg.magic == 0xCAFEBEEF
        assert cfg.version == m.HEADER_VERSION_CODE
        assert cfg.blocking == (1 if blocking else 0)
        for name, ctype in m.ncclConfig_t._fields_[4:]:
            value = getattr(cfg, name)
            if ctype is ctypes.c_int:
                assert value == -(2**31), name
            else:
                assert value is None, name


@needs_header
def test_function_table_matches_header_prototypes():
    text = _strip_comments(_header_text())
    wanted = {"ncclGetVersion", "ncclGetUniqueId", "ncclCommInitRank", "ncclCommInitRankConfig",
              "ncclCommDestroy", "ncclCommFinalize", "ncclCommAbort", "ncclCommGetAsyncError",
              "ncclCommCount", "ncclCommCuDevice", "ncclCommUserRank", "ncclAllReduce", "ncclBroadcast",
              "ncclReduce", "ncclAllGather", "ncclReduceScatter", "ncclSend", "ncclRecv", "ncclGroupStart", "ncclGroupEnd",
              "ncclGetErrorString", "ncclGetLastError"}
    assert {e.name for e in m._FUNCTIONS} == wanted
    for entry in m._FUNCTIONS:
        proto = re.search(r"(ncclResult_t|const\s+char\s*\*)\s+" + entry.name + r"\s*\(([^)]*)\)\s*;", text)
        assert proto, f"{entry.name} has no prototype in {HEADER}"
        params = [p for p in (x.strip() for x in proto.group(2).split(",")) if p and p != "void"]
        assert len(params) == len(entry.argtypes), entry.name
        expected_restype = ctypes.c_int if proto.group(1) == "ncclResult_t" else ctypes.c_char_p
        assert entry.restype is expected_restype, entry.name
        for param, argtype in zip(params, entry.argtypes):
            if param.split()[0] == "ncclUniqueId" and "*" not in param:
                assert argtype is m.ncclUniqueId, (entry.name, param)  # passed by value
            elif "*" in param or "ncclComm_t" in param or "cudaStream_t" in param:
                assert argtype is ctypes.c_void_p or issubclass(argtype, ctypes._Pointer), (entry.name, param)
            elif param.startswith("size_t"):
                assert argtype is ctypes.c_size_t, (entry.name, param)
            else:  # int and enums
                assert argtype is ctypes.c_int, (entry.name, param)


# ---------------------------------------------------------------------------------------------------
# dtype/op rules
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["int8", "uint8", "int32", "uint32", "int64", "uint64"])
@pytest.mark.parametrize("op", ["sum", "prod", "max", "min"])
def test_integers_native(name, op):
    assert m.supported_dtype_op(name, op) == (m.DTYPE_BY_NAME[name], m.OP_BY_NAME[op], 1)


@pytest.mark.parametrize("name", ["float16", "bfloat16", "float32", "float64"])
@pytest.mark.parametrize("op", ["sum", "prod", "max", "min", "mean"])
def test_floats_native(name, op):
    assert m.supported_dtype_op(name, op) == (m.DTYPE_BY_NAME[name], m.OP_BY_NAME[op], 1)


def test_mean_is_avg():
    assert m.supported_dtype_op("float32", "mean")[1] == m.ncclAvg


@pytest.mark.parametrize("name", ["int8", "uint8", "int32", "uint32", "int64", "uint64"])
def test_integer_mean_refused(name):
    with pytest.raises(TypeError, match="would truncate.*cast to a floating dtype"):
        m.supported_dtype_op(name, "mean")


def test_bool_as_uint8_max_min_only():
    assert m.supported_dtype_op("bool", "max") == (m.ncclUint8, m.ncclMax, 1)
    assert m.supported_dtype_op("bool", "min") == (m.ncclUint8, m.ncclMin, 1)
    for op in ("sum", "prod", "mean"):
        with pytest.raises(TypeError, match="bool.*op='max'"):
            m.supported_dtype_op("bool", op)


@pytest.mark.parametrize("name,part", [("complex64", "ncclFloat32"), ("complex128", "ncclFloat64")])
def test_complex_as_pairs_sum_mean_only(name, part):
    assert m.supported_dtype_op(name, "sum") == (getattr(m, part), m.ncclSum, 2)
    assert m.supported_dtype_op(name, "mean") == (getattr(m, part), m.ncclAvg, 2)
    for op in ("prod", "min", "max"):
        with pytest.raises(TypeError, match=name):
            m.supported_dtype_op(name, op)


@pytest.mark.parametrize("name", ["int16", "uint16"])
@pytest.mark.parametrize("op", ["sum", "prod", "max", "min", "mean"])
def test_int16_not_nccl(name, op):
    # an illegal pair anywhere (mean on integers) gets the library's own words first, as on the host
    match = "would truncate" if op == "mean" else f"{name} is not a NCCL type.*cast to int32"
    with pytest.raises(TypeError, match=match):
        m.supported_dtype_op(name, op)


def test_unknown_op_and_dtype():
    for op in ("avg", "SUM", "", 0):
        with pytest.raises(ValueError, match="unknown op"):
            m.supported_dtype_op("float32", op)
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        m.supported_dtype_op("float8_e4m3fn", "sum")
    with pytest.raises(TypeError, match="str"):
        m.supported_dtype_op("str", "sum")


def test_data_movement_op_none():
    assert m.supported_dtype_op("float32", None) == (m.ncclFloat32, None, 1)
    assert m.supported_dtype_op("bool", None) == (m.ncclUint8, None, 1)
    assert m.supported_dtype_op("complex128", None) == (m.ncclFloat64, None, 2)
    assert m.supported_dtype_op("int16", None) == (m.ncclUint8, None, 2)
    with pytest.raises(TypeError):
        m.supported_dtype_op("object", None)


def test_dtype_objects_accepted():
    class FakeDtype:  # anything with a .name, like numpy.dtype
        name = "float64"

    assert m.supported_dtype_op(FakeDtype(), "sum") == (m.ncclFloat64, m.ncclSum, 1)
    assert m.supported_dtype_op("torch.bfloat16", "max") == (m.ncclBfloat16, m.ncclMax, 1)
