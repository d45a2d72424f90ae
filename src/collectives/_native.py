"""The package's compiled passes (``_kernels.c``), loaded once with ctypes: plain C, no Python API.

Optional: setuptools builds the library where a C compiler works (``setup.py``); where it is missing,
:func:`library` is None and every caller runs its NumPy passes instead, with the same bits. Two users:
the reproducible sums of float32 terms (``_reproducible``) and the node-shared window's slice of an
ordinary float32 or float64 sum or mean (:func:`adder`, ``_backends/shm.py``).

Example:
    >>> import numpy as np
    >>> from collectives import _native
    >>> add = _native.adder(np.dtype(np.float32))  # None where the package was built without it
    >>> a, b = np.array([1, 2], np.float32), np.array([3, 5], np.float32)
    >>> res, out = np.empty(2, np.float32), np.empty(2, np.float32)
    >>> if add is not None:
    ...     add([a, b], res, out, 2.0)
    ... else:  # what it computes, in NumPy
    ...     _ = np.add(a, b, out=res), np.divide(res, 2.0, out=out)
    >>> res.tolist(), out.tolist()
    ([4.0, 7.0], [2.0, 3.5])
"""

from __future__ import annotations

import ctypes

import numpy as np

_library: list = []  # [the CDLL, or None]: loaded once per process
_adders: dict = {}  # dtype -> its adder (or None)


def library():
    """The compiled library (a ``ctypes.CDLL``), or None where the package was built without it."""
    if not _library:
        _library.append(_load())
    return _library[0]


def _load():
    import importlib.machinery
    from pathlib import Path

    here = Path(__file__).parent
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = here / f"_kernels{suffix}"
        if path.is_file():
            try:
                return ctypes.CDLL(str(path))
            except OSError:  # not loadable here
                return None
    return None


def adder(dtype: np.dtype):
    """``add(terms, res, out, divisor)`` for contiguous 1-d arrays of ``dtype`` (float32 or float64), of one
    length: ``res`` = the terms' sum in their order (at least two terms; ``res`` none of them), and ``out``
    = ``res`` (``divisor`` None) or ``res / divisor``, in one pass. The bits of NumPy's ``add`` term by
    term, then its ``divide`` (``tests/unit/test_native.py``). None for another dtype, or where the
    library is missing or older than this function."""
    hit = _adders.get(dtype, False)
    if hit is not False:
        return hit
    lib = library()
    fn = None
    name = {"float32": "coll_add_f32", "float64": "coll_add_f64"}.get(dtype.name) if dtype.isnative else None
    if lib is not None and name is not None:
        try:
            fn = getattr(lib, name)
        except AttributeError:  # an older build
            fn = None
    if fn is None:
        _adders[dtype] = None
        return None
    p = ctypes.c_void_p
    fn.argtypes = [p, ctypes.c_int64, ctypes.c_int64, ctypes.c_double, p, p]
    fn.restype = None
    table = ctypes.c_void_p

    def add(terms, res, out, divisor) -> None:
        k = len(terms)
        fn((table * k)(*[t.ctypes.data for t in terms]), k, res.shape[0], 0.0 if divisor is None else divisor,
           res.ctypes.data, out.ctypes.data)

    _adders[dtype] = add
    return add
