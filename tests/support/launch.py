"""What a launcher that could not start at all prints: such a job is not the behaviour under test, and the
runners start it once more (tests/run_all.py for its ``mpiexec`` runs, tests/crash/conftest.py for a crash
test whose failure carries the text).

Open MPI's PMIx server printed "The PMIx server's listener thread failed to start. We cannot continue." in
CI twice (stops 46 and 60: exit 213 within a second, no rank ran), a known intermittent failure of PRRTE's
start on some machines. Example::

    >>> bool(LAUNCH_FAILED.search("The PMIx server's listener thread failed to start. We cannot\\ncontinue."))
    True
"""

import re

LAUNCH_FAILED = re.compile(r"PMIx server's listener thread failed to start")  # (one line in every form of report)
