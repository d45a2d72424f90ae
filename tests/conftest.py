import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import os

# The flight recorder dumps on every MismatchError and timeout the suites provoke: into the test logs,
# not the working directory (the same directory on every rank of a job: the watcher threads share it).
os.environ.setdefault("COLLECTIVES_TRACE_DIR", str(Path(__file__).resolve().parents[1] / ".test-logs" / "trace"))
