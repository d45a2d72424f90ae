"""The conformance suite of ``collectives``: the documented semantics, as a pytest suite.

Run it with ``mpiexec -n N python -m pytest conformance`` (any N from 1 to 4), or with
``python conformance/run.py`` for a report over several world sizes. See ``docs/conformance.md``.
"""
