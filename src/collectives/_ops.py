"""Which reduction ops exist and which are legal on which kind of dtype, with the words of the errors.

Standard library only, so that the ctypes binding of NCCL (``_backends/_libnccl``, which imports no NumPy)
and the dtype table (``_dtypes``) share the one rule and raise the same errors with the same words.
"""

from __future__ import annotations

OPS = ("sum", "prod", "min", "max", "mean")

# kind letters: b bool, i signed, u unsigned, f floating (incl. float16/bfloat16), c complex,
# x opaque (fixed-size but not a number we reduce: structured, strings, datetimes, float8, complex32).
LEGAL = {"sum": "iufc", "prod": "iufc", "min": "biuf", "max": "biuf", "mean": "fc"}


def check_op(op) -> str:
    """Validate the op argument itself (independent of dtype)."""
    if not isinstance(op, str):
        raise TypeError(f"op must be a string, one of {', '.join(map(repr, OPS))}; got {type(op).__name__}")
    if op not in LEGAL:
        raise ValueError(f"unknown op={op!r}; expected one of {', '.join(map(repr, OPS))}")
    return op


def check(kind: str, name: str, op: str) -> None:
    """Raise TypeError if ``op`` is not defined on a dtype of ``kind`` called ``name``."""
    if kind in LEGAL[op]:
        return
    if kind == "b":
        raise TypeError(
            f"op={op!r} is not defined for bool arrays; use op='max' (logical any) or op='min' "
            f"(logical all), or cast to an integer dtype to count"
        )
    if kind == "c":
        raise TypeError(f"op={op!r} is not defined for complex dtype {name}: complex numbers have no order")
    if op == "mean" and kind in "iu":
        raise TypeError(
            f"op='mean' on integer dtype {name} would truncate; cast to a floating dtype first, "
            f"or use op='sum' and divide yourself"
        )
    raise TypeError(
        f"op={op!r} needs a numeric dtype; got {name}, which can only be broadcast or gathered bit for bit"
    )


def kind_of(name: str) -> str:
    """The kind letter of a dtype known by name only (``"float32"``, ``"bfloat16"``, ``"bool"``)."""
    if name == "bool":
        return "b"
    if name.startswith("complex") and name != "complex32":
        return "c"
    if name.startswith("uint"):
        return "u"
    if name.startswith("int"):
        return "i"
    if (name.startswith("float") and not name.startswith("float8")) or name == "bfloat16":
        return "f"
    return "x"
