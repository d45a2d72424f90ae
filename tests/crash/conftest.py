"""A crash test whose failure carries the text of a launcher that could not start (support.launch) runs once
more, saying so: that job never reached the behaviour under test. Any other failure stands as it is."""

import pytest
from _pytest.runner import runtestprotocol
from support.launch import LAUNCH_FAILED


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_protocol(item, nextitem):
    item.ihook.pytest_runtest_logstart(nodeid=item.nodeid, location=item.location)
    reports = runtestprotocol(item, nextitem=nextitem, log=False)
    if any(r.failed and LAUNCH_FAILED.search(r.longreprtext) for r in reports):
        print(f"\n[crash] {item.nodeid}: the launcher did not start: the test runs once more")
        reports = runtestprotocol(item, nextitem=nextitem, log=False)
    for report in reports:
        item.ihook.pytest_runtest_logreport(report=report)
    item.ihook.pytest_runtest_logfinish(nodeid=item.nodeid, location=item.location)
    return True
