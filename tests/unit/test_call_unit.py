"""The description of a call (``collectives._call``, issue 32) is one-to-one over the whole space of calls.

For every pair of distinct calls drawn from collectives x ops x dtypes x counts x roots, the descriptions
(what the fingerprint beside every non-blocking call carries, and what checked mode compares) differ. The
dtypes are every one the library accepts from NumPy (every builtin type in both byte orders, every datetime
and timedelta unit, strings, bytes and voids of many lengths, structured and sub-array dtypes), torch and
JAX. The dtype's description is reached through the array adapters' ``host_view`` (private: no public name
shows what a call is described as, only the MismatchError a difference raises, tested in
tests/mpi/test_fingerprint.py).
"""

from __future__ import annotations

import itertools
import warnings

import numpy as np
import pytest

from collectives import _arrays, _call, _dtypes

UNITS = ("Y", "M", "W", "D", "h", "m", "s", "ms", "us", "ns", "ps", "fs", "as")


def numpy_dtypes() -> list[np.dtype]:
    out = [np.dtype(t) for t in set(np.sctypeDict.values()) if t is not np.object_]
    out += [np.dtype(f"{k}8[{u}]") for k in "Mm" for u in UNITS]
    out += [np.dtype(f"{k}{n}") for k in "USV" for n in (1, 2, 3, 4, 8, 16, 17, 68)]
    out += [np.dtype([("a", "<i4"), ("b", "<f4")]), np.dtype([("b", "<f4"), ("a", "<i4")]),
            np.dtype([("x", "<f8")]), np.dtype([("a", ">i4"), ("b", "<f4")]), np.dtype(("<f4", (2,))),
            np.dtype(("<i4", (2,))), np.dtype({"names": ["a"], "formats": ["<i4"], "offsets": [4], "itemsize": 8})]
    swapped = [d.newbyteorder() for d in out if d.byteorder not in "|="] + \
              [d.newbyteorder(">") for d in out if d.byteorder == "=" and d.itemsize > 1]
    return list(dict.fromkeys(out + swapped))


def infos() -> dict:
    """Every dtype description the library makes, keyed by a readable name of where it came from."""
    found = {}
    for d in numpy_dtypes():
        try:
            found[f"numpy {d.str} {d}"] = _dtypes.from_numpy(d)
        except TypeError:  # object: refused, never described
            pass
    try:
        import torch
    except ImportError:
        torch = None
    if torch is not None:
        for name in dir(torch):
            dt = getattr(torch, name)
            if not isinstance(dt, torch.dtype):
                continue
            try:
                with warnings.catch_warnings():  # complex32, the quantized dtypes: experimental, deprecated
                    warnings.simplefilter("ignore")
                    t = torch.zeros(2, dtype=dt)
                found[f"torch {name}"] = _arrays.adapter(t).host_view(t)[1]
            except (TypeError, RuntimeError, ValueError):  # a dtype the library refuses (quantized, ...)
                continue
    try:
        import ml_dtypes
    except ImportError:
        ml_dtypes = None
    if ml_dtypes is not None:
        for name in ("bfloat16", "float8_e4m3fn", "float8_e5m2", "float8_e4m3b11fnuz", "int4", "uint4"):
            if hasattr(ml_dtypes, name):
                found[f"jax {name}"] = _dtypes.from_numpy(np.dtype(getattr(ml_dtypes, name)))
    return found


def test_distinct_dtypes_have_distinct_codes():
    table = infos()
    assert len(table) > 150, len(table)  # the space is really drawn
    by_info: dict = {}
    for where, info in table.items():
        by_info.setdefault(info, []).append(where)
    codes: dict = {}
    for info, wheres in by_info.items():
        code = _call.dtype_code(info)
        assert 0 < code < 2**62
        assert code not in codes, f"{wheres} and {codes.get(code)} share a code"
        codes[code] = wheres
    # the same dtype from two libraries is one description (the same bytes mean the same values)
    if "torch float32" in table:
        assert table["torch float32"] == table["numpy <f4 float32"]
    if "torch bfloat16" in table and "jax bfloat16" in table:
        assert table["torch bfloat16"] == table["jax bfloat16"]


def test_the_regressions_of_issue_32_are_distinct():
    code = lambda s: _call.dtype_code(_dtypes.from_numpy(np.dtype(s)))
    for a, b in (("<U17", "V4"), ("<i4", ">i4"), ("datetime64[s]", "datetime64[ns]"), ("float32", "int32"),
                 ("bool", "uint8"), ("float16", "int16"), ("<m8[s]", "<M8[s]")):
        assert code(a) != code(b), (a, b)
    assert _call.dtype_code(_dtypes.bfloat16()) != code("float32")
    assert _call.dtype_code(_dtypes.bfloat16()) != code("uint16")


def test_distinct_calls_have_distinct_descriptions():
    table = infos()
    dtypes = list(dict.fromkeys(table.values()))
    ops = [None, *_call.OPS]
    counts = [0, 1, 2, 3, 4, 8, 2**31, 2**40]
    roots = [-1, 0, 1, 2, 7]
    seen: dict = {}
    for collective, op, info, count, root in itertools.product(_call.COLLECTIVES, ops, dtypes, counts, roots):
        d = _call.describe(collective, op, info, count, root)
        assert len(d) == len(_call.FIELDS)
        key = (collective, op, info, count, root)
        assert seen.setdefault(d, key) == key, f"{key} and {seen[d]} are described alike"
    assert len(seen) == len(_call.COLLECTIVES) * len(ops) * len(dtypes) * len(counts) * len(roots)


def test_a_front_ends_naming_changes_the_op_and_structure_only():
    f32 = _dtypes.from_numpy(np.dtype(np.float32))
    plain = _call.describe("allreduce", "sum", f32, 4)
    with _call.naming("avg"):
        avg = _call.describe("allreduce", "sum", f32, 4)
        assert _call.describe("broadcast", None, f32, 4, 0) == _call.describe("broadcast", None, f32, 4, 0)
    with _call.naming(structure=_call.structure_code("bucket", 0)):
        bucket = _call.describe("allreduce", "sum", f32, 4)
    assert avg != plain and bucket != plain and avg != bucket
    assert [a != b for a, b in zip(avg, plain, strict=True)] == [f == "op" for f in _call.FIELDS]
    assert [a != b for a, b in zip(bucket, plain, strict=True)] == [f == "structure" for f in _call.FIELDS]
    assert _call.naming_now() == (None, 0)


@pytest.mark.parametrize("field", _call.FIELDS)
def test_render_names_every_field(field):
    f32 = _dtypes.from_numpy(np.dtype(np.float32))
    d = dict(zip(_call.FIELDS, _call.describe("reduce", "mean", f32, 4, 1), strict=True))
    text = _call.render(field, d[field])
    assert text == {"collective": "reduce", "op": "mean", "dtype": "float32", "structure": "a single array",
                    "root": "1", "count": "4"}[field]


def test_a_fingerprint_with_values_no_rank_sends_is_still_a_mismatch_error():
    """A reduced fingerprint whose fields no rank sent (Open MPI read a rank's freed buffer in stop 57's CI:
    the first two fields were heap pointers) raises MismatchError and fails the transport, on every rank
    alike; describing it once raised an IndexError instead, which left the transport usable, so that closing
    the communicator hung in a collective the others never entered. Private names: no public call makes MPI
    deliver a corrupted fingerprint (the MPI test that provoked it: test_async.py's shared-memory deadline)."""
    from collectives import MismatchError
    from collectives._backends._fingerprint import FIELDS, collective_text
    from collectives._backends.mpi.lanes import LaneMaking

    n = len(FIELDS)
    mine = np.zeros(2 * n, dtype=np.int64)
    mine[:n] = (0, 0, 0, 0, -1, 8) + (0, 8, 1, 0, -1)
    mine[n:] = -mine[:n]
    reduced = mine.copy()
    reduced[:2] = (94356083714240, 139940652326256)  # what glibc writes into a freed chunk: two pointers
    assert collective_text(94356083714240) == "94356083714240"  # past the lanes' codes: the number itself

    class Transport:
        rank, size, failed = 1, 3, None

        def fail(self, reason):
            self.failed = reason

    t = Transport()
    with pytest.raises(MismatchError) as err:
        LaneMaking._verify(t, (reduced, mine.tobytes()), ("allreduce", np.zeros(8), "op=sum"))
    assert t.failed == str(err.value)
    LaneMaking._verify(t, (mine.copy(), mine.tobytes()), ("allreduce", np.zeros(8), "op=sum"))  # agreeing: nothing
