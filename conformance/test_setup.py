"""What the run was asked to exercise is there: every requested array library (or the reason it is not),
and a system under test whose default communicator is the launcher's world."""

from __future__ import annotations

import pytest

from . import _matrix, _options


@pytest.mark.parametrize("lib_name", [pytest.param(n, id=n, marks=_matrix.meta(lib=n, collective="setup",
                                                                                aspect="library available"))
                                      for n in _options.get().libs])
def test_library_available(opts, lib_name):
    why = _matrix.lib_status(lib_name)
    if why is None:
        return
    if opts.require:
        pytest.fail(f"{why} (COLLECTIVES_CONFORMANCE_REQUIRE=1: a requested library must be usable)")
    pytest.skip(why)


@pytest.mark.parametrize("aspect", [pytest.param("communicator", marks=_matrix.meta(collective="setup",
                                                                                    aspect="communicator"))])
def test_communicator(comm, channel, aspect):
    """rank and size are integers, 0 <= rank < size, and every rank agrees on size with distinct ranks."""
    assert isinstance(comm.rank, int) and isinstance(comm.size, int)
    assert 0 <= comm.rank < comm.size
    everyone = channel.allgather((comm.rank, comm.size))
    assert sorted(r for r, _ in everyone) == list(range(comm.size)), f"ranks {everyone}"
    assert {s for _, s in everyone} == {comm.size}, f"sizes {everyone}"
